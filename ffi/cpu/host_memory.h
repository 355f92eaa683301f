// Memory policy of the protocol for host threads (see protocol.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>

namespace b12x {

struct HostMem {
  static uint32_t load_acquire(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  static uint32_t load_relaxed(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
  static void store_release(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  static void fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
  static bool claim(uint32_t* p) {
    uint32_t expected = 0;
    return __atomic_compare_exchange_n(p, &expected, 1u, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
  }
  static uint64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  // Host waits poll through peer_arrived (cpu/progress.cc) and never spin
  // here; the policy still supplies it for protocol.h's blocking wait.
  static void pause() { std::this_thread::yield(); }
};

}  // namespace b12x
