"""new_group on members only: use_local_synchronization=True (non-members never call) and
new_group on a default group not bound to a device are members-only splits of the default
group's communicator (Communicator::splitMembers), sharing its transports."""

import torch
import torch.distributed as dist

from dist_utils import run_ranks

CPU = torch.device("cpu")


def _comm_name(group):
    # describe(): "<communicator name>: rank r/n, ..."
    d = group._get_backend(CPU).describe()
    return d[: d.index(": rank ")]


def _check_group(group, rank, members):
    """Collectives and point to point on `group` (global ranks `members`, torch sorts them)."""
    members = sorted(members)
    n = len(members)
    me = members.index(rank)
    assert dist.get_rank(group) == me and dist.get_world_size(group) == n
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((4,), float(sum(members) + n))), (members, t)
    b = torch.full((3,), float(rank)) if me == n - 1 else torch.zeros(3)
    dist.broadcast(b, group_src=n - 1, group=group)
    assert torch.equal(b, torch.full((3,), float(members[-1])))
    out = [torch.zeros(2, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(out, torch.tensor([rank, 10 * rank]), group=group)
    assert [o.tolist() for o in out] == [[m, 10 * m] for m in members]
    if n > 1:
        # A ring in group ranks, with the same tag as on the default group (kept apart).
        nxt, prv = (me + 1) % n, (me - 1) % n
        r = torch.zeros(1)
        reqs = [dist.isend(torch.full((1,), float(rank)), group_dst=nxt, group=group, tag=5),
                dist.irecv(r, group_src=prv, group=group, tag=5)]
        for q in reqs:
            q.wait()
        assert r.item() == float(members[prv])


def _local_groups(rank, world):
    import crossbar

    parent = _comm_name(dist.group.WORLD)
    # A topology of its own (ranks_per_node) still gets a fresh communicator, over the
    # store prefix torch names the group by. (First: after ranks made different numbers
    # of use_local_synchronization groups, torch names later groups differently on
    # different ranks, and fresh communicators could not meet; splits do not use names.)
    fresh = dist.new_group([0, 1], pg_options=crossbar.Options(ranks_per_node=1, name="own"))
    if rank < 2:
        assert _comm_name(fresh) == "own"
        _check_group(fresh, rank, [0, 1])
    local = dict(use_local_synchronization=True)
    # Only the members call, in different orders: rank 0 makes C before A, rank 3 B before
    # C; ranks 1 and 2 make only their own group. A and B are disjoint, C overlaps both.
    a = b = c = None
    if rank == 0:
        c = dist.new_group([3, 0], **local)
        a = dist.new_group([0, 2], **local)
    elif rank == 1:
        b = dist.new_group([3, 1], **local)
    elif rank == 2:
        a = dist.new_group([2, 0], **local)
    else:
        b = dist.new_group([1, 3], **local)
        c = dist.new_group([0, 3], **local)
    for g, members in ((a, [0, 2]), (b, [1, 3]), (c, [0, 3])):
        if g is None:
            continue
        backend = g._get_backend(CPU)
        assert isinstance(backend, crossbar.ProcessGroupCrossbar)
        # A split of the default group's communicator (its transports), not a fresh one.
        assert _comm_name(g).startswith(parent + ".["), (_comm_name(g), parent)
        _check_group(g, rank, members)
    # Groups of one rank, each made by that rank alone.
    solo = dist.new_group([rank], **local)
    t = torch.full((2,), float(rank))
    dist.all_reduce(t, group=solo)
    assert torch.equal(t, torch.full((2,), float(rank)))
    assert dist.get_world_size(solo) == 1
    # The same ranks again: a second group, whose traffic stays apart from the first's.
    if rank in (0, 2):
        a2 = dist.new_group([0, 2], **local)
        assert _comm_name(a2) != _comm_name(a)
        x, y = torch.zeros(1), torch.zeros(1)
        if rank == 0:
            dist.send(torch.ones(1), group_dst=1, group=a, tag=9)
            dist.send(torch.full((1,), 2.0), group_dst=1, group=a2, tag=9)
        else:
            dist.recv(y, group_src=0, group=a2, tag=9)  # a2's first: a's message must not match
            dist.recv(x, group_src=0, group=a, tag=9)
            assert (x.item(), y.item()) == (1.0, 2.0)
        # Nested: split_group of a members-only group (collective over its members).
        inner = dist.split_group(parent_pg=a2, split_ranks=[[1], [0]])
        t = torch.full((1,), float(rank))
        dist.all_reduce(t, group=inner)
        assert t.item() == float(rank)
    # Without use_local_synchronization (all ranks call; the default group is not bound
    # to a device, so torch calls members only): also a members-only split.
    three = dist.new_group([1, 2, 3])
    if rank == 0:
        assert three is dist.GroupMember.NON_GROUP_MEMBER
    else:
        assert _comm_name(three).startswith(parent + ".["), _comm_name(three)
        _check_group(three, rank, [1, 2, 3])
        # And a members-only group made from inside it, by its members only.
        pair = dist.new_group([2, 3], **local) if rank >= 2 else None
        if pair is not None:
            _check_group(pair, rank, [2, 3])
    # The default group is unaffected.
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(world)))


def test_members_only_new_groups():
    run_ranks(_local_groups, 4)
