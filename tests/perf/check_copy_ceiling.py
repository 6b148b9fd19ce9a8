"""perf/compare's copy_ceiling against the traffic counts worked out by hand (16 GB/s copied):
alltoall 4 ranks copies 4 S per call and busbw = S/t * 3/4 -> 16/4 * 3/4 = 3.0;
allreduce 2 ranks copies 2 S, busbw = S/t * 1 -> 8.0; allgather 4 ranks copies 5/2 S,
busbw = S/t * 3/4 -> 16/2.5 * 0.75 = 4.8; reduce_scatter 2 ranks 3/2 S -> 16/1.5 * 0.5."""
import os
import sys
from importlib.machinery import SourceFileLoader

compare = SourceFileLoader("compare", os.path.join(sys.argv[1], "perf", "compare")).load_module()
expect = {("alltoall", 4): 3.0, ("all_reduce", 2): 8.0, ("all_gather", 4): 4.8,
          ("reduce_scatter", 2): 16 / 1.5 * 0.5, ("broadcast", 4): None, ("alltoall", 1): None}
bad = []
for (coll, n), want in expect.items():
    got = compare.copy_ceiling(coll, n, 16.0)
    if (got is None) != (want is None) or (want is not None and abs(got - want) > 1e-9):
        bad.append("%s %d ranks: %r, expected %r" % (coll, n, got, want))
if compare.copy_ceiling("alltoall", 4, None) is not None:
    bad.append("no measurement must give no ceiling")
if bad:
    sys.exit("copy_ceiling: " + "; ".join(bad))
print("copy_ceiling: %d cases as worked out by hand" % (len(expect) + 1))
