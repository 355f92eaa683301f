// Memory policy of the protocol for host threads (see protocol.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>

#include "../numeric.h"

namespace b12x {

struct HostMem {
  static uint32_t load_acquire(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  static uint32_t load_relaxed(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
  static void store_release(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  // The call counters, which stats (read_host_calls) reads on a Python
  // thread while the progress thread runs calls: atomic, not plain.
  static void store_relaxed(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
  static void fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
  static bool claim(uint32_t* p) {
    uint32_t expected = 0;
    return __atomic_compare_exchange_n(p, &expected, 1u, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
  }
  static uint64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  // Host waits poll through check_arrival (cpu/progress.cc) and never spin
  // here; the policy still supplies it for protocol.h's blocking wait.
  static void pause() { std::this_thread::yield(); }
  // After the barrier the staged data is ordered by the flag's acquire.
  static Pack load_staged(const Pack* p) { return *p; }
  // Lamport data a peer may be writing: each 32-bit word atomically, the
  // unit in which arrival is decided (lamport.h).
  static Pack load_volatile(const Pack* p) {
    Pack x;
    for (int w = 0; w < 4; ++w) x.words[w] = __atomic_load_n(&p->words[w], __ATOMIC_RELAXED);
    return x;
  }
  static void store_pack(Pack* p, const Pack& x) {
    for (int w = 0; w < 4; ++w) __atomic_store_n(&p->words[w], x.words[w], __ATOMIC_RELAXED);
  }
};

}  // namespace b12x
