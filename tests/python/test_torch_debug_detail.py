"""crossbar under TORCH_DISTRIBUTED_DEBUG=DETAIL: torch wraps each new group's backend in
its ProcessGroupWrapper, which checks every collective's fingerprint (op, shapes, and the
backend's sequence number) across ranks before running it. That needs
getSequenceNumberForGroup: torch's generic test test_all_gather_object_subgroup failed with
"Backend crossbar does not yet support sequence numbers" before crossbar had one."""

import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks

CPU = torch.device("cpu")


def _sequence_numbers(rank, world):
    backend = dist.group.WORLD._get_backend(CPU)
    start = backend._get_sequence_number_for_group()
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    dist.barrier()
    # Point to point is not a collective: counted on neither rank.
    if rank == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)
    now = backend._get_sequence_number_for_group()
    assert now == start + 3, (start, now)
    # Every rank counted the same calls.
    seqs = [None] * world
    dist.all_gather_object(seqs, now)
    assert len(set(seqs)) == 1, seqs


def test_sequence_number_counts_collectives():
    run_ranks(_sequence_numbers, 2)


def _detail_group(rank, world):
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    try:
        sub = dist.new_group(backend="crossbar")
        # The wrapper's check asks the backend for its sequence number first.
        objs = [None] * world
        dist.all_gather_object(objs, {"rank": rank}, group=sub)
        assert objs == [{"rank": r} for r in range(world)]
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.full((3,), float(world * (world + 1) // 2)))
        # Mismatched collectives are reported by the wrapper, not run.
        t = torch.ones(2)
        with pytest.raises(RuntimeError, match="mismatch"):
            if rank == 0:
                dist.all_reduce(t, group=sub)
            else:
                dist.broadcast(t, src=0, group=sub)
    finally:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "OFF"
        dist.set_debug_level_from_env()


def test_debug_detail_wrapped_group_runs_collectives():
    run_ranks(_detail_group, 2)
