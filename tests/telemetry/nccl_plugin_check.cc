// Real-NCCL check of crossbar's NCCL plugins (needs a GPU): runs NCCL allreduces with
// NCCL_PROFILER_PLUGIN / NCCL_TUNER_PLUGIN pointing at our plugins, then reads the
// counters the plugins export (plugin_stats.h) from the very objects NCCL loaded (dlopen
// RTLD_NOLOAD of the same paths).
//
// One GPU: a one-rank communicator. NCCL loads and initializes both plugins for it, but
// runs its collectives as a local copy (ncclLaunchOneRank): no Coll/kernel/proxy events
// and no tuner consultation, so only loading, initialization, the table and the per-call
// CollApi events are checked. Two or more GPUs: a 2-rank communicator in this process
// (ncclCommInitAll), where the profiler must turn the collectives into telemetry records
// and the tuner must be consulted and apply its table.
// Run by tests/telemetry/nccl_plugin_check.sh, which builds everything with g++.
//
// Exit: 0 pass; 1 fail (message says what); 77 no GPU.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "plugins/nccl/plugin_stats.h"

namespace {

bool cudaOk(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "FAIL: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

bool ncclOk(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return true;
  std::fprintf(stderr, "FAIL: %s: %s\n", what, ncclGetErrorString(r));
  return false;
}

template <typename Fn>
Fn statsOf(const char* env, const char* symbol) {
  const char* path = std::getenv(env);
  if (!path || !*path) {
    std::fprintf(stderr, "FAIL: %s is not set; point it at the plugin's .so\n", env);
    return nullptr;
  }
  // RTLD_NOLOAD: only the copy NCCL already loaded (its counters are the ones that moved).
  void* handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (!handle) {
    std::fprintf(stderr, "FAIL: NCCL did not load %s=%s (%s); run with NCCL_DEBUG=INFO to see why\n", env, path,
                 dlerror());
    return nullptr;
  }
  auto fn = reinterpret_cast<Fn>(dlsym(handle, symbol));
  if (!fn) std::fprintf(stderr, "FAIL: %s has no %s: not a crossbar plugin?\n", path, symbol);
  return fn;
}

}  // namespace

int main() {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  int version = 0;
  ncclGetVersion(&version);
  const int nranks = ndev >= 2 ? 2 : 1;
  std::printf("NCCL %d.%d.%d (code %d), %d GPU(s), %d-rank communicator; profiler %s; tuner %s\n",
              version / 10000, version / 100 % 100, version % 100, version, ndev, nranks,
              std::getenv("NCCL_PROFILER_PLUGIN") ? std::getenv("NCCL_PROFILER_PLUGIN") : "-",
              std::getenv("NCCL_TUNER_PLUGIN") ? std::getenv("NCCL_TUNER_PLUGIN") : "-");

  std::vector<ncclComm_t> comms(nranks);
  std::vector<int> devs(nranks);
  for (int i = 0; i < nranks; ++i) devs[i] = i;
  if (!ncclOk(ncclCommInitAll(comms.data(), nranks, devs.data()), "ncclCommInitAll")) return 1;
  std::vector<cudaStream_t> streams(nranks);
  for (int i = 0; i < nranks; ++i) {
    cudaSetDevice(i);
    if (!cudaOk(cudaStreamCreate(&streams[i]), "cudaStreamCreate")) return 1;
  }

  // Small and large allreduces (different algorithm/protocol choices), checked in closed
  // form: rank i contributes (i + 1) * (j % 1000).
  const size_t counts[] = {1024, size_t{4} << 20};
  int ops = 0;
  for (size_t count : counts) {
    std::vector<float*> in(nranks), out(nranks);
    std::vector<float> host(count), back(count);
    for (int r = 0; r < nranks; ++r) {
      cudaSetDevice(r);
      for (size_t j = 0; j < count; ++j) host[j] = float((r + 1) * (j % 1000));
      if (!cudaOk(cudaMalloc(&in[r], count * sizeof(float)), "cudaMalloc") ||
          !cudaOk(cudaMalloc(&out[r], count * sizeof(float)), "cudaMalloc"))
        return 1;
      cudaMemcpy(in[r], host.data(), count * sizeof(float), cudaMemcpyHostToDevice);
    }
    for (int it = 0; it < 5; ++it, ++ops) {
      ncclGroupStart();
      for (int r = 0; r < nranks; ++r)
        ncclAllReduce(in[r], out[r], count, ncclFloat32, ncclSum, comms[r], streams[r]);
      if (!ncclOk(ncclGroupEnd(), "ncclAllReduce (group)")) return 1;
    }
    const float scale = float(nranks * (nranks + 1) / 2);
    for (int r = 0; r < nranks; ++r) {
      cudaSetDevice(r);
      if (!cudaOk(cudaStreamSynchronize(streams[r]), "cudaStreamSynchronize")) return 1;
      cudaMemcpy(back.data(), out[r], count * sizeof(float), cudaMemcpyDeviceToHost);
      for (size_t j = 0; j < count; ++j)
        if (back[j] != scale * float(j % 1000)) {
          std::fprintf(stderr, "FAIL: allreduce of %zu floats: rank %d element %zu is %g, expected %g\n", count,
                       r, j, back[j], scale * float(j % 1000));
          return 1;
        }
      cudaFree(in[r]);
      cudaFree(out[r]);
    }
  }

  // Counters before finalize (destroy runs the plugins' finalize; counters survive it).
  auto prof_stats = statsOf<crossbar_profiler_stats_fn>("NCCL_PROFILER_PLUGIN", CROSSBAR_PROFILER_STATS_SYMBOL);
  auto tuner_stats = statsOf<crossbar_tuner_stats_fn>("NCCL_TUNER_PLUGIN", CROSSBAR_TUNER_STATS_SYMBOL);
  CrossbarProfilerStats p{};
  CrossbarTunerStats t{};
  if (prof_stats) prof_stats(&p);
  if (tuner_stats) tuner_stats(&t);
  for (int r = 0; r < nranks; ++r) {
    ncclCommDestroy(comms[r]);
    cudaSetDevice(r);
    cudaStreamDestroy(streams[r]);
  }
  if (!prof_stats || !tuner_stats) return 1;
  std::printf(
      "profiler: inits %llu, CollApi %llu, Coll %llu, recorded %llu, KernelCh %llu, ProxyOp %llu, ProxyStep %llu, "
      "last %s of %llu bytes\n",
      (unsigned long long)p.inits, (unsigned long long)p.coll_api, (unsigned long long)p.colls,
      (unsigned long long)p.colls_recorded, (unsigned long long)p.kernel_channels, (unsigned long long)p.proxy_ops,
      (unsigned long long)p.proxy_steps, p.last_func[0] ? p.last_func : "-", (unsigned long long)p.last_bytes);
  std::printf("tuner: inits %llu, table rows %llu, consulted %llu, applied %llu\n", (unsigned long long)t.inits,
              (unsigned long long)t.rules, (unsigned long long)t.consulted, (unsigned long long)t.applied);

  int fails = 0;
  auto expect = [&](bool ok, const char* what) {
    std::printf("  %-4s %s\n", ok ? "ok" : "FAIL", what);
    fails += !ok;
  };
  expect(p.inits >= unsigned(nranks), "NCCL initialized the profiler for every communicator");
  expect(t.inits >= unsigned(nranks), "NCCL initialized the tuner for every communicator");
  expect(t.rules > 0, "the tuner loaded CROSSBAR_TUNER_TABLE");
  if (nranks == 1) {
    std::printf("  note one rank: NCCL copies locally (no Coll events, no tuner call); CollApi events: %llu\n",
                (unsigned long long)p.coll_api);
  } else {
    expect(p.colls >= unsigned(ops * nranks), "a Coll event per allreduce and rank");
    expect(p.colls_recorded >= unsigned(ops * nranks), "every collective became a telemetry op record");
    expect(p.kernel_channels > 0, "kernel channel events");
    expect(std::strstr(p.last_func, "llReduce") != nullptr && p.last_bytes == counts[1] * sizeof(float),
           "the last record is the large AllReduce with its size");
    expect(t.consulted > 0, "NCCL consulted the tuner");
    expect(t.applied > 0, "a table row set NCCL's cost table");
  }
  std::printf("%s\n", fails ? "FAIL" : "PASS");
  return fails ? 1 : 0;
}
