// Asymmetric memory fences for the "publish, then look for a sleeper" handshakes
// between processes of one node (eager slots, symmetric-buffer signals, shm rings).
//
// Such a handshake is a Dekker pattern: the writer stores its data and then loads the
// reader's "I am going to sleep" flag; the reader stores the flag and then re-loads the
// data before it sleeps. Both sides need a full fence between their store and their
// load, or each can miss the other's store and the reader sleeps through the write.
// A full fence on x86 (mfence / a locked instruction) waits for the store buffer to
// drain, i.e. for the cross-core transfer of the lines just written: on the writer's
// side that is paid by every small collective.
//
// The writer's side runs on every call, the reader's only before a sleep (after its
// spin and yield phases), so the fence is made asymmetric: the frequent side is a
// compiler barrier in processes registered for expedited membarrier, and the rare side
// asks the kernel (membarrier MEMBARRIER_CMD_GLOBAL_EXPEDITED, ~1 us) to run a full
// barrier on every CPU running a thread of a registered process. A process that cannot
// register (old kernel, seccomp) takes full fences on both sides; one whose rare side
// cannot reach a registered peer (membarrier blocked in one process of a node only)
// would see that peer's wake-up at its sleep's end: every such sleep here is bounded
// (100-250 ms slices). CROSSBAR_ASYMMETRIC_FENCE=0 turns it off.
#pragma once

namespace crossbar::fence {

// Whether this process takes the light side (registered for expedited membarrier).
bool asymmetric();

// The frequent side: between a store and the load of the peer's flag.
inline void light() {
  if (asymmetric())
    __atomic_signal_fence(__ATOMIC_SEQ_CST);  // the peer's heavy() does the rest
  else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

// The rare side: between storing the "going to sleep" flag and re-checking the data.
// A full fence for this thread and, where the kernel has it, on every CPU running a
// registered process (whether or not this one is registered).
void heavy();

}  // namespace crossbar::fence
