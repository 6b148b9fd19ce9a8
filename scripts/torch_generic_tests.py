"""torch's generic distributed test suite (DistributedTest._DistTestBase, the one
test/distributed/test_distributed_spawn.py runs for gloo/nccl) against BACKEND=crossbar.
Run through scripts/torch_generic_tests.sh; not part of CI (it takes long)."""

import os
import types

os.environ.setdefault("BACKEND", "crossbar")
os.environ.setdefault("WORLD_SIZE", "2")

import crossbar  # noqa: E402,F401  (registers the backend in every spawned rank too)
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402
from torch.testing._internal.common_utils import run_tests  # noqa: E402

# The suite gates tests on backend names; declare what crossbar implements before the
# test module is imported (its decorators read these sets at import time).
DistTestCases.backend_feature["ddp"].add("crossbar")
DistTestCases.backend_feature["plugin"].add("crossbar")
DistTestCases.backend_feature["subgroup"].add("crossbar")  # new_group / new_subgroups (members-only splits)
if crossbar.info()["cuda_tensors"]:
    # "gpu": backends that take GPU tensors. Tests that need devices still check their count.
    DistTestCases.backend_feature["gpu"].add("crossbar")
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

# Tests whose only gate is a hard-coded list of backend names, for features crossbar
# implements on CPU tensors: run torch's test body without that gate. torch's gate is
# attributes set on the test function (skip_but_pass_in_sandcastle*); the copy drops them
# and keeps the runtime decorators (world size, GPU count), which still skip in the ranks.
# Each entry names the skip reason it expects: a test skipped for any other reason (e.g.
# disabled upstream) stays skipped. CROSSBAR_UNGATE=0 keeps torch's gates.
_UNGATE = {
    "Only MPI supports all_to_all": [
        "test_all_to_all", "test_all_to_all_complex", "test_all_to_all_full_group",
        "test_all_to_all_group",
    ],
    "Only MPI supports CPU all_to_all_single": [
        f"test_all_to_all_single_{s}_split{v}"
        for s in ("equal", "unequal") for v in ("", "_complex", "_full_group", "_group")
    ],
    "Test requires backend crossbar to be one of {'gloo'}": [
        f"test_all_reduce_coalesced_{g}{op}"
        for g in ("", "full_group_", "group_") for op in ("max", "min", "product", "sum")
    ] + [
        "test_scatter_object_list", "test_grads_same_across_ranks_with_no_sync",
        "test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup",
        "test_monitored_barrier_gloo_rank_0_timeout", "test_monitored_barrier_failure_order",
        "test_monitored_barrier_wait_all_ranks",
    ],
    "GLOO Batch Send Recv CPU": ["test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags"],
    "get_future is only supported on mpi, nccl and gloo": ["test_get_future"],
}
_SKIP_ATTRS = ("__unittest_skip__", "__unittest_skip_why__")


def _ungated_tests():
    out = {}
    for reason, names in _UNGATE.items():
        for name in names:
            fn = getattr(DistributedTest._DistTestBase, name)
            why = getattr(fn, "__unittest_skip_why__", None)
            if why != reason:
                continue  # not gated, or skipped for another reason: torch's test as is
            copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__,
                                      fn.__defaults__, fn.__closure__)
            copy.__dict__.update({k: v for k, v in fn.__dict__.items() if k not in _SKIP_ATTRS})
            copy.__qualname__ = fn.__qualname__
            out[name] = copy
    return out


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if os.environ.get("CROSSBAR_UNGATE", "1") != "0":
    for _name, _fn in _ungated_tests().items():
        setattr(TestDistBackendWithSpawn, _name, _fn)


if __name__ == "__main__":
    run_tests()
