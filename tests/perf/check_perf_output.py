#!/usr/bin/env python3
"""Runs a perf binary and checks its output has nccl-tests' structure.

  check_perf_output.py [--expect-wrong | --expect-min-bw-fail | --expect-usage-error MSG]
                       [--json-lines FILE] [--output-json FILE [--json-exists]]
                       [--expect-stderr MSG] [--expect-line REGEX] -- COMMAND...

The default expectation is a clean run: exit 0, the header lines, one "#  Rank" line per
rank, the three table header lines exactly as nccl-tests prints them, rows that the
regular expression nccl-tests parsers use accepts with #wrong 0, and the footer. With -I 1
(per-iteration timing) and -S 1 (timestamps) in the command, the extra columns are expected
as nccl-tests 2.19 prints them. --output-json checks the -J document (nccl-tests' JSON
schema, version 3); --json-exists creates FILE first, so the output must go to FILE.0.
"""
import os
import argparse
import json
import re
import subprocess
import sys

ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(-?\d+)"
                 r"\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$")
NUM = re.compile(r"^[0-9]+(\.[0-9]+)?(e[+-][0-9]+)?$")
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$")
HEADER = re.compile(r"^# nThread 1 nGpus 1 minBytes \d+ maxBytes \d+ step: \d+\((factor|bytes)\) "
                    r"warmup iters: \d+ iters: \d+ agg iters: \d+ validation: \d+ graph: \d+ unalign: \d+$")
RANK = re.compile(r"^#  Rank +(\d+) Group +\d+ Pid +\d+ on +\S+ device cpu \[node \d+\] ")
AVG = re.compile(r"^# Avg bus bandwidth    : ([0-9.eE+-]+) ?(OK|FAILED)?$")
OOB = re.compile(r"^# Out of bounds values : (\d+) (OK|FAILED)$")
JSON_KEYS = {"collective", "bytes", "count", "type", "op", "root", "time_us", "algbw", "busbw", "wrong",
             "in_place", "nranks", "algo"}


def table_header(time="time", stamps=False, per_iter=False):
    """nccl-tests 2.19 util.cu writeResultHeader, format for format."""
    ts_lbl, ts_pad, ts_fmt = ("timestamp", 19, "%Y-%m-%d %H:%M:%S") if stamps else ("", 0, "")
    if per_iter:
        fmt = ("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s  %7s  %6s  %6s  %6s  %7s  %7s  "
               "%7s  %7s %*s")
        return [
            "# %10s  %12s  %8s  %6s  %6s              out-of-place (+ per-iteration)                                "
            "in-place (+ per-iteration)" % ("", "", "", "", ""),
            fmt % ("size", "count", "type", "redop", "root", time, "algbw", "busbw", "#wrong", "i_min", "i_max",
                   "i_p99", "i_cv%", time, "algbw", "busbw", "#wrong", "i_min", "i_max", "i_p99", "i_cv%", ts_pad,
                   ts_lbl),
            fmt % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(us)", "(%)",
                   "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(us)", "(%)", ts_pad, ts_fmt),
        ]
    fmt = "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s"
    return [
        "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          "
        % ("", "", "", "", ""),
        fmt % ("size", "count", "type", "redop", "root", time, "algbw", "busbw", "#wrong", time, "algbw", "busbw",
               "#wrong", ts_pad, ts_lbl),
        fmt % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "",
               ts_pad, ts_fmt),
    ]


def flag_value(cmd, short, long):
    for i, a in enumerate(cmd):
        if a == short or a == long:
            return cmd[i + 1] if i + 1 < len(cmd) else None
        if a.startswith(long + "="):
            return a.split("=", 1)[1]
        if a.startswith(short) and len(a) > len(short) and not a.startswith("--"):
            return a[len(short):]
    return None


def check_output_json(path, rows, nranks, out, err, cputime):
    if not os.path.exists(path):
        fail("-J file %s was not written" % path, out, err)
    doc = json.load(open(path))
    for k in ("version", "start_time", "args", "env", "nccl_version", "config", "results", "out_of_bounds",
              "average_bus_bandwidth", "errors", "end_time"):
        if k not in doc:
            fail("-J document lacks %r" % k, out, err)
    if doc["version"] != 3:
        fail("-J version %r, expected 3" % doc["version"], out, err)
    if len(doc["config"]["devices"]) != nranks:
        fail("-J config.devices has %d entries for %d ranks" % (len(doc["config"]["devices"]), nranks), out, err)
    if len(doc["results"]) != len(rows):
        fail("-J has %d results for %d rows" % (len(doc["results"]), len(rows)), out, err)
    tkey = "cpu_time" if cputime else "time"
    for r, g in zip(doc["results"], rows):
        if str(r["size"]) != g[0] or str(r["count"]) != g[1] or r["type"] != g[2] or r["redop"] != g[3]:
            fail("-J result %r does not match row %r" % (r, g), out, err)
        if r["root"].strip() != g[4]:
            fail("-J root %r vs row %r" % (r["root"], g[4]), out, err)
        for placement in ("out_of_place", "in_place"):
            p = r[placement]
            if p is None:
                continue
            for k in (tkey, "alg_bw", "bus_bw", "nwrong"):
                if k not in p:
                    fail("-J %s lacks %r" % (placement, k), out, err)
    if doc["out_of_bounds"] != {"count": 0, "okay": "true"}:
        fail("-J out_of_bounds %r" % doc["out_of_bounds"], out, err)
    if any("SECRET" in e and not e.endswith("=(hidden)") for e in doc["env"]):
        fail("-J env shows a secret", out, err)


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
    ap.add_argument("--output-json")
    ap.add_argument("--json-exists", action="store_true")
    ap.add_argument("--expect-stderr")
    ap.add_argument("--expect-line", action="append", default=[])
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if a.output_json:
        for f in (a.output_json, a.output_json + ".0"):
            if os.path.exists(f):
                os.remove(f)
        if a.json_exists:
            open(a.output_json, "w").write("not ours\n")
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
    if a.expect_stderr and a.expect_stderr not in err:
        fail("stderr lacks %r" % a.expect_stderr, out, err)
    for pattern in a.expect_line:
        if not any(re.match(pattern, l) for l in lines):
            fail("no line matches %r" % pattern, out, err)
    cputime = flag_value(cmd, "-C", "--report_cputime") == "1"
    stamps = flag_value(cmd, "-S", "--report_timestamps") == "1"
    per_iter = flag_value(cmd, "-I", "--per_iter_timing") == "1"
    time = "cputime" if cputime else "time"
    hdr = table_header(time, stamps, per_iter)
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
        tokens = l.split()
        if stamps:
            if len(tokens) < 2 or not STAMP.match(" ".join(tokens[-2:])):
                fail("row lacks the -S timestamp: %r" % l, out, err)
            tokens = tokens[:-2]
        if per_iter:
            # Per placement: time algbw busbw #wrong i_min i_max i_p99 i_cv%; keep the first four.
            if len(tokens) != 5 + 16:
                fail("row lacks the -I per-iteration columns: %r" % l, out, err)
            for k in list(range(9, 13)) + list(range(17, 21)):
                if tokens[k] != "N/A" and not NUM.match(tokens[k]):
                    fail("non-numeric per-iteration column in %r" % l, out, err)
            tokens = tokens[:9] + tokens[13:17]
        m = ROW.match(" ".join(tokens))
        if not m:
            fail("row does not parse: %r" % l, out, err)
        g = m.groups()
        for k in (5, 6, 7, 9, 10, 11):
            if g[k] != "N/A" and not NUM.match(g[k]):
                fail("non-numeric time/bandwidth column in %r" % l, out, err)
        rows.append(g)
    if not rows and "skipping" not in out:
        fail("no result rows", out, err)
    wrong = [sum(int(float(x)) for x in (g[8], g[12]) if x != "N/A") for g in rows]

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
    if a.output_json:
        check_output_json(a.output_json + (".0" if a.json_exists else ""), rows, expected_ranks(cmd), out, err,
                          cputime)
        if a.json_exists and open(a.output_json).read() != "not ours\n":
            fail("-J overwrote an existing file", out, err)
    if a.json_lines:
        recs = [json.loads(l) for l in open(a.json_lines) if l.strip()]
        if len(recs) != 2 * len(rows):
            fail("%d JSON records for %d rows" % (len(recs), len(rows)), out, err)
        for r in recs:
            if not JSON_KEYS <= set(r):
                fail("JSON record lacks %s" % (JSON_KEYS - set(r)), out, err)


if __name__ == "__main__":
    main()
