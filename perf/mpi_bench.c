/* The MPI side of perf/compare: times one collective over a size sweep with the same
 * byte counts and bandwidth formulas as the crossbar perf binaries (nccl-tests'), and
 * prints one CSV line per size: bytes,count,time_us,algbw,busbw.
 *
 *   mpirun -np 4 mpi_bench -c all_reduce -b 8 -e 1M -f 2 -n 20 -w 5 -d float [-s 1]
 *
 * -s 1: iteration i uses the buffers at offset size * (i % (maxbytes / size)), as the
 * crossbar perf binaries and nccl-tests do (no all-in-cache best case); without it every
 * iteration reuses the same buffers.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t parse_size(const char* s) {
  char* end = NULL;
  double v = strtod(s, &end);
  if (end == s || v < 0) return (size_t)-1;
  if (*end == 'K' || *end == 'k') v *= 1024.0;
  else if (*end == 'M' || *end == 'm') v *= 1024.0 * 1024;
  else if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024;
  else if (*end != '\0') return (size_t)-1;
  return (size_t)v;
}

static int type_of(const char* name, MPI_Datatype* t, size_t* es) {
  struct { const char* name; MPI_Datatype type; size_t size; } types[] = {
      {"float", MPI_FLOAT, 4},   {"double", MPI_DOUBLE, 8}, {"int32", MPI_INT32_T, 4},
      {"uint32", MPI_UINT32_T, 4}, {"int64", MPI_INT64_T, 8}, {"uint64", MPI_UINT64_T, 8},
      {"int8", MPI_INT8_T, 1},   {"uint8", MPI_UINT8_T, 1},
  };
  for (size_t i = 0; i < sizeof types / sizeof types[0]; ++i) {
    if (strcmp(name, types[i].name) == 0) {
      *t = types[i].type;
      *es = types[i].size;
      return 1;
    }
  }
  return 0;
}

static int op_of(const char* name, MPI_Op* op) {
  if (strcmp(name, "sum") == 0) *op = MPI_SUM;
  else if (strcmp(name, "prod") == 0) *op = MPI_PROD;
  else if (strcmp(name, "min") == 0) *op = MPI_MIN;
  else if (strcmp(name, "max") == 0) *op = MPI_MAX;
  else return 0;
  return 1;
}

/* Per-rank block counts, aligned to 4 elements as the crossbar/nccl-tests tables do. */
static size_t aligned_base(size_t count, int n) { return (count / (4 * (size_t)n)) * 4; }

int main(int argc, char** argv) {
  const char* coll = "all_reduce";
  const char* tname = "float";
  const char* oname = "sum";
  size_t minb = 32u << 20, maxb = 32u << 20, stepb = 1u << 20, factor = 1;
  int iters = 20, warmup = 1, root = 0, rotate = 0;
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (int i = 1; i + 1 < argc; i += 2) {
    const char* k = argv[i];
    const char* v = argv[i + 1];
    if (!strcmp(k, "-c")) coll = v;
    else if (!strcmp(k, "-b")) minb = parse_size(v);
    else if (!strcmp(k, "-e")) maxb = parse_size(v);
    else if (!strcmp(k, "-i")) stepb = parse_size(v);
    else if (!strcmp(k, "-f")) factor = (size_t)atol(v);
    else if (!strcmp(k, "-n")) iters = atoi(v);
    else if (!strcmp(k, "-w")) warmup = atoi(v);
    else if (!strcmp(k, "-d")) tname = v;
    else if (!strcmp(k, "-o")) oname = v;
    else if (!strcmp(k, "-r")) root = atoi(v);
    else if (!strcmp(k, "-s")) rotate = atoi(v);
    else {
      if (rank == 0) fprintf(stderr, "mpi_bench: unknown option %s\n", k);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  MPI_Datatype type = MPI_FLOAT;
  MPI_Op op = MPI_SUM;
  size_t es = 4;
  if (!type_of(tname, &type, &es) || !op_of(oname, &op) || minb == (size_t)-1 || maxb == (size_t)-1 ||
      iters < 1 || root < 0 || root >= n) {
    if (rank == 0) fprintf(stderr, "mpi_bench: bad type/op/size/iters/root (MPI has no half/bfloat16)\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  char* sbuf = calloc(maxb + 64, 1);
  char* rbuf = calloc(maxb + 64, 1);
  if (!sbuf || !rbuf) MPI_Abort(MPI_COMM_WORLD, 3);
  /* Touch every page now (calloc's fresh pages fault on first use), as the crossbar perf
   * binaries do: -s 1 reaches pages the warm-up did not. */
  memset(sbuf, 1, maxb + 64);
  memset(rbuf, 0, maxb + 64);
  if (rank == 0) printf("bytes,count,time_us,algbw,busbw\n");

  for (size_t size = minb; size <= maxb;) {
    size_t count = size / es, param = count, bytes = count * es;
    double alg_factor = 1, bus_factor = 1;
    int kind = 0;
    if (!strcmp(coll, "all_reduce")) {
      bus_factor = 2.0 * (n - 1) / n;
      kind = 1;
    } else if (!strcmp(coll, "all_gather") || !strcmp(coll, "gather") || !strcmp(coll, "hypercube")) {
      param = aligned_base(count, n);
      bytes = param * n * es;
      alg_factor = strcmp(coll, "hypercube") ? n : n - 1;
      bus_factor = strcmp(coll, "hypercube") ? (double)(n - 1) / n : 1;
      kind = !strcmp(coll, "all_gather") ? 2 : !strcmp(coll, "gather") ? 3 : 4;
    } else if (!strcmp(coll, "reduce_scatter") || !strcmp(coll, "scatter")) {
      param = aligned_base(count, n);
      bytes = param * n * es;
      alg_factor = n;
      bus_factor = (double)(n - 1) / n;
      kind = !strcmp(coll, "reduce_scatter") ? 5 : 6;
    } else if (!strcmp(coll, "alltoall")) {
      param = count / n;
      bytes = param * n * es;
      alg_factor = n;
      bus_factor = (double)(n - 1) / n;
      kind = 7;
    } else if (!strcmp(coll, "broadcast")) {
      kind = 8;
    } else if (!strcmp(coll, "reduce")) {
      kind = 9;
    } else if (!strcmp(coll, "sendrecv")) {
      kind = 10;
    } else {
      if (rank == 0) fprintf(stderr, "mpi_bench: unknown collective %s\n", coll);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int c = (int)param;
    double t0 = 0;
    const size_t span = bytes > count * es ? bytes : count * es;
    const size_t steps = rotate && span ? (maxb / span > 0 ? maxb / span : 1) : 1;
    char* const sbuf0 = sbuf;
    char* const rbuf0 = rbuf;
    for (int it = -warmup; it < iters; ++it) {
      if (it == 0) {
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
      }
      sbuf = sbuf0 + span * ((size_t)(it + warmup) % steps);
      rbuf = rbuf0 + span * ((size_t)(it + warmup) % steps);
      switch (kind) {
        case 1: MPI_Allreduce(sbuf, rbuf, c, type, op, MPI_COMM_WORLD); break;
        case 2: MPI_Allgather(sbuf, c, type, rbuf, c, type, MPI_COMM_WORLD); break;
        case 3: MPI_Gather(sbuf, c, type, rbuf, c, type, root, MPI_COMM_WORLD); break;
        case 4: {
          size_t blk = param * es;
          for (int mask = 1; mask < n; mask <<= 1) {
            int mine = rank & ~(mask - 1), theirs = mine ^ mask;
            MPI_Sendrecv(rbuf + mine * blk, c * mask, type, rank ^ mask, 1, rbuf + theirs * blk, c * mask, type,
                         rank ^ mask, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
          }
          break;
        }
        case 5: MPI_Reduce_scatter_block(sbuf, rbuf, c, type, op, MPI_COMM_WORLD); break;
        case 6: MPI_Scatter(sbuf, c, type, rbuf, c, type, root, MPI_COMM_WORLD); break;
        case 7: MPI_Alltoall(sbuf, c, type, rbuf, c, type, MPI_COMM_WORLD); break;
        case 8: MPI_Bcast(sbuf, c, type, root, MPI_COMM_WORLD); break;
        case 9: MPI_Reduce(sbuf, rbuf, c, type, op, root, MPI_COMM_WORLD); break;
        case 10:
          MPI_Sendrecv(sbuf, c, type, (rank + 1) % n, 2, rbuf, c, type, (rank + n - 1) % n, 2, MPI_COMM_WORLD,
                       MPI_STATUS_IGNORE);
          break;
      }
    }
    double sec = (MPI_Wtime() - t0) / iters, sum = 0;
    sbuf = sbuf0;
    rbuf = rbuf0;
    MPI_Allreduce(&sec, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    sec = sum / n; /* the average over ranks, as nccl-tests' default -a 1 */
    double algbw = sec > 0 ? (double)param * es * alg_factor / 1e9 / sec : 0;
    if (rank == 0) printf("%zu,%zu,%.3f,%.6f,%.6f\n", bytes, param, sec * 1e6, algbw, algbw * bus_factor);
    fflush(stdout);
    size_t next = factor > 1 ? size * factor : size + stepb;
    size = next > size ? next : size + 1;
  }
  free(sbuf);
  free(rbuf);
  MPI_Finalize();
  return 0;
}
