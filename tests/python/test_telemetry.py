"""crossbar.telemetry through the Python API on the crossbar backend: a 4-rank synthetic
training job (real all_reduce on crossbar, a torch optimizer with the step hook) where
rank 3 is slow in step 3's forward, rank 1's data loader stalls in step 5 and rank 2
leaks 8 MiB per step; the report (crossbar-report and the C++ aggregator) names all three,
and the step only rank 0 finished is not reported. Planted delays are 300 ms; nothing else depends on timing."""

import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from dist_utils import run_ranks

SLOW_RANK, SLOW_STEP = 3, 3
STALL_RANK, STALL_STEP = 1, 5
LEAK_RANK, LEAK_PER_STEP = 2, 8 << 20
STEPS = 8
DELAY_S = 0.3


def _loader(rank, steps):
    for step in range(steps):
        if rank == STALL_RANK and step == STALL_STEP:
            time.sleep(DELAY_S)
        yield torch.full((64,), float(rank))


def _job(rank, world, outdir):
    import crossbar.telemetry as tel

    tel.enable(outdir)
    assert tel.enabled() and tel.config()["rank"] == rank and tel.config()["world_size"] == world
    w = torch.nn.Parameter(torch.zeros(64))
    opt = torch.optim.SGD([w], lr=0.1)
    hook = tel.register_optimizer(opt)
    leaked = []
    for step, batch in enumerate(tel.timed(_loader(rank, STEPS))):
        with tel.phase("forward"):
            if rank == SLOW_RANK and step == SLOW_STEP:
                time.sleep(DELAY_S)
            loss = ((w - batch) ** 2).sum()
        if rank == LEAK_RANK:
            leaked.append(b"\x01" * LEAK_PER_STEP)  # written, so resident at once
        with tel.phase("backward"):
            loss.backward()
            dist.all_reduce(w.grad)  # on crossbar: recorded by the collectives
        opt.step()  # "optimizer" phase, then the step boundary
        opt.zero_grad()
    hook.remove()
    # Rank 0 starts one more step that the others never finish: it must not be reported.
    if rank == 0:
        with tel.phase("forward"):
            pass
        last = tel.step()
        assert last["step"] == STEPS
    tel.disable()
    assert not tel.enabled()


def _read(outdir, rank):
    with open(os.path.join(outdir, f"rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_synthetic_job_names_straggler_and_stall(tmp_path):
    outdir = str(tmp_path / "telemetry")
    run_ranks(_job, 4, outdir)

    # Per-rank lines: every step has the phases, the backend's all_reduce and memory.
    for rank in range(4):
        lines = _read(outdir, rank)
        assert len(lines) == STEPS + (1 if rank == 0 else 0)
        for s in lines[:STEPS]:
            assert s["rank"] == rank and s["world"] == 4
            assert set(s["phases"]) >= {"data_loading", "forward", "backward", "optimizer"}
            assert s["ops"] >= 1 and s["bytes"] >= 64 * 4  # the all_reduce of w.grad
            assert s["rss_max"] > 0
        assert [s["step"] for s in lines] == list(range(len(lines)))

    # crossbar-report (Python) and the C++ aggregator agree.
    build = os.environ.get("CROSSBAR_BUILD_DIR", "build")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    report_bin = os.path.join(build if os.path.isabs(build) else os.path.join(root, build), "bin", "crossbar-report")
    if not os.path.exists(report_bin):
        report_bin = os.path.join(root, "telemetry", "crossbar-report")
    res = subprocess.run([sys.executable, report_bin, outdir, "--json", "--no-plots"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)

    import crossbar.telemetry as tel

    native = tel.aggregate(outdir)
    for r in (report, native):
        assert [s["step"] for s in r["steps"]] == list(range(STEPS))
        assert r["incomplete"] == [STEPS]
        by_step = {s["step"]: s for s in r["steps"]}
        assert by_step[SLOW_STEP]["straggler"] == SLOW_RANK
        assert by_step[SLOW_STEP]["straggler_margin_ns"] > DELAY_S * 1e9 / 3
        assert STALL_RANK in by_step[STALL_STEP]["stalls"]
        # (no assertion on other steps' stalls: a 20 ms scheduling hiccup on a busy
        # machine is a real, if small, stall)
        creep = {c["rank"]: c for c in r["creep"]}
        assert creep[LEAK_RANK]["flagged"], creep
        assert creep[LEAK_RANK]["slope_bytes_per_step"] > LEAK_PER_STEP / 2
    findings = "\n".join(report["findings"])
    assert f"step {SLOW_STEP}: straggler rank {SLOW_RANK}" in findings
    assert f"step {STALL_STEP}: data-loader stall on rank {STALL_RANK}" in findings
    assert f"steps {STEPS}" in findings
    assert f"memory creep on rank {LEAK_RANK}" in findings


def test_disabled_records_nothing(tmp_path):
    import crossbar.telemetry as tel

    tel.disable()
    with tel.phase("forward"):
        pass
    assert tel.step()["ops"] == 0
    assert list(tel.timed([1, 2])) == [1, 2]


def test_single_process_step_summary_and_cuda_peak(tmp_path):
    import crossbar.telemetry as tel

    tel.enable(str(tmp_path), rank=0, world_size=1)
    try:
        with tel.phase("forward"):
            time.sleep(0.01)
        with tel.phase("forward"):
            pass
        s = tel.step()
        assert s["step"] == 0 and s["phases"]["forward"] >= 10_000_000
        assert s["rss_max"] > 0
        if torch.cuda.is_available():
            x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            del x
            s = tel.step()
            assert s["device_mem_max"] >= 64 << 20
    finally:
        tel.disable()
    lines = [json.loads(line) for line in open(tmp_path / "rank0.jsonl")]
    assert lines[0]["phases"]["forward"] >= 10_000_000


TORCHRUN_SCRIPT = """
import os, sys, torch, torch.distributed as dist
import crossbar, crossbar.telemetry as tel
dist.init_process_group("cpu:crossbar")
tel.enable(sys.argv[1])
x = torch.ones(16)
for _ in range(3):
    with tel.phase("forward"):
        dist.all_reduce(x)
    tel.step()
tel.disable()
dist.destroy_process_group()
"""


def test_torchrun_writes_one_file_per_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    outdir = tmp_path / "tel"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(outdir)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    for rank in (0, 1):
        lines = _read(str(outdir), rank)
        assert [s["step"] for s in lines] == [0, 1, 2]
        assert all(s["ops"] >= 1 and s["world"] == 2 for s in lines)
