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
from . import symm  # noqa: E402,F401  (crossbar.symm: symmetric-memory tensors)

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


def _split_source(dist_opts):
    """The crossbar backend a new group splits from, or None for a fresh communicator.

    torch hands a backend ``split_from`` (the default group's) when the default group is
    bound to a device (``init_process_group(..., device_id=torch.device("cpu", 0))`` or a
    CUDA device): then every rank of the default group takes part, non-members through
    ``perform_nocolor_split``, so the new group can be a split of the default group's
    communicator (its transports and rendezvous reused). ``new_group(...,
    use_local_synchronization=True)`` runs on members only, so it cannot take part in a
    split collective over the parent: those (torch names them by a hash of their ranks, the
    others by a counter) are members-only splits, see _members_only_source.
    """
    parent = getattr(dist_opts, "split_from", None)
    if not isinstance(parent, _C.ProcessGroupCrossbar):
        return None  # no split offered, or another backend's (e.g. NCCL for "cpu:crossbar,cuda:nccl")
    if not dist_opts.global_ranks_in_group or not str(getattr(dist_opts, "group_id", "")).isdigit():
        return None
    return parent


def _members_only_source(dist_opts, opts):
    """The crossbar backend a new group splits from on its members only, or None.

    Where torch does not call non-members (``use_local_synchronization=True``, or a default
    group not bound to a device), the members split the default group's crossbar
    communicator without them (``Communicator::splitMembers``): the new group shares its
    transports. A fresh communicator is built instead for the default group itself, when
    the default group is not crossbar, or when ``Options(ranks_per_node=...)`` asks for a
    topology of its own.
    """
    ranks = list(dist_opts.global_ranks_in_group or [])
    if not ranks or opts.ranks_per_node != -1:
        return None
    parent = getattr(dist_opts, "split_from", None)
    if isinstance(parent, _C.ProcessGroupCrossbar):
        return parent
    try:
        default = dist.distributed_c10d._get_default_group()
        parent = default._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError, AttributeError):
        return None  # no default group yet, or none on the CPU
    if not isinstance(parent, _C.ProcessGroupCrossbar) or parent.size() != default.size():
        return None
    return parent


def _create_backend(dist_opts, backend_options):
    """torch.distributed's extended-API factory: one backend per process group."""
    opts = backend_options if isinstance(backend_options, Options) else Options()
    timeout = _to_timedelta(opts.timeout if opts.timeout is not None else dist_opts.timeout)
    parent = _split_source(dist_opts)
    if parent is not None:
        backend = parent._split_for_group(list(dist_opts.global_ranks_in_group), timeout)
        if backend is None or backend.rank() != dist_opts.group_rank or backend.size() != dist_opts.group_size:
            raise errors.InvalidUsage(
                f"rank {dist_opts.group_rank}: split for new_group {list(dist_opts.global_ranks_in_group)} gave "
                f"{'no group' if backend is None else f'rank {backend.rank()} of {backend.size()}'}; "
                "torch and crossbar disagree about the group's ranks"
            )
        return backend
    parent = _members_only_source(dist_opts, opts)
    if parent is not None:
        backend = parent._split_members(list(dist_opts.global_ranks_in_group), timeout, opts.name or "")
        if backend is None or backend.rank() != dist_opts.group_rank or backend.size() != dist_opts.group_size:
            raise errors.InvalidUsage(
                f"rank {dist_opts.group_rank}: members-only split for new_group "
                f"{list(dist_opts.global_ranks_in_group)} gave "
                f"{'no group' if backend is None else f'rank {backend.rank()} of {backend.size()}'}; "
                "torch and crossbar disagree about the group's ranks"
            )
        return backend
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
