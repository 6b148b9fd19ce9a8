"""recv without src (any-source receive) and torch.distributed.split_group on crossbar."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks


def _any_source(rank, world):
    # Every other rank sends its rank twice (tags 0 and 5); rank 0 receives without src and
    # learns the sender from recv's return value / the work's source rank.
    if rank == 0:
        senders = []
        for _ in range(world - 1):
            t = torch.zeros(4)
            src = dist.recv(t)
            assert torch.equal(t, torch.full((4,), float(src))), (src, t)
            senders.append(src)
        assert sorted(senders) == list(range(1, world))
        # irecv without src, into a non-contiguous tensor, with a tag.
        works = []
        outs = []
        for _ in range(world - 1):
            base = torch.zeros(4, 2)
            outs.append(base)
            works.append(dist.irecv(base[:, 0], tag=5))
        got = []
        for w, base in zip(works, outs):
            w.wait()
            src = w._source_rank()
            assert torch.equal(base[:, 0], torch.full((4,), float(src) + 0.5))
            assert torch.equal(base[:, 1], torch.zeros(4))
            got.append(src)
        assert sorted(got) == list(range(1, world))
    else:
        dist.send(torch.full((4,), float(rank)), dst=0)
        dist.send(torch.full((4,), float(rank) + 0.5), dst=0, tag=5)
    # A size mismatch is an error of that receive, naming the sender.
    if rank == 1:
        import crossbar

        with pytest.raises(crossbar.InvalidUsage, match="sent 8 bytes"):
            dist.recv(torch.zeros(4))
    elif rank == 0:
        dist.send(torch.zeros(2), dst=1)
    dist.barrier()


def test_recv_any_source():
    run_ranks(_any_source, 3)


def _split(rank, world):
    import crossbar

    pg = dist.distributed_c10d._get_default_group()
    assert pg._get_backend(torch.device("cpu")).supports_splitting
    # Pairs in reversed order: the position in each list is the group rank.
    sub = dist.split_group(split_ranks=[[1, 0], [3, 2]])
    assert sub is not None and sub is not dist.GroupMember.NON_GROUP_MEMBER
    assert dist.get_world_size(sub) == 2
    assert dist.get_rank(sub) == (1 if rank % 2 == 0 else 0)
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=sub)
    pair = rank // 2 * 2
    assert torch.equal(t, torch.full((3,), float(pair + pair + 1)))
    # Rank 0 of the subgroup broadcasts (global rank 1 or 3).
    b = torch.full((2,), float(rank))
    dist.broadcast(b, group_src=0, group=sub)
    assert torch.equal(b, torch.full((2,), float(pair + 1)))
    # Point to point inside the subgroup, any source: recv returns the global rank.
    if dist.get_rank(sub) == 0:
        r = torch.zeros(1)
        assert dist.recv(r, group=sub) == pair
        assert r.item() == pair
    else:
        dist.send(torch.full((1,), float(rank)), group_dst=0, group=sub)
    # A split that leaves ranks out: they get NON_GROUP_MEMBER.
    first = dist.split_group(split_ranks=[[0, 1]])
    if rank < 2:
        t = torch.ones(1)
        dist.all_reduce(t, group=first)
        assert t.item() == 2.0
        backend = first._get_backend(torch.device("cpu"))
        assert isinstance(backend, crossbar.ProcessGroupCrossbar)
    else:
        assert first is dist.GroupMember.NON_GROUP_MEMBER
    # The parent group still works, and a split of a split.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == float(world)
    inner = dist.split_group(parent_pg=sub, split_ranks=[[0], [1]])
    t = torch.full((1,), float(rank))
    dist.all_reduce(t, group=inner)
    assert t.item() == float(rank)
    dist.barrier()


def test_split_group():
    run_ranks(_split, 4)
