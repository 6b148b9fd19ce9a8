"""Runs a function on N spawned ranks with a FileStore rendezvous; a failing rank fails the test."""

import datetime
import os
import tempfile

import torch.multiprocessing as mp


def _entry(rank, fn, world, store_path, backend, args):
    import torch.distributed as dist

    import crossbar  # noqa: F401  (registers the backend)

    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world, *args, backend="cpu:crossbar"):
    """Calls fn(rank, world, *args) in `world` processes after init_process_group(backend)."""
    fd, path = tempfile.mkstemp(prefix="crossbar_store_")
    os.close(fd)
    os.remove(path)
    try:
        mp.spawn(_entry, args=(fn, world, path, backend, args), nprocs=world, join=True)
    finally:
        if os.path.exists(path):
            os.remove(path)
