// Names the calling thread (as top -H, gdb, py-spy and /proc/<pid>/task/*/comm show it), so
// crossbar's helper threads can be told from the application's. Linux keeps 15 characters.
#pragma once

#include <pthread.h>

namespace crossbar {

inline void nameThisThread(const char* name) {
  (void)pthread_setname_np(pthread_self(), name);  // best effort: a name too long is refused
}

}  // namespace crossbar
