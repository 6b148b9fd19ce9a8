#!/usr/bin/env python3
"""crossbar-report on plain per-rank JSONL files (the format Recorder::step() writes):
rank 3 is slow in step 7, rank 1's data loader stalls in step 12, rank 2 leaks memory,
and rank 0 left a torn, unfinished last step. Usage: test_report.py PATH/crossbar-report"""
import json
import os
import subprocess
import sys
import tempfile

MS = 1_000_000
MIB = 1 << 20


def write_job(d, ranks=4, steps=20):
    t0 = 1_000_000_000
    for r in range(ranks):
        with open(os.path.join(d, f"rank{r}.jsonl"), "w") as f:
            t = t0
            for s in range(steps + 1):
                data = 1 * MS + (300 * MS if (r == 1 and s == 12) else 0)
                fwd = 2 * MS + (300 * MS if (r == 3 and s == 7) else 0)
                busy = data + fwd
                slowest = max(1 * MS + (300 * MS if s == 12 else 0) + 2 * MS + (300 * MS if s == 7 else 0), busy)
                wait = slowest - busy  # the barrier holds everyone to the slowest rank
                rss = 100 * MIB + (4 * MIB * s if r == 2 else (s % 3) * 4096)
                line = {"rank": r, "world": ranks, "step": s, "start_ns": t, "end_ns": t + slowest,
                        "step_ns": slowest, "comm_ns": wait, "wait_ns": wait, "ops": 1, "bytes": 0,
                        "dropped": 0, "rss_max": rss, "device_mem_max": 0,
                        "phases": {"data_loading": data, "forward": fwd}}
                t += slowest
                if s == steps and r == 0:
                    f.write(json.dumps(line)[:40])  # torn: rank 0 stopped mid-step
                    break
                f.write(json.dumps(line) + "\n")


def main():
    report = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        write_job(d)
        out = subprocess.run([sys.executable, report, d, "--plots", os.path.join(d, "plots")],
                             capture_output=True, text=True)
        print(out.stdout, out.stderr)
        assert out.returncode == 0, out.returncode
        assert "step 7: straggler rank 3" in out.stdout
        assert "step 12: data-loader stall on rank 1" in out.stdout
        assert "step 12: straggler rank 1" in out.stdout
        assert "memory creep on rank 2" in out.stdout
        for r in (0, 1, 3):
            assert f"memory creep on rank {r}" not in out.stdout
        assert "steps 20" in out.stdout  # the unfinished step is named as not reported
        assert os.path.exists(os.path.join(d, "plots", "step_times.png"))
        assert os.path.exists(os.path.join(d, "plots", "heatmap.png"))

        js = subprocess.run([sys.executable, report, d, "--json", "--no-plots"], capture_output=True, text=True)
        assert js.returncode == 0, js.stderr
        rep = json.loads(js.stdout)
        assert [s["step"] for s in rep["steps"]] == list(range(20))
        assert rep["incomplete"] == [20]
        assert rep["steps"][7]["straggler"] == 3 and rep["steps"][7]["worst_rank"] == 0
        assert rep["steps"][12]["stalls"] == [1]
        assert [c["rank"] for c in rep["creep"] if c["flagged"]] == [2]

        empty = tempfile.mkdtemp(dir=d)
        assert subprocess.run([sys.executable, report, empty], capture_output=True).returncode == 1
    print("ok")


if __name__ == "__main__":
    main()
