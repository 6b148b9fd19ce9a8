"""crossbar: communication toolkit for distributed PyTorch, as a torch.distributed backend.

``import crossbar`` registers the backend ``"crossbar"``::

    import crossbar, torch.distributed as dist
    dist.init_process_group("crossbar")             # CPU tensors on crossbar
    dist.init_process_group("cpu:crossbar,cuda:nccl")  # CUDA tensors on NCCL

Backend options go through ``pg_options=crossbar.Options(...)`` (or the
``CROSSBAR_*`` environment variables).
"""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

from . import errors
from .errors import (  # noqa: F401
    Aborted,
    CrossbarError,
    InvalidArgument,
    InvalidUsage,
    PeerFailure,
    SystemError,
    TimeoutError,
    Unsupported,
)
from . import _C

__version__ = _C._build_info()["version"]
ProcessGroupCrossbar = _C.ProcessGroupCrossbar

__all__ = [
    "Options",
    "ProcessGroupCrossbar",
    "info",
    "errors",
    "CrossbarError",
    "TimeoutError",
    "PeerFailure",
    "Aborted",
    "InvalidUsage",
    "InvalidArgument",
    "Unsupported",
]


@dataclasses.dataclass
class Options:
    """Backend options (pass as ``pg_options``); None means the process-group's or env's value."""

    timeout: datetime.timedelta | None = None
    ranks_per_node: int = -1  # topology override for testing virtual nodes; -1: CROSSBAR_RANKS_PER_NODE
    name: str | None = None  # communicator name in logs and errors


def _to_timedelta(t) -> datetime.timedelta:
    if isinstance(t, datetime.timedelta):
        return t
    return datetime.timedelta(seconds=float(t))


def _create_backend(dist_opts, backend_options):
    """torch.distributed's extended-API factory: one backend per process group."""
    opts = backend_options if isinstance(backend_options, Options) else Options()
    timeout = _to_timedelta(opts.timeout if opts.timeout is not None else dist_opts.timeout)
    name = opts.name or (f"pg:{dist_opts.group_id}" if getattr(dist_opts, "group_id", "") else "torch")
    return _C.ProcessGroupCrossbar(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        timeout,
        opts.ranks_per_node,
        name,
    )


def _register() -> None:
    if "crossbar" in dist.Backend.backend_list and "CROSSBAR" in getattr(dist.Backend, "_plugins", {}):
        return
    # devices: crossbar claims CPU; "cuda" is listed so "crossbar" alone initializes on a
    # GPU machine too (CUDA tensors then raise Unsupported; use "cpu:crossbar,cuda:nccl").
    dist.Backend.register_backend("crossbar", _create_backend, extended_api=True, devices=["cpu", "cuda"])


def info() -> dict:
    """What this build contains: version, build type, transports, the torch it was built for."""
    d = dict(_C._build_info())
    d["torch_runtime"] = torch.__version__
    d["backend_registered"] = "crossbar" in dist.Backend.backend_list
    return d


_register()
