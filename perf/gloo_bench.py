#!/usr/bin/env python3
"""The torch.distributed (gloo) side of perf/compare.

Times one collective over a size sweep with the byte counts and bandwidth formulas of
the crossbar perf binaries (nccl-tests'), on N local processes (torch.multiprocessing,
env:// rendezvous), and prints one CSV line per size: bytes,count,time_us,algbw,busbw.
The time is the per-iteration average over ranks (nccl-tests' default -a 1).

  gloo_bench.py --nranks 4 -c all_reduce -b 8 -e 1M -f 2 -n 20 -w 5 -d float
"""
import argparse
import os
import socket
import sys
import time


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip()
    if t and t[-1].upper() in units:
        return int(float(t[:-1]) * units[t[-1].upper()])
    return int(float(t))


def sizes(a):
    s = a.minbytes
    while s <= a.maxbytes:
        yield s
        nxt = s * a.stepfactor if a.stepfactor > 1 else s + a.stepbytes
        s = nxt if nxt > s else s + 1


def counts(coll, size, es, n):
    """(param_count, bytes, algbw factor, busbw factor) as the perf binaries' table."""
    count = size // es
    if coll == "all_reduce":
        return count, count * es, 1, 2.0 * (n - 1) / n
    if coll in ("all_gather", "gather", "reduce_scatter", "scatter", "hypercube"):
        base = (count // (4 * n)) * 4
        if coll == "hypercube":
            return base, base * n * es, n - 1, 1
        return base, base * n * es, n, (n - 1) / n
    if coll == "alltoall":
        base = count // n
        return base, base * n * es, n, (n - 1) / n
    if coll in ("broadcast", "reduce", "sendrecv"):
        return count, count * es, 1, 1
    raise SystemExit("gloo_bench: unknown collective %s" % coll)


def worker(rank, n, port, a):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    dtypes = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
              "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64, "int8": torch.int8,
              "uint8": torch.uint8}
    ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX}
    dtype, op = dtypes[a.datatype], ops[a.op]
    es = torch.tensor([], dtype=dtype).element_size()
    if rank == 0:
        print("bytes,count,time_us,algbw,busbw", flush=True)
    for size in sizes(a):
        param, nbytes, alg_f, bus_f = counts(a.coll, size, es, n)
        send = torch.ones(max(param * n, 1), dtype=dtype)
        recv = torch.zeros(max(param * n, 1), dtype=dtype)
        blk = send[:param]
        c = a.coll
        if c == "all_reduce":
            fn = lambda: dist.all_reduce(blk, op=op)
        elif c == "all_gather":
            outs = list(recv[:param * n].chunk(n)) if param else [torch.zeros(0, dtype=dtype)] * n
            fn = lambda: dist.all_gather(outs, blk)
        elif c == "reduce_scatter":
            ins = list(send[:param * n].chunk(n)) if param else [torch.zeros(0, dtype=dtype)] * n
            fn = lambda: dist.reduce_scatter(recv[:param], ins, op=op)
        elif c == "alltoall":
            fn = lambda: dist.all_to_all_single(recv[:param * n], send[:param * n])
        elif c == "broadcast":
            fn = lambda: dist.broadcast(blk, src=a.root)
        elif c == "reduce":
            fn = lambda: dist.reduce(blk, dst=a.root, op=op)
        elif c == "gather":
            outs = (list(recv[:param * n].chunk(n)) if param else [torch.zeros(0, dtype=dtype)] * n)
            fn = lambda: dist.gather(blk, outs if rank == a.root else None, dst=a.root)
        elif c == "scatter":
            ins = list(send[:param * n].chunk(n)) if param else [torch.zeros(0, dtype=dtype)] * n
            fn = lambda: dist.scatter(recv[:param], ins if rank == a.root else None, src=a.root)
        elif c == "sendrecv":
            def fn():
                reqs = [dist.isend(blk, (rank + 1) % n), dist.irecv(recv[:param], (rank - 1 + n) % n)]
                for r in reqs:
                    r.wait()
        elif c == "hypercube":
            def fn():
                mask = 1
                while mask < n:
                    mine, theirs = rank & ~(mask - 1), (rank & ~(mask - 1)) ^ mask
                    reqs = [dist.isend(recv[mine * param:(mine + mask) * param], rank ^ mask),
                            dist.irecv(recv[theirs * param:(theirs + mask) * param], rank ^ mask)]
                    for r in reqs:
                        r.wait()
                    mask <<= 1
        else:
            raise SystemExit("gloo_bench: unknown collective %s" % c)
        try:
            for _ in range(a.warmup_iters):
                fn()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                fn()
            sec = (time.perf_counter() - t0) / a.iters
        except RuntimeError as e:  # gloo lacks a few collectives/types in some torch versions
            if rank == 0:
                print("# unsupported: %s" % str(e).splitlines()[0], file=sys.stderr, flush=True)
            break
        t = torch.tensor([sec], dtype=torch.float64)
        dist.all_reduce(t)
        sec = t.item() / n
        algbw = param * es * alg_f / 1e9 / sec if sec > 0 else 0.0
        if rank == 0:
            print("%d,%d,%.3f,%.6f,%.6f" % (nbytes, param, sec * 1e6, algbw, algbw * bus_f), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("-c", "--coll", default="all_reduce")
    ap.add_argument("-b", "--minbytes", type=parse_size, default=32 << 20)
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=32 << 20)
    ap.add_argument("-i", "--stepbytes", type=parse_size, default=1 << 20)
    ap.add_argument("-f", "--stepfactor", type=int, default=1)
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup_iters", type=int, default=1)
    ap.add_argument("-d", "--datatype", default="float")
    ap.add_argument("-o", "--op", default="sum")
    ap.add_argument("-r", "--root", type=int, default=0)
    a = ap.parse_args()
    try:
        import torch.multiprocessing as mp
    except ImportError:
        print("gloo_bench: torch is not installed (pip install torch)", file=sys.stderr)
        return 3
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(a.nranks, port, a), nprocs=a.nranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
