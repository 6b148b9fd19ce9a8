#include "gpu_checks.h"

#include <cuda_runtime.h>  // templated cudaMalloc overloads
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <stdexcept>
#include <thread>

#include "comm/errors.h"
#include "gpu_kernels.h"
#include "symmem/cuda/copy_engine_cuda.h"
#include "symmem/cuda/device_handle.h"
#include "symmem/cuda/driver_api.h"
#include "symmem/cuda/stream_signal.h"
#include "symmem/cuda/vmm.h"

namespace crossbar::gpucheck {

using namespace crossbar::cuda;

namespace {

// ---- small helpers ----------------------------------------------------------------------

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error(what);
}

#define GC_REQUIRE(cond, ...)                                                                         \
  do {                                                                                                \
    if (!(cond))                                                                                      \
      fail(fmt::format("{}:{}: {} failed: {}", __FILE__, __LINE__, #cond, fmt::format(__VA_ARGS__))); \
  } while (0)

void cudaOk(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(fmt::format("{}: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

// One message: payload bytes plus an optional fd (SCM_RIGHTS), over a SOCK_SEQPACKET pair.
void sendMsg(int sock, const std::vector<uint8_t>& bytes, int fd = -1) {
  iovec iov{const_cast<uint8_t*>(bytes.data()), bytes.size()};
  uint8_t dummy = 0;
  if (bytes.empty()) iov = {&dummy, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  if (sendmsg(sock, &msg, MSG_NOSIGNAL) < 0) fail(fmt::format("sendmsg: {}", std::strerror(errno)));
}

std::vector<uint8_t> recvMsg(int sock, int* fd = nullptr, int timeout_ms = 60000) {
  pollfd p{sock, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) fail("peer did not send within the deadline (peer died or hung?)");
  std::vector<uint8_t> buf(4096);
  iovec iov{buf.data(), buf.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  if (n <= 0) fail(fmt::format("recvmsg: {}", n == 0 ? "peer closed the socket" : std::strerror(errno)));
  buf.resize(static_cast<size_t>(n));
  if (fd) {
    *fd = -1;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
        std::memcpy(fd, CMSG_DATA(c), sizeof(int));
    }
    if (*fd < 0) fail("expected an fd (SCM_RIGHTS) in the message");
  }
  return buf;
}

void barrier(int sock) {
  sendMsg(sock, {});
  recvMsg(sock);
}

// Sends an allocation (info bytes + fd) to the peer.
void sendAllocation(int sock, const VmmAllocation& a) {
  int fd = a.exportFd();
  sendMsg(sock, a.info().serialize(), fd);
  close(fd);
}

MappedPeerAllocation recvAllocation(int sock, int device) {
  int fd = -1;
  auto bytes = recvMsg(sock, &fd);
  VmmHandleInfo info = VmmHandleInfo::deserialize(bytes);
  MappedPeerAllocation m = MappedPeerAllocation::import(info, fd, device);
  close(fd);  // the import keeps its own reference
  return m;
}

std::vector<uint8_t> hostPattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

std::vector<uint8_t> readBack(const void* dev, size_t n) {
  std::vector<uint8_t> v(n);
  cudaOk(cudaMemcpy(v.data(), dev, n, cudaMemcpyDefault), "cudaMemcpy (read back)");
  return v;
}

size_t firstMismatch(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (a[i] != b[i]) return i;
  return a.size() == b.size() ? SIZE_MAX : std::min(a.size(), b.size());
}

// ---- checks -----------------------------------------------------------------------------

// Allocation, rounding, info round trip, and export/import in one process (two VAs, one memory).
void checkVmmLocal(int, int) {
  const size_t want = 3 * 1024 * 1024 + 5;
  VmmAllocation a = VmmAllocation::create(want, 0);
  GC_REQUIRE(a.size() >= want && a.size() % a.granularity() == 0 && a.size() % 4096 == 0, "size {} gran {}",
             a.size(), a.granularity());
  VmmHandleInfo info = a.info();
  GC_REQUIRE(VmmHandleInfo::deserialize(info.serialize()) == info, "info round trip");
  auto pattern = hostPattern(a.size(), 1);
  cudaOk(cudaMemcpy(a.ptr(), pattern.data(), pattern.size(), cudaMemcpyHostToDevice), "fill");
  int fd = a.exportFd();
  MappedPeerAllocation m = MappedPeerAllocation::import(info, fd, 0);
  close(fd);
  GC_REQUIRE(m.ptr() != a.ptr() && m.size() == a.size(), "distinct mapping of equal size");
  auto seen = readBack(m.ptr(), m.size());
  GC_REQUIRE(firstMismatch(seen, pattern) == SIZE_MAX, "alias read differs at byte {}",
             firstMismatch(seen, pattern));
  cudaOk(cudaMemset(m.ptr(), 0x5A, 4096), "memset through alias");
  cudaOk(cudaDeviceSynchronize(), "sync");
  auto first = readBack(a.ptr(), 4096);
  for (size_t i = 0; i < first.size(); ++i) GC_REQUIRE(first[i] == 0x5A, "byte {} = {}", i, first[i]);
  // Move semantics: the moved-from object must not double-free.
  VmmAllocation b = std::move(a);
  GC_REQUIRE(!a.valid() && b.valid(), "moved");
}

// Two processes: rank 0 exports, rank 1 imports, each sees the other's writes;
// stream wait/write values order work across processes through the mapped memory.
void checkVmmTwoProcess(int rank, int sock) {
  const size_t bytes = 8 << 20;
  ensureContext(0, "checkVmmTwoProcess");
  auto a_pat = hostPattern(bytes, 11);
  auto b_pat = hostPattern(bytes, 22);
  if (rank == 0) {
    VmmAllocation data = VmmAllocation::create(bytes, 0);
    VmmAllocation flags = VmmAllocation::create(4096, 0);
    cudaOk(cudaMemset(flags.ptr(), 0, flags.size()), "zero flags");
    cudaOk(cudaMemcpy(data.ptr(), a_pat.data(), bytes, cudaMemcpyHostToDevice), "fill A");
    cudaOk(cudaDeviceSynchronize(), "sync");
    sendAllocation(sock, data);
    sendAllocation(sock, flags);
    // Stream-ordered: copy data -> scratch only after the peer's stream writes flag >= 1.
    void* scratch = nullptr;
    cudaOk(cudaMalloc(&scratch, bytes), "cudaMalloc scratch");
    cudaOk(cudaMemset(scratch, 0xEE, bytes), "poison scratch");
    cudaOk(cudaDeviceSynchronize(), "sync");
    cudaStream_t s;
    cudaOk(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    auto* flag64 = static_cast<uint64_t*>(flags.ptr());
    streamWaitValue64(s, flag64, 1, WaitCond::kGeq);
    cudaOk(cudaMemcpyAsync(scratch, data.ptr(), bytes, cudaMemcpyDeviceToDevice, s), "copy after wait");
    streamWriteValue32(s, reinterpret_cast<uint32_t*>(flag64 + 1), 7);  // ack for the peer
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    GC_REQUIRE(cudaStreamQuery(s) == cudaErrorNotReady, "stream must be blocked on the wait value");
    barrier(sock);  // let rank 1 write B and then the flag
    cudaOk(cudaStreamSynchronize(s), "stream sync");
    auto seen = readBack(scratch, bytes);
    GC_REQUIRE(firstMismatch(seen, b_pat) == SIZE_MAX, "rank 1's writes not visible after the wait, byte {}",
               firstMismatch(seen, b_pat));
    barrier(sock);  // rank 1 checks the ack, then both unmap
    cudaStreamDestroy(s);
    cudaFree(scratch);
  } else {
    MappedPeerAllocation data = recvAllocation(sock, 0);
    MappedPeerAllocation flags = recvAllocation(sock, 0);
    GC_REQUIRE(data.size() >= bytes, "imported size {}", data.size());
    auto seen = readBack(data.ptr(), bytes);
    GC_REQUIRE(firstMismatch(seen, a_pat) == SIZE_MAX, "rank 0's data differs at byte {}",
               firstMismatch(seen, a_pat));
    barrier(sock);
    cudaStream_t s;
    cudaOk(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    cudaOk(cudaMemcpyAsync(data.ptr(), b_pat.data(), bytes, cudaMemcpyHostToDevice, s), "write B");
    auto* flag64 = static_cast<uint64_t*>(flags.ptr());
    streamWriteValue64(s, flag64, 1);  // ordered after the copy on this stream
    streamWaitValue32(s, reinterpret_cast<uint32_t*>(flag64 + 1), 7, WaitCond::kEq);
    cudaOk(cudaStreamSynchronize(s), "stream sync (waits for rank 0's ack)");
    barrier(sock);
    cudaStreamDestroy(s);
  }
}

// Stream write/wait ordering within one process, and the copy engine's deadline.
void checkStreamSignals(int, int) {
  ensureContext(0, "checkStreamSignals");
  uint64_t* flags = nullptr;
  cudaOk(cudaMalloc(&flags, 4096), "cudaMalloc flags");
  cudaOk(cudaMemset(flags, 0, 4096), "zero");
  const size_t n = 1 << 20;
  void *src = nullptr, *dst = nullptr;
  cudaOk(cudaMalloc(&src, n), "src");
  cudaOk(cudaMalloc(&dst, n), "dst");
  auto pat = hostPattern(n, 5);
  cudaOk(cudaMemcpy(src, pat.data(), n, cudaMemcpyHostToDevice), "fill");
  cudaOk(cudaMemset(dst, 0xCD, n), "poison");
  cudaOk(cudaDeviceSynchronize(), "sync");

  CudaCopyEngine ce(0);
  streamWaitValue64(ce.stream(), flags, 3, WaitCond::kGeq);
  CopyOp op{src, dst, n};
  ce.enqueue({&op, 1});
  streamWriteValue32(ce.stream(), reinterpret_cast<uint32_t*>(flags + 1), 42);
  ce.record();
  bool timed_out = false;
  try {
    ce.synchronize(Deadline::after(Millis(100)));
  } catch (const Timeout&) {
    timed_out = true;
  }
  GC_REQUIRE(timed_out, "synchronize must time out while the stream waits for flag >= 3");
  GC_REQUIRE(readBack(dst, 1)[0] == 0xCD, "copy ran before the wait value was satisfied");
  cudaStream_t other;
  cudaOk(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), "stream");
  streamWriteValue64(other, flags, 2);  // not enough: GEQ 3
  cudaOk(cudaStreamSynchronize(other), "sync other");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  GC_REQUIRE(!ce.query(), "value 2 must not satisfy GEQ 3");
  streamWriteValue64(other, flags, 3);
  ce.synchronize(Deadline::after(Millis(10000)));
  auto seen = readBack(dst, n);
  GC_REQUIRE(firstMismatch(seen, pat) == SIZE_MAX, "copy result differs at byte {}",
             firstMismatch(seen, pat));
  uint32_t ack = 0;
  cudaOk(cudaMemcpy(&ack, flags + 1, 4, cudaMemcpyDeviceToHost), "read ack");
  GC_REQUIRE(ack == 42, "ack {}", ack);
  // wait(stream): `other` must see the engine's completion.
  ce.enqueue({&op, 1});
  ce.record();
  ce.wait(other);
  cudaOk(cudaStreamSynchronize(other), "sync other after wait");
  GC_REQUIRE(ce.query(), "engine work must be done once `other` passed the wait");
  cudaStreamDestroy(other);
  cudaFree(flags);
  cudaFree(src);
  cudaFree(dst);
}

// Batch copies of mixed sizes and directions vs cudaMemcpy, with poisoned outputs.
void checkCopyEngine(int, int) {
  ensureContext(0, "checkCopyEngine");
  const std::vector<size_t> sizes = {1, 3, 4095, 4096, 65537, (1 << 20) + 3, 64 << 20, 0, 17};
  size_t total = 0;
  for (size_t s : sizes) total += s;
  uint8_t *dsrc = nullptr, *ddst = nullptr, *hsrc = nullptr, *hdst = nullptr;
  cudaOk(cudaMalloc(&dsrc, total), "dsrc");
  cudaOk(cudaMalloc(&ddst, 2 * total), "ddst");
  cudaOk(cudaMallocHost(&hsrc, total), "hsrc");
  cudaOk(cudaMallocHost(&hdst, total), "hdst");
  auto pat = hostPattern(total, 9);
  std::memcpy(hsrc, pat.data(), total);
  auto hpat = hostPattern(total, 10);
  cudaOk(cudaMemcpy(dsrc, hpat.data(), total, cudaMemcpyHostToDevice), "fill dsrc");
  cudaOk(cudaMemset(ddst, 0xAB, 2 * total), "poison ddst");
  std::memset(hdst, 0xAB, total);
  cudaOk(cudaDeviceSynchronize(), "sync");

  for (bool batch : {true, false}) {
    CudaCopyEngine::Options opts;
    opts.use_batch = batch;
    CudaCopyEngine ce(0, opts);
    std::vector<CopyOp> ops;
    size_t off = 0;
    for (size_t s : sizes) {
      ops.push_back({dsrc + off, ddst + off, s});          // D2D
      ops.push_back({hsrc + off, ddst + total + off, s});  // H2D
      ops.push_back({dsrc + off, hdst + off, s});          // D2H
      off += s;
    }
    ce.enqueue(ops);
    ce.record();
    ce.synchronize(Deadline::after(Millis(30000)));
    auto d2d = readBack(ddst, total);
    auto h2d = readBack(ddst + total, total);
    std::vector<uint8_t> d2h(hdst, hdst + total);
    GC_REQUIRE(firstMismatch(d2d, hpat) == SIZE_MAX, "D2D (batch={}) differs at {}", batch,
               firstMismatch(d2d, hpat));
    GC_REQUIRE(firstMismatch(h2d, pat) == SIZE_MAX, "H2D (batch={}) differs at {}", batch,
               firstMismatch(h2d, pat));
    GC_REQUIRE(firstMismatch(d2h, hpat) == SIZE_MAX, "D2H (batch={}) differs at {}", batch,
               firstMismatch(d2h, hpat));
    fmt::print("  copy engine: batch requested={} used={} bytes={}\n", batch, ce.usingBatch(),
               ce.bytesEnqueued());
    cudaOk(cudaMemset(ddst, 0xAB, 2 * total), "re-poison");
    std::memset(hdst, 0xAB, total);
    cudaOk(cudaDeviceSynchronize(), "sync");
  }
  // Null pointers are rejected before reaching CUDA.
  CudaCopyEngine ce(0);
  CopyOp bad{nullptr, ddst, 8};
  bool threw = false;
  try {
    ce.enqueue({&bad, 1});
  } catch (const InvalidArgument&) {
    threw = true;
  }
  GC_REQUIRE(threw, "null src must raise InvalidArgument");
  cudaFree(dsrc);
  cudaFree(ddst);
  cudaFreeHost(hsrc);
  cudaFreeHost(hdst);
}

// A kernel using SymmDeviceHandle put/add-signal and wait-signal between 2 processes.
void checkKernelPutSignal(int rank, int sock) {
  constexpr int kSize = 2;
  const size_t words = (4 << 20) / 4;  // 4 MiB per region
  ensureContext(0, "checkKernelPutSignal");
  VmmAllocation data = VmmAllocation::create(kSize * words * 4, 0);
  VmmAllocation pad = VmmAllocation::create(4096, 0);
  cudaOk(cudaMemset(data.ptr(), 0xFF, data.size()), "poison data");
  cudaOk(cudaMemset(pad.ptr(), 0, pad.size()), "zero pad");
  cudaOk(cudaDeviceSynchronize(), "sync");
  sendAllocation(sock, data);
  sendAllocation(sock, pad);
  MappedPeerAllocation peer_data = recvAllocation(sock, 0);
  MappedPeerAllocation peer_pad = recvAllocation(sock, 0);
  const int peer = 1 - rank;

  SymmDeviceHandle h{};
  h.rank = rank;
  h.local_size = kSize;
  h.size = data.size();
  h.peer_ptrs[rank] = data.ptr();
  h.peer_ptrs[peer] = peer_data.ptr();
  h.signal_pads[rank] = static_cast<uint64_t*>(pad.ptr());
  h.signal_pads[peer] = static_cast<uint64_t*>(peer_pad.ptr());
  uint32_t* dev_flags = nullptr;  // [0] timeout flag, [1] error count
  cudaOk(cudaMalloc(&dev_flags, 8), "flags");
  h.timeout_flag = dev_flags;
  SymmDeviceHandle h_store = h;  // store mode uses slots kMaxLocalRanks.. of the pads
  h_store.signal_pads[rank] += kMaxLocalRanks;
  h_store.signal_pads[peer] += kMaxLocalRanks;
  GC_REQUIRE(h.outboxSlot(peer) == static_cast<uint64_t*>(peer_pad.ptr()) + rank, "outbox slot address");

  int clock_khz = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0) != cudaSuccess || clock_khz <= 0) {
    cudaGetLastError();
    clock_khz = 2'000'000;  // assume 2 GHz when the attribute is unavailable
  }
  const long long timeout_cycles = static_cast<long long>(clock_khz) * 1000LL * 20;  // ~20 s
  const int blocks = 8;
  barrier(sock);  // both pads zeroed and mapped before anyone signals
  for (SignalMode mode : {SignalMode::kAdd, SignalMode::kStore}) {
    for (uint64_t epoch = 1; epoch <= 3; ++epoch) {
      cudaOk(cudaMemset(dev_flags, 0, 8), "reset flags");
      const uint64_t expected = mode == SignalMode::kAdd ? epoch * blocks : epoch;
      cudaOk(launchExchange(mode == SignalMode::kAdd ? h : h_store, dev_flags + 1, words, epoch, expected,
                            timeout_cycles, mode, blocks, nullptr),
             "launch");
      cudaOk(cudaDeviceSynchronize(), "kernel");
      uint32_t host_flags[2] = {};
      cudaOk(cudaMemcpy(host_flags, dev_flags, 8, cudaMemcpyDeviceToHost), "read flags");
      GC_REQUIRE(host_flags[0] == 0, "rank {} timed out waiting for the peer's signal (mode {}, epoch {})",
                 rank, mode == SignalMode::kAdd ? "add" : "store", epoch);
      GC_REQUIRE(host_flags[1] == 0, "rank {} saw {} wrong words from the peer (mode {}, epoch {})", rank,
                 host_flags[1], mode == SignalMode::kAdd ? "add" : "store", epoch);
      barrier(sock);  // the peer finished verifying before we overwrite its buffer again
    }
  }
  // Host-side check of one region against the closed-form pattern of the last epoch.
  std::vector<uint32_t> region(words);
  cudaOk(cudaMemcpy(region.data(), static_cast<uint32_t*>(data.ptr()) + peer * words, words * 4,
                    cudaMemcpyDeviceToHost),
         "read region");
  for (size_t i = 0; i < words; i += 4099) {
    GC_REQUIRE(region[i] == exchangePattern(peer, i, 3), "word {}", i);
  }
  cudaFree(dev_flags);
  barrier(sock);
}

void checkMulticast(int, int) {
  ensureContext(0, "checkMulticast");
  if (!multicastSupported(0)) throw SkipCheck{"device 0 does not support multicast (no NVSwitch/NVLS here)"};
  MulticastObject mc = MulticastObject::create(2 << 20, 1, 0);
  mc.addDevice(0);
  VmmAllocation mem = VmmAllocation::create(mc.size(), 0);  // the multicast granularity may exceed 2 MiB
  GC_REQUIRE(mem.size() >= mc.size(), "mc size {} vs mem {}", mc.size(), mem.size());
  void* p = mc.bindAndMap(mem);
  GC_REQUIRE(p != nullptr, "mapped");
}

const std::vector<Check> kChecks = {
    {"vmm_local", "VMM allocate, export/import in one process, aliasing", 1, checkVmmLocal},
    {"vmm_two_process", "VMM export/import across 2 processes + stream wait/write ordering", 2,
     checkVmmTwoProcess},
    {"stream_signals", "stream write/wait values, copy-engine deadline and wait()", 1, checkStreamSignals},
    {"copy_engine", "batch copies (D2D/H2D/D2H) vs reference, batch and per-copy", 1, checkCopyEngine},
    {"kernel_put_signal", "SymmDeviceHandle put/add-signal + wait-signal kernel, 2 processes", 2,
     checkKernelPutSignal},
    {"multicast", "multicast object create/bind/map (skips without NVLS)", 1, checkMulticast},
};

// Runs in a child: write "S:" / "F:" + message to `out`; exit code 0 pass, 1 fail, 2 skip.
[[noreturn]] void childMain(const Check& c, int rank, int sock, int out) {
  std::string msg;
  int code = 0;
  try {
    if (!driverAvailable()) throw SkipCheck{"no CUDA device/driver: " + driverUnavailableReason()};
    c.body(rank, sock);
  } catch (const SkipCheck& s) {
    msg = s.reason;
    code = 2;
  } catch (const std::exception& e) {
    msg = fmt::format("rank {}: {}", rank, e.what());
    code = 1;
  } catch (...) {
    msg = fmt::format("rank {}: unknown exception", rank);
    code = 1;
  }
  if (!msg.empty()) (void)!write(out, msg.data(), msg.size());
  close(out);
  fflush(stdout);
  _exit(code);
}

}  // namespace

const std::vector<Check>& allChecks() {
  return kChecks;
}

const Check* findCheck(const std::string& name) {
  for (const Check& c : kChecks)
    if (name == c.name) return &c;
  return nullptr;
}

const char* statusName(Status s) {
  switch (s) {
    case Status::kPass:
      return "PASS";
    case Status::kFail:
      return "FAIL";
    case Status::kSkip:
      return "SKIP";
  }
  return "?";
}

Result runCheck(const Check& check, int timeout_s) {
  const auto start = std::chrono::steady_clock::now();
  Result result;
  int sv[2] = {-1, -1};
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    result.message = fmt::format("socketpair: {}", std::strerror(errno));
    return result;
  }
  std::vector<pid_t> pids;
  std::vector<int> pipes;
  fflush(stdout);
  fflush(stderr);
  for (int r = 0; r < check.processes; ++r) {
    int p[2];
    if (pipe(p) != 0) break;
    pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      close(sv[1 - r]);
      childMain(check, r, sv[r], p[1]);
    }
    close(p[1]);
    pids.push_back(pid);
    pipes.push_back(p[0]);
  }
  close(sv[0]);
  close(sv[1]);
  std::vector<int> codes(pids.size(), -1);
  std::vector<std::string> texts(pids.size());
  size_t alive = pids.size();
  bool timed_out = false;
  while (alive > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (codes[i] != -1) continue;
      int status = 0;
      if (waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        --alive;
      }
    }
    if (alive == 0) break;
    // One rank failing leaves its peer blocked; give it a moment, then kill.
    bool any_failed = false;
    for (int c : codes) any_failed |= (c == 1 || c > 2);
    auto elapsed = std::chrono::steady_clock::now() - start;
    if (elapsed > std::chrono::seconds(timeout_s) || (any_failed && elapsed > std::chrono::seconds(2))) {
      timed_out = !any_failed;
      for (size_t i = 0; i < pids.size(); ++i)
        if (codes[i] == -1) kill(pids[i], SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (size_t i = 0; i < pipes.size(); ++i) {
    char buf[4096];
    ssize_t n;
    while ((n = read(pipes[i], buf, sizeof(buf))) > 0) texts[i].append(buf, static_cast<size_t>(n));
    close(pipes[i]);
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  bool all_skip = true, all_pass = true;
  std::string msg;
  for (size_t i = 0; i < codes.size(); ++i) {
    if (codes[i] != 2) all_skip = false;
    if (codes[i] != 0) all_pass = false;
    if (codes[i] != 0 && codes[i] != 2) {
      if (!msg.empty()) msg += "; ";
      msg += texts[i].empty() ? fmt::format("process {} exited with {}{}", i, codes[i],
                                            codes[i] > 128 ? " (killed by signal: crash or timeout)" : "")
                              : texts[i];
    }
  }
  if (timed_out) msg = fmt::format("timed out after {} s; ", timeout_s) + msg;
  if (all_pass && !codes.empty()) {
    result.status = Status::kPass;
  } else if (all_skip && !codes.empty()) {
    result.status = Status::kSkip;
    result.message = texts.empty() ? "" : texts[0];
  } else {
    result.status = Status::kFail;
    result.message = msg;
  }
  return result;
}

const std::string& gpuUnavailableReason() {
  static const std::string reason = [] {
    int p[2];
    if (pipe(p) != 0) return std::string("pipe failed");
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      std::string r = driverAvailable() ? "" : "no CUDA device/driver: " + driverUnavailableReason();
      (void)!write(p[1], r.data(), r.size());
      _exit(0);
    }
    close(p[1]);
    std::string r;
    char buf[1024];
    ssize_t n;
    while ((n = read(p[0], buf, sizeof(buf))) > 0) r.append(buf, static_cast<size_t>(n));
    close(p[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::string("CUDA probe child crashed");
    return r;
  }();
  return reason;
}

}  // namespace crossbar::gpucheck
