"""abort() of one group that shares the default group's transports (members-only new_group,
split_group) ends that group's pending work only: the default group and the other groups
keep working. Aborting the default group still ends every group."""

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

from dist_utils import run_ranks


def _all_reduce_check(group, members, salt):
    t = torch.full((5,), float(dist.get_rank() + salt))
    dist.all_reduce(t, group=group)
    expected = float(sum(m + salt for m in members))
    assert torch.equal(t, torch.full((5,), expected)), (members, t)


def _abort_one_split(rank, world):
    import crossbar

    local = dict(use_local_synchronization=True)
    a = dist.new_group([0, 1], **local) if rank < 2 else None
    b = dist.new_group([2, 3], **local) if rank >= 2 else None
    s = dist.split_group(split_ranks=[[0, 2], [1, 3]])
    _all_reduce_check(None, range(world), 0)
    if a is not None:
        me = dist.get_rank(a)
        # Pending on A: a receive nobody sends (the same tag the default group uses below),
        # and on rank 0 a collective rank 1 never joins.
        r = torch.full((3,), -1.0)
        recv = dist.irecv(r, group_src=1 - me, group=a, tag=3)
        coll = dist.all_reduce(torch.ones(4), group=a, async_op=True) if rank == 0 else None
        assert not recv.is_completed()
        _abort_process_group(a)  # pg.abort(): crossbar's backend abort of this group only
        with pytest.raises(crossbar.Aborted, match="abort"):
            recv.wait()
        if coll is not None:
            with pytest.raises(crossbar.Aborted, match="abort"):
                coll.wait()
        assert torch.equal(r, torch.full((3,), -1.0))
    # The default group, the sibling and the split_group groups still work.
    _all_reduce_check(None, range(world), 10)
    if b is not None:
        _all_reduce_check(b, [2, 3], 20)
    _all_reduce_check(s, [0, 2] if rank % 2 == 0 else [1, 3], 30)
    # Point to point on the default group with the aborted receive's tag.
    got = torch.zeros(3)
    if rank == 1:
        dist.send(torch.full((3,), 7.0), dst=0, tag=3)
    elif rank == 0:
        dist.recv(got, src=1, tag=3)
        assert torch.equal(got, torch.full((3,), 7.0))
    # New groups after the abort work too, also over the same ranks as the aborted one.
    if rank < 2:
        again = dist.new_group([0, 1], **local)
        _all_reduce_check(again, [0, 1], 40)
    dist.barrier()


def test_abort_of_a_split_leaves_the_others_working():
    run_ranks(_abort_one_split, 4)


def _abort_world(rank, world, peer_first):
    import crossbar

    a = dist.new_group([0, 1], use_local_synchronization=True)
    _all_reduce_check(a, [0, 1], 0)
    r = torch.zeros(1)
    recv = dist.irecv(r, group_src=1 - rank, group=a, tag=3)
    if peer_first and rank == 0:
        # Rank 1 aborts first: its hang-up fails this receive before this rank aborts, as
        # PeerFailure saying the peer aborted (not that it died).
        deadline = time.monotonic() + 30
        while not recv.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(crossbar.PeerFailure, match="rank 1 .* aborted its communicator"):
            recv.wait()
    dist.group.WORLD.abort()  # the default group: its communicator's context ends
    if not peer_first:
        # Aborted; or, when the peer's abort came first, PeerFailure (above).
        with pytest.raises((crossbar.Aborted, crossbar.PeerFailure)):
            recv.wait()
    with pytest.raises(crossbar.Aborted):  # the split's communicator is aborted with its context
        dist.isend(torch.ones(1), group_dst=1 - rank, group=a, tag=4).wait()


@pytest.mark.parametrize("peer_first", [False, True], ids=["both", "peer_first"])
def test_abort_of_the_default_group_ends_every_group(peer_first):
    run_ranks(_abort_world, 2, peer_first)


def _aborted_receive_is_withdrawn(rank, world):
    import crossbar

    a = dist.new_group([0, 1], use_local_synchronization=True)
    _all_reduce_check(a, [0, 1], 0)
    if rank == 0:
        r = torch.full((3,), -1.0)
        recv = dist.irecv(r, group_src=1, group=a, tag=5)
        _abort_process_group(a)  # rank 0 only: rank 1's side of the group stays up
        with pytest.raises(crossbar.Aborted, match="abort"):
            recv.wait()
    dist.barrier()
    if rank == 1:
        # Into rank 0's aborted receive, were it still posted: on the group (rank 1 did not
        # abort it), then on the default group with the same tag.
        dist.send(torch.full((3,), 7.0), group_dst=0, group=a, tag=5)
        dist.send(torch.full((3,), 8.0), dst=0, tag=5)
        _abort_process_group(a)  # (no goodbye barrier with rank 0, which left the group)
    else:
        got = torch.zeros(3)
        dist.recv(got, src=1, tag=5)  # after the group's message (one shm ring, in order)
        assert torch.equal(got, torch.full((3,), 8.0)), got
        assert torch.equal(r, torch.full((3,), -1.0)), f"an aborted receive's tensor was written: {r}"
    dist.barrier()


def test_an_aborted_receive_is_withdrawn():
    """The abort withdraws the group's pending receive: a message the peer sends later
    (over the same transports) is not written into its tensor."""
    run_ranks(_aborted_receive_is_withdrawn, 2)


def _timed_out_receive_is_withdrawn(rank, world):
    import datetime

    import crossbar

    g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2), use_local_synchronization=True)
    if rank == 0:
        stale = torch.full((3,), -1.0)
        recv = dist.irecv(stale, group_src=1, group=g, tag=8)
        with pytest.raises(crossbar.TimeoutError):
            recv.wait()  # rank 1 sends nothing until told below
        dist.send(torch.ones(1), dst=1, tag=9)
        got = torch.zeros(3)
        dist.recv(got, group_src=1, group=g, tag=8)  # the message the timed-out receive did not take
        assert torch.equal(got, torch.full((3,), 5.0)), got
        assert torch.equal(stale, torch.full((3,), -1.0)), f"a timed-out receive's tensor was written: {stale}"
    else:
        dist.recv(torch.zeros(1), src=0, tag=9)
        dist.send(torch.full((3,), 5.0), group_dst=0, group=g, tag=8)
    dist.barrier()


def test_a_timed_out_receive_is_withdrawn():
    """A receive whose Work timed out is withdrawn: the message sent after the timeout goes
    to the next receive with that tag, not into the timed-out one's tensor."""
    run_ranks(_timed_out_receive_is_withdrawn, 2)
