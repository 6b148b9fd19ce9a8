#include "comm/interrupt.h"

#include <algorithm>

namespace crossbar {

namespace {
thread_local const InterruptCheck* current_check = nullptr;
}  // namespace

ScopedInterruptCheck::ScopedInterruptCheck(InterruptCheck check)
    : check_(std::move(check)), previous_(current_check) {
  current_check = &check_;
}

ScopedInterruptCheck::~ScopedInterruptCheck() {
  current_check = previous_;
}

bool interruptible() {
  return current_check != nullptr;
}

void interruptionPoint(std::string_view step) {
  if (current_check && *current_check) (*current_check)(step);
}

int interruptSliceMs(int ms) {
  return current_check ? std::min(ms, static_cast<int>(kInterruptSlice.count())) : ms;
}

}  // namespace crossbar
