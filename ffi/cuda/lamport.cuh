// The Lamport exchange: small payloads without flags or fences.
//
// Every rank pushes its payload into its cell of every peer's Lamport buffer;
// the owner polls the data itself, a 32-bit word that still holds the "empty"
// pattern has not arrived. Nothing else is paid: no fence, no flag, no second
// NVLink round trip, which is what the barrier protocol (protocol.h) costs a
// small call on top of the data.
//
// Reuse, per block b (each block only touches its own cells, as in the
// barrier protocol): call k of block b uses buffer k % 3 and, once it has read
// that buffer, refills with "empty" the cells of buffer (k - 1) % 3 it read in
// call k - 1. A peer writes buffer (k - 1) % 3 of this rank again in its call
// k + 2, which it starts only after reading this rank's data of call k + 1,
// written by a later kernel than the refill on this rank's stream. Buffer
// (k + 1) % 3 is never refilled during call k: a peer one call ahead may
// already be writing it. So three buffers, one refill per call, no barrier.
//
// The empty pattern is the word 0xFFFFFFFF: a NaN in fp32 and two NaNs in
// bf16/fp16, so it can only come from a payload that is NaN there. The sender
// rewrites such a word to another NaN pattern (0x7FFF7FFF), which leaves every
// value the same, and the receiver can never mistake data for "empty".
// Arrival is decided per 32-bit word: a 16-byte store may land in parts.
#pragma once

#include <cstdint>

#include "../channel.h"
#include "../numeric.h"
#include "../protocol.h"
#include "cuda_memory.cuh"

namespace b12x {

inline constexpr int kLamportEmptyByte = 0xFF;
inline constexpr uint32_t kLamportEmptyWord = 0xFFFFFFFFu;
inline constexpr uint32_t kLamportNaNWord = 0x7FFF7FFFu;

// `x` as it goes on the wire: never containing the empty word.
__device__ __forceinline__ Pack lamport_encode(Pack x) {
#pragma unroll
  for (uint32_t& w : x.words) w = w == kLamportEmptyWord ? kLamportNaNWord : w;
  return x;
}

__device__ __forceinline__ bool lamport_arrived(const Pack& x) {
  return x.words[0] != kLamportEmptyWord && x.words[1] != kLamportEmptyWord &&
         x.words[2] != kLamportEmptyWord && x.words[3] != kLamportEmptyWord;
}

// A load that goes to memory every time (a peer's store must become visible
// to a spinning reader: no L1, no register reuse).
__device__ __forceinline__ Pack load_volatile(const Pack* p) {
  Pack x;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(x.words[0]), "=r"(x.words[1]), "=r"(x.words[2]), "=r"(x.words[3])
               : "l"(p)
               : "memory");
  return x;
}

__device__ __forceinline__ Pack lamport_empty_pack() {
  return Pack{{kLamportEmptyWord, kLamportEmptyWord, kLamportEmptyWord, kLamportEmptyWord}};
}

// One Lamport call of this block (block b = blockIdx.x, every thread of the
// block must call it): push `in[0, n)` into this rank's cell of every peer's
// buffer, hand each pack's sources in rank order (C9), this rank's own input
// at index rank, to `reduce(i, staged)` as they arrive, then refill what the
// previous call read and count the call. Every op that uses the Lamport
// buffers of a channel goes through here, so their calls interleave on one
// channel by the reuse argument above. False, with nothing counted, when the
// channel is poisoned or a wait failed (C8: bounded, error recorded): the
// caller then fills its outputs with NaN.
template <int kThreads, class Reduce>
__device__ __forceinline__ bool lamport_exchange(const ChannelView& v, const Pack* __restrict__ in, size_t n,
                                                 Reduce reduce) {
  if (channel_poisoned<CudaMem>(v)) return false;
  const int block = blockIdx.x;
  Signal* own = v.signals[v.rank];
  // Written by this block's previous call, an earlier kernel on this stream.
  const uint32_t call = own->lamport_calls[block];
  const int buffer = call % kLamportBuffers;
  const auto cell = [&](int owner, int buf, int source) {
    return reinterpret_cast<Pack*>(v.lamport[owner] + v.lamport_layout.cell_offset(buf, source, block));
  };

  // 1. Push this rank's part into its cell of every peer's buffer.
  for (size_t i = threadIdx.x; i < n; i += kThreads) {
    const Pack x = lamport_encode(in[i]);
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p) {
      if (p < v.world && p != v.rank) cell(p, buffer, v.rank)[i] = x;
    }
  }

  // 2. Poll each source's pack until every word arrived, then reduce. One
  //    failed thread stops the block (volatile: read while others write it).
  __shared__ volatile int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const uint64_t deadline = CudaMem::now_ns() + v.timeout_ns;
  for (size_t i = threadIdx.x; i < n && !failed; i += kThreads) {
    Pack staged[kMaxRanks];
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      if (q >= v.world) continue;
      if (q == v.rank) {
        staged[q] = in[i];
        continue;
      }
      const Pack* src = cell(v.rank, buffer, q) + i;
      const auto arrived = [&] { return lamport_arrived(staged[q] = load_volatile(src)); };
      for (uint32_t spins = 1; !arrived(); ++spins) {
        if ((spins & 63) != 0) continue;
        const PeerState state = poll_peer<CudaMem>(v, q, call + 1, deadline, arrived);
        if (state == PeerState::kArrived) break;
        if (state == PeerState::kFailed || failed) {
          failed = 1;
          break;
        }
      }
    }
    if (failed) break;
    reduce(i, staged);
  }
  __syncthreads();
  if (failed) return false;

  // 3. Refill the cells this block read in its previous call, then count.
  const int previous = (call + kLamportBuffers - 1) % kLamportBuffers;
  const uint32_t previous_packs = own->lamport_packs[block];
  for (size_t i = threadIdx.x; i < previous_packs; i += kThreads) {
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      if (q < v.world && q != v.rank) cell(v.rank, previous, q)[i] = lamport_empty_pack();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    own->lamport_calls[block] = call + 1;
    own->lamport_packs[block] = static_cast<uint32_t>(n);
  }
  return true;
}

}  // namespace b12x
