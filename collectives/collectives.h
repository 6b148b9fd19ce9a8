// Collectives over a Communicator: every torch.distributed collective, blocking and
// nonblocking, in-place (send == recv) and out-of-place. Counts are elements;
// per-rank counts (allgather, reduce_scatter, alltoall, gather, scatter) are the
// elements each rank contributes or receives. Operations on one Collectives object
// run in the order they were issued (like a stream); nonblocking calls return a Work.
// A call runs on the thread that waits for (or tests) its Work; one that nobody waits
// for is started by a worker thread within CROSSBAR_COLL_START_POLL_US (default 500 us),
// without a thread wake-up per call.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collectives/dtype.h"
#include "comm/communicator.h"
#include "comm/deadline.h"

namespace crossbar {

enum class MemoryKind { kHost, kCuda };

// Per-call options; defaults come from the communicator and the selection table.
struct CollOptions {
  Millis timeout{0};           // 0: the communicator's timeout
  std::string algorithm;       // "" = selection table (CROSSBAR_ALGO overrides globally)
  double premul_scalar = 1.0;  // ReduceOp::kPreMulSum factor
  // Device memory (detected, or forced by setting this): the cudaStream_t the call is
  // enqueued on, stream-ordered (collectives/cuda/cuda_collectives.h); nullptr with
  // device pointers means the legacy default stream.
  void* cuda_stream = nullptr;
};

// Handle of a nonblocking collective. Thread-safe.
class Work {
 public:
  virtual ~Work() = default;
  virtual bool test() = 0;                   // true when finished (rethrows its error)
  // True when finished (either way), and nothing more: unlike test(), it never runs or
  // publishes the operation nor wakes a thread for it (a look that costs no wake-up).
  virtual bool hasFinished() = 0;
  virtual void wait(Deadline deadline) = 0;  // Timeout names the op; rethrows its error
  void wait() { waitDefault(); }            // with the Work's default deadline
  virtual std::exception_ptr error() const = 0;
  virtual const std::string& description() const = 0;  // "allreduce 4096 x float sum (ring)"

 protected:
  // wait() without a deadline: CROSSBAR_TIMEOUT, unless the Work knows better (the
  // queue allows for the operations ahead of it).
  virtual void waitDefault();
};
using WorkPtr = std::shared_ptr<Work>;

class Collectives {
 public:
  explicit Collectives(std::shared_ptr<Communicator> comm);
  ~Collectives();
  Communicator& comm() const { return *comm_; }

  WorkPtr allreduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                    const CollOptions& o = {});
  // recv holds size() * count elements, rank r's block at r * count.
  WorkPtr allgather(const void* send, void* recv, size_t count, DataType type, const CollOptions& o = {});
  // send holds size() * count elements; recv gets this rank's reduced block of count.
  WorkPtr reduceScatter(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                        const CollOptions& o = {});
  WorkPtr broadcast(void* buffer, size_t count, DataType type, int root, const CollOptions& o = {});
  // recv is significant on root only (may be null elsewhere).
  WorkPtr reduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op, int root,
                 const CollOptions& o = {});
  // send and recv hold size() * count elements; block r goes to / came from rank r.
  WorkPtr alltoall(const void* send, void* recv, size_t count, DataType type, const CollOptions& o = {});
  // Counts and displacements in elements, one per rank.
  WorkPtr alltoallv(const void* send, const std::vector<size_t>& send_counts,
                    const std::vector<size_t>& send_displs, void* recv,
                    const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                    DataType type, const CollOptions& o = {});
  // recv (root only) holds size() * count elements.
  WorkPtr gather(const void* send, void* recv, size_t count, int root, DataType type,
                 const CollOptions& o = {});
  // send (root only) holds size() * count elements.
  WorkPtr scatter(const void* send, void* recv, size_t count, int root, DataType type,
                  const CollOptions& o = {});
  WorkPtr barrier(const CollOptions& o = {});
  WorkPtr send(const void* data, size_t count, DataType type, int peer, uint32_t tag,
               const CollOptions& o = {});
  WorkPtr recv(void* data, size_t count, DataType type, int peer, uint32_t tag, const CollOptions& o = {});

  // Grouped calls: operations issued between groupStart() and groupEnd() run as one
  // (their point-to-point traffic overlaps; needed for batch_isend_irecv); groupEnd
  // returns the Work of the group.
  void groupStart();
  WorkPtr groupEnd();

  // Deferred start: a call that does not finish inside its issue is left for the issuing
  // thread's wait() or test(); the worker thread does not look for it (by default it looks
  // every CROSSBAR_COLL_START_POLL_US while calls keep coming). Whoever sets it guarantees
  // that every call is waited for or tested within a bound, e.g. by a completion thread of
  // its own (the torch backend: within 1 ms); a wait() with a short deadline or a test()
  // wakes the worker as before.
  void setDeferredStart(bool on);

  // One line for hang reports: what executes (on the worker or a calling thread, since
  // when), what is queued (published eager slots marked), what the worker does, how many
  // threads wait to run the head. "rank 2 world.1: 1 unfinished; nothing executing;
  // 1 queued: reduce_scatter ... (left queued 20.001 s ago); worker asleep until ..."
  std::string state() const;

 private:
  struct Impl;
  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace crossbar
