"""crossbar.ft: torch.distributed process groups that survive failed ranks.

A :class:`FaultTolerantGroup` runs crossbar's fault-tolerant communicator (C++
``crossbar::ft::FaultTolerantComm``): a failure detector per process watches the other
ranks (process liveness on the same host, heartbeats through the store, data-path
probes across nodes), and the first rank that sees a failure revokes the group for
everyone, so no collective hangs on a dead, stopped or unreachable rank. The survivors
then :meth:`~FaultTolerantGroup.shrink` to a new, smaller process group and continue;
replacement processes :meth:`~FaultTolerantGroup.join` and the members
:meth:`~FaultTolerantGroup.grow` back to full size. ``group`` is always an ordinary
``torch.distributed.ProcessGroup`` (backend crossbar, CPU tensors) for the current
members::

    import torch.distributed as dist
    from crossbar import ft

    def sync(step):  # everyone takes group rank 0's parameters and step
        for p in model.parameters():
            dist.broadcast(p.data, group_src=0, group=g.group)
        s = torch.tensor([step])
        dist.broadcast(s, group_src=0, group=g.group)
        return int(s)

    store = dist.TCPStore(host, port, is_master=False)   # must outlive every rank
    g = ft.FaultTolerantGroup(store, rank, world_size, name="train")
    step = sync(0)
    while step < steps:
        try:
            loss = model(batch(step)).sum()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, group=g.group)
                p.grad /= g.size
            opt.step(); opt.zero_grad(); step += 1
        except ft.FAILURES as e:
            g.handle_error(e)      # who failed, and how (dead / hung / unreachable)
            opt.zero_grad()
            g.shrink()             # survivors only; ranks renumbered 0..n-1
            step = sync(step)      # a survivor may have finished the failed step
        if want_full_size and g.size < world_size:
            g.grow(world_size)     # admits processes waiting in FaultTolerantGroup.join()
            step = sync(step)      # newcomers take the members' state

torch's own ``dist.shrink_group(ranks, group=g.group)`` (torch >= 2.10) works on these
groups too: the backend runs the same agreement and returns the next epoch's backend,
which torch wraps into a new group. The ranks passed must be exactly those the
survivors agree to exclude (the faults from ``handle_error()``; a rank that was only
slow is not excluded); otherwise it raises after the shrink, and ``g.group`` is the
agreed group. ``g.group`` follows the shrink either way.

A replacement process runs ``g = ft.FaultTolerantGroup.join(store, name="train")``,
which returns once the members' ``grow()`` admitted it, then calls the same ``sync``. A process the survivors left out (it was stopped too long, or on the losing
side of a cut link) gets :class:`Excluded` from ``shrink()``: it must stop using the
group (it may exit, or ``join()`` again).

Ranks in ``group`` are the current epoch's: use ``group_src``/``group_dst`` (or
``g.rank``), not global ranks. Operations issued on an old ``group`` after a shrink
or grow raise (it is shut down); take ``g.group`` again after each transition.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from . import _C
from . import errors

__all__ = ["FaultTolerantGroup", "Fault", "Excluded", "FAILURES"]

#: Raised by shrink()/grow() in a process the survivors left out (subclass of Aborted).
Excluded = _C.Excluded

#: What an operation on a failed group raises: catch these around a training step.
FAILURES = (errors.PeerFailure, errors.TimeoutError, errors.Aborted)

_CODES = ((errors.PeerFailure, "PeerFailure"), (errors.TimeoutError, "Timeout"), (errors.Aborted, "Aborted"))
_serial = itertools.count()


@dataclasses.dataclass(frozen=True)
class Fault:
    """One failed rank as the detector classified it."""

    rank: int  # in the epoch the failure happened in
    kind: str  # "dead", "hung" (reported as a timeout), "unreachable" (cut link), "store lost"
    host: str
    pid: int
    reporter: int  # the rank that detected it
    detail: str  # how it was detected
    description: str  # "rank 2 (host a, pid 12) died: process gone"


def _ms(t, default_ms: int = 0) -> datetime.timedelta:
    if t is None:
        return datetime.timedelta(milliseconds=default_ms)
    if isinstance(t, datetime.timedelta):
        return t
    return datetime.timedelta(seconds=float(t))


class FaultTolerantGroup:
    """A fault-tolerant crossbar process group (see the module documentation).

    Collective over ``world_size`` processes sharing ``store`` (a c10d Store that outlives
    every rank: torchrun's, or a TCPStore served by a launcher). ``timeout`` bounds
    operations and transitions; ``detect_timeout`` is how long a silent rank may stay
    silent before it is reported (default ``CROSSBAR_FT_DETECT_TIMEOUT``, 5 s);
    ``heartbeat`` is the detector period (``CROSSBAR_FT_HEARTBEAT``, 100 ms).
    """

    def __init__(self, store, rank: int, world_size: int, *, name: str = "ft", timeout=None,
                 detect_timeout=None, heartbeat=None, _impl=None):
        self._store = store
        self._name = name
        if _impl is None:
            _impl = _C.FaultTolerantGroup.create(store, rank, world_size, name, _ms(timeout), _ms(detect_timeout),
                                                 _ms(heartbeat))
        self._impl = _impl
        self._group = None
        self._group_name = None
        self._group_epoch = None
        self._wrap()

    @classmethod
    def join(cls, store, *, name: str = "ft", timeout=None, detect_timeout=None, heartbeat=None):
        """A replacement process: returns once the members' grow() admitted it."""
        impl = _C.FaultTolerantGroup.join(store, name, _ms(timeout), _ms(detect_timeout), _ms(heartbeat))
        return cls(store, -1, -1, name=name, _impl=impl)

    # ---- state -----------------------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup:
        """The current members' process group (changes with every shrink and grow)."""
        if self._group is not None and self._group_epoch != self._impl.epoch:
            # torch.distributed.shrink_group() moved the communicator on (and destroyed
            # the old group); give the new epoch's backend a group of our own too.
            self._retire()
            self._wrap()
        return self._group

    @property
    def rank(self) -> int:
        return self._impl.rank

    @property
    def size(self) -> int:
        return self._impl.size

    @property
    def epoch(self) -> int:
        """0 at creation; +1 with every shrink and grow."""
        return self._impl.epoch

    @property
    def revoked(self) -> bool:
        """True once any rank reported a failure (or abort()); operations then fail fast."""
        return self._impl.revoked

    def faults(self) -> list[Fault]:
        """Failures known in the current epoch."""
        return [Fault(**f) for f in self._impl.faults()]

    # ---- failure handling --------------------------------------------------------------
    def handle_error(self, exc: BaseException) -> list[Fault]:
        """Classifies the ranks ``exc`` (from an operation on ``group``) names and revokes
        the group for everyone. Returns every fault known in this epoch."""
        code = getattr(exc, "code", None)
        if not isinstance(code, str):
            code = next((c for t, c in _CODES if isinstance(exc, t)), "Error")
        peers = [int(p) for p in (getattr(exc, "peers", None) or [])]
        return [Fault(**f) for f in self._impl.handle_error(code, peers, str(exc))]

    def abort(self, reason: str = "abort() called") -> None:
        """Nonblocking, idempotent, callable from any thread (e.g. a watchdog): revokes
        the group for every rank and fails pending operations."""
        self._impl.abort(reason)

    def shrink(self) -> dist.ProcessGroup:
        """Collective over the survivors: agree on who is left, rebuild, return the new
        ``group``. Raises :class:`Excluded` in a process the survivors left out."""
        self._retire()
        self._impl.shrink()
        self._wrap()
        return self._group

    def grow(self, target_size: int) -> dist.ProcessGroup:
        """Collective over the members: admit ``target_size - size`` processes waiting in
        :meth:`join` (in arrival order; they get the highest ranks); returns the new group."""
        self._retire()
        self._impl.grow(target_size)
        self._wrap()
        return self._group

    def close(self) -> None:
        """Leaves cleanly (the others do not report this process as failed)."""
        self._retire()
        self._impl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- torch.distributed plumbing ----------------------------------------------------
    def _wrap(self) -> None:
        """Wraps the current epoch's crossbar backend into a registered ProcessGroup."""
        backend = self._impl.backend()
        epoch, rank, size = self._impl.epoch, self._impl.rank, self._impl.size
        name = f"crossbar-ft:{self._name}:e{epoch}:{next(_serial)}"
        prefix = dist.PrefixStore(f"crossbar/ft/{self._name}/e{epoch}/pg/", self._store)
        pg = dist.ProcessGroup(prefix, rank, size)
        cpu, custom = torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM
        pg._register_backend(cpu, custom, backend)
        if hasattr(pg, "_set_default_backend"):
            pg._set_default_backend(custom)
        if hasattr(pg, "_set_group_name"):
            pg._set_group_name(name)
        # Registered like torch's own groups, so collectives can resolve ranks in it.
        w = _c10d._world
        w.pg_map[pg] = ("crossbar", prefix)
        w.pg_names[pg] = name
        w.pg_group_ranks[pg] = {r: r for r in range(size)}
        w.pg_backend_config[pg] = "cpu:crossbar"
        if hasattr(_c10d, "_register_process_group"):
            _c10d._register_process_group(name, pg)
        self._group, self._group_name, self._group_epoch = pg, name, epoch

    def _retire(self) -> None:
        pg, name = self._group, self._group_name
        self._group = self._group_name = None
        if pg is None:
            return
        w = _c10d._world
        for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config):
            table.pop(pg, None)
        if hasattr(_c10d, "_unregister_process_group"):
            try:
                _c10d._unregister_process_group(name)
            except Exception:  # noqa: BLE001 - registry layout differs between torch versions
                pass
