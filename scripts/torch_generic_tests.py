"""torch's generic distributed test suite (DistributedTest._DistTestBase, the one
test/distributed/test_distributed_spawn.py runs for gloo/nccl) against BACKEND=crossbar.
Run through scripts/torch_generic_tests.sh; not part of CI (it takes long)."""

import os
import sys

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
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
