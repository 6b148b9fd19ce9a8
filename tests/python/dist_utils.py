"""Runs a function on N spawned ranks with a FileStore rendezvous; a failing rank fails the test."""

import datetime
import os
import tempfile

import torch.multiprocessing as mp


def _entry(rank, fn, world, store_path, backend, args, device_id=None):
    import torch.distributed as dist

    import crossbar  # noqa: F401  (registers the backend)

    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
        device_id=device_id,
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world, *args, backend="cpu:crossbar", device_id=None):
    """Calls fn(rank, world, *args) in `world` processes after init_process_group(backend).

    device_id binds the default group to a device (torch then builds new groups by
    splitting it, see crossbar._split_source)."""
    fd, path = tempfile.mkstemp(prefix="crossbar_store_")
    os.close(fd)
    os.remove(path)
    try:
        mp.spawn(_entry, args=(fn, world, path, backend, args, device_id), nprocs=world, join=True)
    finally:
        if os.path.exists(path):
            os.remove(path)
