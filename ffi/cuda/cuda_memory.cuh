// Memory policy of the protocol for CUDA threads (see protocol.h): every
// flag access is at system scope, so it orders peer (NVLink/PCIe) traffic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../numeric.h"

namespace b12x {

struct CudaMem {
  static __device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
  }
  static __device__ __forceinline__ uint32_t load_relaxed(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
  }
  static __device__ __forceinline__ void store_release(uint32_t* p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
  // A block's own call counters: a plain store, as before (the host reads
  // them with cudaMemcpy, after the stream's work).
  static __device__ __forceinline__ void store_relaxed(uint32_t* p, uint32_t v) { *p = v; }
  // acq_rel, not sc (__threadfence_system): ordering the block's pushes
  // before its flag is all the protocol asks, and sc costs more.
  static __device__ __forceinline__ void fence() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
  // `p` is always in the rank's own device memory (never mapped host memory,
  // where device atomics are not guaranteed). System scope: peers on other
  // GPUs read the poison word, and the fence before a claim orders this
  // thread's announcements before it only for a write of their scope.
  static __device__ __forceinline__ bool claim(uint32_t* p) { return atomicCAS_system(p, 0u, 1u) == 0u; }
  static __device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  static __device__ __forceinline__ void pause() {}
  // A staged pack, read through L2 (.cg): L1 is not coherent with the peers'
  // writes.
  static __device__ __forceinline__ Pack load_staged(const Pack* p) {
    const uint4 w = __ldcg(reinterpret_cast<const uint4*>(p));
    return Pack{{w.x, w.y, w.z, w.w}};
  }
  // A load that goes to memory every time (a peer's store must become
  // visible to a spinning reader: no L1, no register reuse).
  static __device__ __forceinline__ Pack load_volatile(const Pack* p) {
    Pack x;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(x.words[0]), "=r"(x.words[1]), "=r"(x.words[2]), "=r"(x.words[3])
                 : "l"(p)
                 : "memory");
    return x;
  }
  // One 16-byte store of the four words as given. A plain `*p = x` lets the
  // compiler split it and first store a vector with undefined words (seen
  // with nvcc 13.0 -O3: st.global.v4 {1, undef, undef, undef}, then the
  // words): a reader polling for "no word empty" then takes register garbage
  // for an arrived Lamport header (docs/DESIGN.md, "Lamport"). Relaxed at
  // system scope, as the polls are: a weak store gives a reader's poll no
  // order to pass on to another thread's later read of the same word.
  static __device__ __forceinline__ void store_pack(Pack* p, const Pack& x) {
    asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(x.words[0]), "r"(x.words[1]),
                 "r"(x.words[2]), "r"(x.words[3])
                 : "memory");
  }
};

// Restores the calling thread's current device when setup is done.
class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&saved_); }
  ~DeviceGuard() { cudaSetDevice(saved_); }

 private:
  int saved_ = 0;
};

#define B12X_CUDA_CHECK(expr)                                                          \
  do {                                                                                 \
    cudaError_t b12x_err_ = (expr);                                                    \
    if (b12x_err_ != cudaSuccess) {                                                    \
      throw std::runtime_error(std::string("b12x_jax: ") + #expr + " failed: " +       \
                               cudaGetErrorString(b12x_err_));                         \
    }                                                                                  \
  } while (0)

}  // namespace b12x
