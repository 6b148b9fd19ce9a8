"""crossbar.ft: a training loop over a fault-tolerant process group loses a rank
(SIGKILL mid-loop), shrinks to the survivors and keeps training with correct
allreduce results; a replacement process then joins and the group grows back.

Processes are forked from this one (importing torch in each would take seconds); the
store is a torch TCPStore served by its own process, so it outlives every rank.
Each process writes its outcome to a JSON file; nothing is parsed from stdout.
"""

import datetime
import json
import multiprocessing
import os
import signal
import time
import traceback

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
crossbar = pytest.importorskip("crossbar")
from crossbar import ft  # noqa: E402

WORLD = 4
VICTIM = 2
KILL_STEP = 3
GROW_STEP = 6
STEPS = 9


def _serve_store(conn):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    conn.send(store.port)
    conn.recv()  # serve until the test is done


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)


def _sync_state(group, model, step):
    """Newcomers (and survivors that got a step further than others before the
    failure) take group rank 0's parameters and step."""
    for p in model.parameters():
        dist.broadcast(p.data, group_src=0, group=group)
    s = torch.tensor([step], dtype=torch.int64)
    dist.broadcast(s, group_src=0, group=group)
    return int(s.item())


def _train(who, port, out_dir):
    out = {"who": who, "sizes": [], "faults": [], "errors": []}
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
        opts = dict(name="train", timeout=60, detect_timeout=3)
        joiner = who == "joiner"
        g = ft.FaultTolerantGroup.join(store, **opts) if joiner else ft.FaultTolerantGroup(store, who, WORLD, **opts)
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        step = _sync_state(g.group, model, 0)
        grown = joiner
        out["sizes"].append(g.size)
        while step < STEPS:
            try:
                if who == VICTIM and step == KILL_STEP:
                    store.set("test/killed_at", str(time.monotonic_ns()))
                    os.kill(os.getpid(), signal.SIGKILL)
                # Closed form: every member contributes (its rank + 1).
                t = torch.full((4096,), float(g.rank + 1))
                dist.all_reduce(t, group=g.group)
                want = g.size * (g.size + 1) / 2
                if not bool(torch.all(t == want)):
                    out["errors"].append(f"step {step}: allreduce gave {t[0].item()}, want {want}")
                if "shrunk_ms" in out and "first_ok_ms" not in out:
                    out["first_ok_ms"] = _since_kill(store)
                x, y = _batch(step, g.rank)
                torch.nn.functional.mse_loss(model(x), y).backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=g.group)
                    p.grad /= g.size
                opt.step()
                opt.zero_grad()
                step += 1
            except ft.FAILURES as e:
                out["faults"] += [dataclass_dict(f) for f in g.handle_error(e)]
                out["detected_ms"] = _since_kill(store)
                opt.zero_grad()
                g.shrink()
                out["shrunk_ms"] = _since_kill(store)
                out["sizes"].append(g.size)
                step = _sync_state(g.group, model, step)
                continue
            if step == GROW_STEP and not grown:
                g.grow(WORLD)
                grown = True
                out["sizes"].append(g.size)
                step = _sync_state(g.group, model, step)
        # Every member ends with the same parameters.
        for p in model.parameters():
            hi, lo = p.data.clone(), p.data.clone()
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=g.group)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=g.group)
            if not torch.equal(hi, lo):
                out["errors"].append("parameters differ between members")
        out["final"] = {"rank": g.rank, "size": g.size, "epoch": g.epoch, "step": step}
        g.close()
    except BaseException:  # noqa: BLE001 - reported through the file
        out["errors"].append(traceback.format_exc())
    with open(os.path.join(out_dir, f"{who}.json"), "w") as f:
        json.dump(out, f)
    os._exit(0)


def _since_kill(store):
    return (time.monotonic_ns() - int(store.get("test/killed_at"))) / 1e6


def dataclass_dict(f):
    return {"rank": f.rank, "kind": f.kind, "description": f.description}


def test_training_survives_killed_rank_and_grows_back(tmp_path):
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve_store, args=(child,), daemon=True)
    server.start()
    port = parent.recv()
    procs = {who: ctx.Process(target=_train, args=(who, port, str(tmp_path))) for who in [*range(WORLD), "joiner"]}
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.join(timeout=240)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()
        parent.send("done")
        server.join(timeout=10)
        if server.is_alive():
            server.kill()

    victim_out = tmp_path / f"{VICTIM}.json"
    timings = []
    assert procs[VICTIM].exitcode == -signal.SIGKILL, victim_out.read_text() if victim_out.exists() else "no output"
    for who, p in procs.items():
        if who == VICTIM:
            continue
        path = tmp_path / f"{who}.json"
        assert p.exitcode == 0 and path.exists(), f"{who}: exit {p.exitcode}"
        out = json.loads(path.read_text())
        assert out["errors"] == [], f"{who}: {out['errors']}"
        assert out["final"]["size"] == WORLD and out["final"]["step"] == STEPS, out
        if who == "joiner":
            assert out["sizes"] == [WORLD] and out["final"]["rank"] == WORLD - 1, out
            continue
        # Survivors: 4 -> 3 (the victim, reported dead) -> 4 (the joiner).
        assert out["sizes"] == [WORLD, WORLD - 1, WORLD], out
        assert out["final"]["epoch"] == 2, out
        assert {(f["rank"], f["kind"]) for f in out["faults"]} == {(VICTIM, "dead")}, out["faults"]
        timings.append(f"rank {who}: detected {out['detected_ms']:.0f}, shrunk {out['shrunk_ms']:.0f}, "
                       f"first correct allreduce {out['first_ok_ms']:.0f}")
    # One line from the parent (shown with -s): ms after the SIGKILL.
    print("crossbar.ft recovery, ms after the kill:", "; ".join(timings))


def _torch_shrink(who, port, out_dir):
    """3 ranks; rank 1 dies; the survivors shrink with torch's own shrink_group()."""
    out = {"who": who, "errors": []}
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
        # torch's shrink_group() looks up the default group first, so there must be one
        # (any backend; it is not used here).
        dist.init_process_group("gloo", store=dist.PrefixStore("default/", store), rank=who, world_size=3)
        g = ft.FaultTolerantGroup(store, who, 3, name="torch-shrink", timeout=60, detect_timeout=3)
        old = g.group
        try:
            for step in range(1000):
                if who == 1 and step == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                t = torch.full((1024,), float(g.rank + 1))
                dist.all_reduce(t, group=old)
            out["errors"].append("no failure reported")
        except ft.FAILURES as e:
            faults = g.handle_error(e)
            out["faults"] = sorted({(f.rank, f.kind) for f in faults})
            assert old.size() == 3 and old._get_backend(torch.device("cpu")).supports_shrinking
            new = dist.shrink_group(sorted({f.rank for f in faults}), group=old)
            # torch's group over the agreed survivors, and g.group follows the shrink.
            out["torch_group"] = [new.rank(), new.size()]
            out["ft_group"] = [g.group.rank(), g.group.size(), g.epoch]
            for group in (new, g.group):
                t = torch.full((1024,), float(g.rank + 1))
                dist.all_reduce(t, group=group)
                if not bool(torch.all(t == 3.0)):
                    out["errors"].append(f"allreduce after shrink_group gave {t[0].item()}, want 3")
        g.close()
    except BaseException:  # noqa: BLE001 - reported through the file
        out["errors"].append(traceback.format_exc())
    with open(os.path.join(out_dir, f"{who}.json"), "w") as f:
        json.dump(out, f)
    os._exit(0)


@pytest.mark.skipif(not hasattr(dist, "shrink_group"), reason="torch.distributed.shrink_group is new in torch 2.10")
def test_torch_shrink_group_runs_the_agreement(tmp_path):
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve_store, args=(child,), daemon=True)
    server.start()
    port = parent.recv()
    procs = {who: ctx.Process(target=_torch_shrink, args=(who, port, str(tmp_path))) for who in range(3)}
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.join(timeout=120)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()
        parent.send("done")
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
    assert procs[1].exitcode == -signal.SIGKILL
    for who in (0, 2):
        path = tmp_path / f"{who}.json"
        assert procs[who].exitcode == 0 and path.exists(), f"{who}: exit {procs[who].exitcode}"
        out = json.loads(path.read_text())
        assert out["errors"] == [], f"{who}: {out['errors']}"
        assert out["faults"] == [[1, "dead"]], out
        new_rank = 0 if who == 0 else 1
        assert out["torch_group"] == [new_rank, 2], out
        assert out["ft_group"] == [new_rank, 2, 1], out
