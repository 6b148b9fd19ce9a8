#!/usr/bin/env python3
"""Runs a perf binary and checks its output has nccl-tests' structure.

  check_perf_output.py [--expect-wrong | --expect-min-bw-fail | --expect-usage-error MSG]
                       [--json-lines FILE] -- COMMAND...

The default expectation is a clean run: exit 0, the header lines, one "#  Rank" line per
rank, the three table header lines exactly as nccl-tests prints them, rows that the
regular expression nccl-tests parsers use accepts with #wrong 0, and the footer.
"""
import argparse
import json
import re
import subprocess
import sys

ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(-?\d+)"
                 r"\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$")
NUM = re.compile(r"^[0-9]+(\.[0-9]+)?$")
HEADER = re.compile(r"^# nThread 1 nGpus 1 minBytes \d+ maxBytes \d+ step: \d+\((factor|bytes)\) "
                    r"warmup iters: \d+ iters: \d+ agg iters: \d+ validation: \d+ graph: \d+$")
RANK = re.compile(r"^#  Rank +(\d+) Group +\d+ Pid +\d+ on +\S+ device cpu \[node \d+\] ")
AVG = re.compile(r"^# Avg bus bandwidth    : ([0-9.eE+-]+) ?(OK|FAILED)?$")
OOB = re.compile(r"^# Out of bounds values : (\d+) (OK|FAILED)$")
JSON_KEYS = {"collective", "bytes", "count", "type", "op", "root", "time_us", "algbw", "busbw", "wrong",
             "in_place", "nranks", "algo"}


def table_header(time="time"):
    return [
        "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          "
        % ("", "", "", "", ""),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s"
        % ("size", "count", "type", "redop", "root", time, "algbw", "busbw", "#wrong", time, "algbw", "busbw",
           "#wrong"),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s"
        % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""),
    ]


def expected_ranks(cmd):
    for flag in ("--nranks", "-np"):
        if flag in cmd:
            return int(cmd[cmd.index(flag) + 1])
    return 1


def fail(msg, out, err):
    sys.stderr.write("FAILED: %s\n--- stdout ---\n%s\n--- stderr ---\n%s\n" % (msg, out, err))
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect-wrong", action="store_true")
    ap.add_argument("--expect-min-bw-fail", action="store_true")
    ap.add_argument("--expect-usage-error")
    ap.add_argument("--json-lines")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=170)
    out, err = p.stdout, p.stderr

    if a.expect_usage_error:
        if p.returncode == 0:
            fail("expected a non-zero exit", out, err)
        if a.expect_usage_error not in err:
            fail("stderr lacks %r" % a.expect_usage_error, out, err)
        if "# Out of bounds" in out:
            fail("a usage error must not run the benchmark", out, err)
        return

    lines = out.splitlines()
    if not any(HEADER.match(l) for l in lines):
        fail("no '# nThread ...' header line", out, err)
    if "# Using devices" not in lines:
        fail("no '# Using devices' line", out, err)
    ranks = [int(m.group(1)) for m in (RANK.match(l) for l in lines) if m]
    if ranks != list(range(expected_ranks(cmd))):
        fail("rank lines %s, expected ranks 0..%d in order" % (ranks, expected_ranks(cmd) - 1), out, err)
    time = "cputime" if "-C" in cmd else "time"
    hdr = table_header(time)
    try:
        i = lines.index(hdr[0])
    except ValueError:
        fail("table header line 1 differs from nccl-tests':\n%r" % hdr[0], out, err)
    if lines[i + 1:i + 3] != hdr[1:]:
        fail("table header lines 2-3 differ from nccl-tests':\n%r\n%r" % tuple(hdr[1:]), out, err)

    rows = []
    for l in lines[i + 3:]:
        if l.startswith("#"):
            break
        if l.startswith("nRanks ") and "skipping" in l:
            continue
        m = ROW.match(l)
        if not m:
            fail("row does not parse: %r" % l, out, err)
        g = m.groups()
        for k in (5, 6, 7, 9, 10, 11):
            if not NUM.match(g[k]):
                fail("non-numeric time/bandwidth column in %r" % l, out, err)
        rows.append(g)
    if not rows and "skipping" not in out:
        fail("no result rows", out, err)
    wrong = [int(float(g[8])) + int(float(g[12])) for g in rows]

    oob = [OOB.match(l) for l in lines]
    oob = [m for m in oob if m]
    avg = [m for m in (AVG.match(l) for l in lines) if m]
    if len(oob) != 1 or len(avg) != 1:
        fail("footer lines missing ('# Out of bounds values', '# Avg bus bandwidth')", out, err)

    if a.expect_wrong:
        if p.returncode == 0 or not any(wrong) or oob[0].group(2) != "FAILED":
            fail("planted corruption not reported (#wrong, FAILED, exit status)", out, err)
        return
    if a.expect_min_bw_fail:
        if p.returncode == 0 or avg[0].group(2) != "FAILED":
            fail("NCCL_TESTS_MIN_BW not enforced", out, err)
        return
    if p.returncode != 0:
        fail("exit status %d" % p.returncode, out, err)
    if any(wrong) or oob[0].group(1) != "0" or oob[0].group(2) != "OK":
        fail("wrong results", out, err)
    if a.json_lines:
        recs = [json.loads(l) for l in open(a.json_lines) if l.strip()]
        if len(recs) != 2 * len(rows):
            fail("%d JSON records for %d rows" % (len(recs), len(rows)), out, err)
        for r in recs:
            if not JSON_KEYS <= set(r):
                fail("JSON record lacks %s" % (JSON_KEYS - set(r)), out, err)


if __name__ == "__main__":
    main()
