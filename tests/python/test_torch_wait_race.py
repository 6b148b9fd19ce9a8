"""Work.wait(timeout) racing with the backend's own threads.

The point-to-point thread progresses the transports while the caller waits, so a receive can
finish right after the caller's wait gave up. Such a wait may raise its timeout, but the work
must not complete with that timeout: a later wait() returns the message. (Before the fix, the
work took the wait's Timeout as its outcome whenever the receive finished between the wait's
end and its check of the request, and every later wait() raised it although the tensor held
the data.)"""

import datetime
import time

import torch
import torch.distributed as dist

from dist_utils import run_ranks

_MESSAGES = int(__import__("os").environ.get("WAIT_RACE_MESSAGES", "300"))


def _short_waits(rank, world):
    if rank == 1:
        works = []
        for i in range(_MESSAGES):
            # 0 to 1.8 ms apart: some arrive within a 1 ms wait, some after it.
            time.sleep((i * 37 % 7) * 0.0003)
            works.append(dist.isend(torch.full((4,), float(i)), dst=0))
        for w in works:
            w.wait()
        dist.barrier()
        return
    timeouts = 0
    for i in range(_MESSAGES):
        t = torch.full((4,), -1.0)
        w = dist.irecv(t, src=1)
        while True:
            try:
                w.wait(timeout=datetime.timedelta(milliseconds=1))
                break
            except Exception:  # noqa: BLE001  (the wait's timeout)
                timeouts += 1
                if w.is_completed():
                    w.wait()  # finished since the wait gave up: must have succeeded
                    break
        assert torch.equal(t, torch.full((4,), float(i))), f"message {i}: {t}"
    print(f"rank 0: {timeouts} wait timeouts over {_MESSAGES} messages")
    dist.barrier()


def test_short_waits_do_not_fail_a_finished_receive():
    run_ranks(_short_waits, 2)
