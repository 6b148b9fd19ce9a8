// main() of every perf binary; CMake compiles it once per collective with
// CROSSBAR_PERF_COLL set to the collective's table name ("all_reduce", ...).
#include "perf/driver.h"

#ifndef CROSSBAR_PERF_COLL
#error "CROSSBAR_PERF_COLL must name the collective"
#endif

int main(int argc, char** argv) {
  return crossbar::perf::perfMain(CROSSBAR_PERF_COLL, argc, argv);
}
