#!/usr/bin/env python3
"""crossbar vs gloo through torch.distributed on CPU, in the same run and processes:
all_reduce bus bandwidth per message size, and DDP step time of an MLP.

    PYTHONPATH=build/python python3 perf/torch_bench.py [--ranks 2] [--max-bytes 64M] [--iters 20]

Prints one table (rank 0). Ratios > 1 mean crossbar is faster.
"""

import argparse
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def timed(fn, iters, group):
    """Seconds per call of the slowest rank. `iters` is a minimum: calls are repeated for at
    least about 0.2 s (rank 0 decides, so every rank runs the same count), so microsecond
    calls are timed over thousands of repetitions instead of 20."""
    for _ in range(3):
        fn()  # warm-up (connections, buffers)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    once = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.broadcast(once, src=0, group=group)
    iters = max(iters, min(100000, int(0.2 / max(once.item(), 1e-7))))
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dist.barrier(group=group)
    dt = (time.perf_counter() - t0) / iters
    # The slowest rank's time is the collective's time.
    t = torch.tensor([dt], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def allreduce_rows(args, world, groups):
    rows = []
    nbytes = 64
    while nbytes <= args.max_bytes:
        n = nbytes // 4
        iters = 3
        row = [f"{nbytes:>10}"]
        secs = {}
        for name, group in groups.items():
            t = torch.ones(n, dtype=torch.float32)
            secs[name] = timed(lambda: dist.all_reduce(t, group=group), iters, group)
        for name in groups:
            busbw = nbytes * 2 * (world - 1) / world / secs[name] / 1e9
            row += [f"{secs[name] * 1e6:>10.1f}", f"{busbw:>8.2f}"]
        row.append(f"{secs['gloo'] / secs['crossbar']:>6.2f}")
        rows.append(row)
        nbytes *= 4
    return rows


def ddp_rows(args, groups):
    rows = []
    for width in (256, 1024):
        row = [f"MLP 4x{width}"]
        secs = {}
        for name, group in groups.items():
            torch.manual_seed(0)
            layers = []
            for _ in range(4):
                layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers), process_group=group)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            x = torch.randn(32, width)

            def step():
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()

            secs[name] = timed(step, max(3, args.iters // 2), group)
        params = sum(p.numel() for p in model.parameters())
        row += [f"{params * 4 / 1e6:.1f} MB"]
        row += [f"{secs[n] * 1e3:.2f}" for n in groups]
        row.append(f"{secs['gloo'] / secs['crossbar']:.2f}")
        rows.append(row)
    return rows


def worker(rank, world, store, args):
    import crossbar  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(
        "cpu:crossbar", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    groups = {"crossbar": dist.new_group(backend="crossbar"), "gloo": dist.new_group(backend="gloo")}
    ar = allreduce_rows(args, world, groups)
    ddp = ddp_rows(args, groups)
    if rank == 0:
        print(f"\nall_reduce float32 sum, {world} ranks (time in us, busbw in GB/s)")
        print(f"{'bytes':>10} {'crossbar':>10} {'busbw':>8} {'gloo':>10} {'busbw':>8} {'ratio':>6}")
        for r in ar:
            print(" ".join(r))
        print(f"\nDDP step (forward+backward+SGD, batch 32), {world} ranks (ms)")
        print(f"{'model':<12} {'params':>9} {'crossbar':>9} {'gloo':>9} {'ratio':>6}")
        for r in ddp:
            print(f"{r[0]:<12} {r[1]:>9} {r[2]:>9} {r[3]:>9} {r[4]:>6}")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--max-bytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    fd, store = tempfile.mkstemp(prefix="crossbar_bench_")
    os.close(fd)
    os.remove(store)
    mp.spawn(worker, args=(args.ranks, store, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
