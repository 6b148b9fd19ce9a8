#include "symmem/copy_engine.h"

#include <fmt/format.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <string>

#include "comm/env.h"
#include "comm/errors.h"
#include "comm/log.h"

namespace crossbar::symm {

namespace {

// Streams 32-byte blocks with AVX; dst must be 32-byte aligned, bytes a multiple of 128.
__attribute__((target("avx"))) void streamAvx(char* dst, const char* src, size_t bytes) {
  for (size_t i = 0; i < bytes; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
}

// SSE2 version (baseline on x86-64); dst 16-byte aligned, bytes a multiple of 64.
void streamSse2(char* dst, const char* src, size_t bytes) {
  for (size_t i = 0; i < bytes; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
}

bool haveAvx() {
  static const bool avx = __builtin_cpu_supports("avx");
  return avx;
}

// CPUs of the NUMA node the calling thread runs on (from sysfs); empty if unknown.
std::vector<int> cpusOfCurrentNode() {
  unsigned cpu = 0, node = 0;
  if (syscall(SYS_getcpu, &cpu, &node, nullptr) != 0) return {};
  std::ifstream f(fmt::format("/sys/devices/system/node/node{}/cpulist", node));
  std::string list;
  if (!(f >> list)) return {};
  std::vector<int> cpus;
  size_t pos = 0;
  while (pos < list.size()) {
    size_t comma = list.find(',', pos);
    std::string part = list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    size_t dash = part.find('-');
    int lo = std::stoi(part.substr(0, dash));
    int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return cpus;
}

}  // namespace

void copyBytesNonTemporal(void* dst_v, const void* src_v, size_t bytes) {
  auto* dst = static_cast<char*>(dst_v);
  auto* src = static_cast<const char*>(src_v);
  const size_t align = haveAvx() ? 32 : 16;
  const size_t block = haveAvx() ? 128 : 64;
  // Head: plain copy up to the alignment of dst (streaming stores need aligned targets).
  size_t head = (align - (reinterpret_cast<uintptr_t>(dst) & (align - 1))) & (align - 1);
  head = std::min(head, bytes);
  std::memcpy(dst, src, head);
  dst += head, src += head, bytes -= head;
  size_t body = bytes / block * block;
  if (body) {
    if (haveAvx())
      streamAvx(dst, src, body);
    else
      streamSse2(dst, src, body);
  }
  std::memcpy(dst + body, src + body, bytes - body);
  // Streaming stores are weakly ordered: fence so a later release store (a signal)
  // cannot become visible before the data.
  _mm_sfence();
}

void copyBytes(void* dst, const void* src, size_t bytes, size_t nt_threshold) {
  if (bytes >= nt_threshold && bytes >= 256)
    copyBytesNonTemporal(dst, src, bytes);
  else
    std::memcpy(dst, src, bytes);
}

size_t defaultNtThreshold() {
  static const size_t t = env::getSize("CROSSBAR_COPY_ENGINE_NT_THRESHOLD");
  return t;
}

struct CopyEngine::Batch {
  std::mutex mutex;
  std::condition_variable cv;
  size_t remaining = 0;
  size_t total_bytes = 0;
};

bool CopyEngine::Completion::done() const {
  if (!batch_) return true;
  std::lock_guard<std::mutex> lock(batch_->mutex);
  return batch_->remaining == 0;
}

void CopyEngine::Completion::wait(Deadline deadline) const {
  if (!batch_) return;
  std::unique_lock<std::mutex> lock(batch_->mutex);
  if (!batch_->cv.wait_until(lock, deadline.at(), [&] { return batch_->remaining == 0; })) {
    throw Timeout(
        fmt::format("{}{} of the batch's chunks ({} bytes in all) are still not copied at the "
                    "deadline; the workers may be overloaded (CROSSBAR_COPY_ENGINE_THREADS) or "
                    "blocked behind a fence",
                    errorContext(-1, "copy engine wait"), batch_->remaining, batch_->total_bytes));
  }
}

CopyEngine::CopyEngine(CopyEngineOptions options) {
  int threads =
      options.threads != -1 ? options.threads : static_cast<int>(env::getInt("CROSSBAR_COPY_ENGINE_THREADS"));
  if (threads < 0 || threads > 256)
    throw InvalidArgument(fmt::format("{}{} worker threads asked; use 0 (copy inline) to 256",
                                      errorContext(-1, "copy engine"), threads));
  nt_threshold_ =
      options.nt_threshold >= 0 ? static_cast<size_t>(options.nt_threshold) : defaultNtThreshold();
  chunk_bytes_ = std::max<size_t>(options.chunk_bytes, 64 << 10);
  std::vector<int> cpus = options.pin_to_caller_node ? cpusOfCurrentNode() : std::vector<int>{};
  for (int i = 0; i < threads; ++i) {
    workers_.emplace_back([this] { workerLoop(); });
    if (!cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int c : cpus) CPU_SET(c, &set);
      pthread_setaffinity_np(workers_.back().native_handle(), sizeof(set), &set);
    }
  }
  CB_TRACE("symmem", "copy engine: {} workers, streaming stores from {} bytes", threads, nt_threshold_);
}

CopyEngine::~CopyEngine() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

CopyEngine::Completion CopyEngine::submit(const std::vector<CopyOp>& copies) {
  auto batch = std::make_shared<Batch>();
  for (const auto& op : copies) {
    if (op.bytes && (!op.src || !op.dst))
      throw InvalidArgument(fmt::format("{}a copy of {} bytes has a null {} pointer",
                                        errorContext(-1, "copy engine submit"), op.bytes,
                                        op.src ? "destination" : "source"));
    batch->total_bytes += op.bytes;
  }
  if (workers_.empty()) {  // inline mode: ordered by construction
    for (const auto& op : copies) copyBytes(op.dst, op.src, op.bytes, nt_threshold_);
    return Completion(batch);
  }
  std::vector<Chunk> chunks;
  for (const auto& op : copies) {
    for (size_t off = 0; off < op.bytes || (off == 0 && op.bytes == 0); off += chunk_bytes_) {
      if (op.bytes == 0) break;
      size_t n = std::min(chunk_bytes_, op.bytes - off);
      chunks.push_back(
          Chunk{batch, {static_cast<const char*>(op.src) + off, static_cast<char*>(op.dst) + off, n}});
    }
  }
  if (chunks.empty()) return Completion(batch);
  batch->remaining = chunks.size();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& c : chunks) {
      c.seq = next_seq_++;
      c.wait_for = fence_seq_;
      done_window_.push_back(false);
      queue_.push_back(std::move(c));
    }
    last_batch_ = batch;
  }
  if (chunks.size() == 1)
    work_cv_.notify_one();
  else
    work_cv_.notify_all();
  return Completion(batch);
}

void CopyEngine::fence() {
  std::lock_guard<std::mutex> lock(mutex_);
  fence_seq_ = next_seq_;
}

void CopyEngine::synchronize(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t target = next_seq_;
  if (!done_cv_.wait_until(lock, deadline.at(), [&] { return done_below_ >= target; })) {
    throw Timeout(fmt::format("{}{} chunks still pending at the deadline ({} workers)",
                              errorContext(-1, "copy engine synchronize"), target - done_below_,
                              workers_.size()));
  }
}

void CopyEngine::runChunk(const Chunk& c) {
  copyBytes(c.op.dst, c.op.src, c.op.bytes, nt_threshold_);
}

void CopyEngine::workerLoop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_cv_.wait(lock, [&] {
      return (!queue_.empty() && done_below_ >= queue_.front().wait_for) || (stopping_ && queue_.empty());
    });
    if (queue_.empty()) return;  // stopping and drained
    Chunk c = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    runChunk(c);
    {
      std::lock_guard<std::mutex> bl(c.batch->mutex);
      if (--c.batch->remaining == 0) c.batch->cv.notify_all();
    }
    c.batch.reset();
    lock.lock();
    done_window_[c.seq - done_below_] = true;
    bool advanced = false;
    while (!done_window_.empty() && done_window_.front()) {
      done_window_.pop_front();
      ++done_below_;
      advanced = true;
    }
    if (advanced) {
      done_cv_.notify_all();
      work_cv_.notify_all();  // a fence may have opened
    }
  }
}

}  // namespace crossbar::symm
