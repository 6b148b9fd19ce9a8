"""Step-aligned, rank-aware telemetry for training loops.

The crossbar backend's collectives record every operation (size, algorithm, times, the
wait for the last peer) into a per-process recorder; this module marks what only the
training loop knows: step boundaries and named phases. Each ``step()`` appends one JSON
line to ``<dir>/rank<r>.jsonl``; ``crossbar-report <dir>`` joins the ranks and names the
straggler, data-loader stalls and memory creep::

    import crossbar.telemetry as tel

    tel.enable("runs/telemetry")              # or CROSSBAR_TELEMETRY=1 (+ CROSSBAR_TELEMETRY_DIR)
    tel.register_optimizer(optimizer)         # each optimizer.step() ends a step
    for batch in tel.timed(loader):           # "data_loading" phase around next()
        with tel.phase("forward"):
            loss = model(batch)
        with tel.phase("backward"):
            loss.backward()
        optimizer.step()                      # "optimizer" phase, then step()

Memory: the host RSS high-water of each step comes from the recorder; with CUDA in use,
``step()`` also records ``torch.cuda.max_memory_allocated()`` since the previous step
(and resets the peak). Rank and world size come from torch.distributed when it is
initialized, else from RANK / WORLD_SIZE.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Iterator, Optional

from . import _C

_t = _C._telemetry

__all__ = [
    "enable",
    "disable",
    "enabled",
    "step",
    "phase",
    "timed",
    "register_optimizer",
    "config",
    "aggregate",
]

DATA_LOADING = "data_loading"
FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"


def _rank_and_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover - torch is a dependency of crossbar
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def enable(dir: Optional[str] = None, rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
    """Starts recording. ``dir`` (default: CROSSBAR_TELEMETRY_DIR, itself defaulting to
    ./crossbar-telemetry; "" keeps the summaries in memory only) receives ``rank<r>.jsonl``,
    truncated: a fresh run starts a fresh file."""
    r, w = _rank_and_world()
    if dir is None:
        dir = _t.config()["dir"]
    _t.configure(True, r if rank is None else rank, w if world_size is None else world_size, dir or "")


def disable() -> None:
    """Stops recording (every call becomes one flag check); unflushed records are dropped."""
    c = _t.config()
    _t.configure(False, c["rank"], c["world_size"], c["dir"])


def enabled() -> bool:
    return _t.enabled()


def config() -> dict:
    """The recorder's settings: enabled, rank, world_size, dir, ring_capacity."""
    return _t.config()


def _cuda_peak() -> int:
    """CUDA bytes allocated at peak since the last call (0 without CUDA in use)."""
    try:
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return 0
        peak = int(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        return peak
    except Exception:  # a broken CUDA setup must not stop training
        return 0


def step() -> dict:
    """Ends the current step: writes one JSON line and returns its summary (rank, step,
    step_ns, comm_ns, wait_ns, ops, bytes, rss_max, device_mem_max, phases, waited_on).
    Returns an empty summary (ops 0) when telemetry is off."""
    if not _t.enabled():
        return _t.step()
    peak = _cuda_peak()
    if peak:
        _t.note_device_memory(peak)
    return _t.step()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Times a named phase of the current step ("data_loading", "forward", "backward",
    "optimizer", or any name); repeated phases add up within a step."""
    if not _t.enabled():
        yield
        return
    start = _t.now_ns()
    try:
        yield
    finally:
        _t.record_phase(name, start, _t.now_ns())


def timed(iterable: Iterable, name: str = DATA_LOADING) -> Iterator:
    """Yields from ``iterable``, timing each ``next()`` as phase ``name`` (a data loader's
    stall shows up as a long data_loading phase on that rank)."""
    it = iter(iterable)
    while True:
        with phase(name):
            try:
                item = next(it)
            except StopIteration:
                return
        yield item


class _OptimizerHook:
    """Handles of the hooks register_optimizer() installed; remove() takes them out."""

    def __init__(self, handles):
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def register_optimizer(optimizer, mark_step: bool = True, phase_name: str = OPTIMIZER) -> _OptimizerHook:
    """Times each ``optimizer.step()`` as phase ``phase_name`` and, with ``mark_step``,
    ends the telemetry step after it. Returns a handle with ``remove()``."""
    state = {"start": 0}

    def pre(_opt, _args, _kwargs):
        state["start"] = _t.now_ns()

    def post(_opt, _args, _kwargs):
        if _t.enabled() and state["start"]:
            _t.record_phase(phase_name, state["start"], _t.now_ns())
        state["start"] = 0
        if mark_step:
            step()

    return _OptimizerHook([optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)])


def aggregate(dir: str) -> dict:
    """Joins the ranks' files in ``dir`` with the C++ aggregator (the rules crossbar-report
    applies): complete steps only, worst vs median rank, straggler and margin, stalls,
    memory high-water and creep."""
    import json

    return json.loads(_t.aggregate_dir(dir))
