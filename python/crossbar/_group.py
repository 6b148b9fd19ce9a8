"""Helpers shared by crossbar's Python APIs over a process group (symm, moe)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C


def crossbar_backend(group, who: str):
    """The crossbar backend (``_C.ProcessGroupCrossbar``) of ``group`` (default: the world) for
    CPU tensors; ``who`` (e.g. ``"crossbar.symm"``) names the caller in the errors."""
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError(f"{who}: call torch.distributed.init_process_group first")
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError as e:
        raise RuntimeError(
            f"{who} needs a process group with crossbar for CPU tensors "
            "(init_process_group('crossbar') or 'cpu:crossbar,cuda:nccl')"
        ) from e
    if not isinstance(backend, _C.ProcessGroupCrossbar):
        raise RuntimeError(f"{who}: the group's CPU backend is {type(backend).__name__}, not crossbar")
    return backend
