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

}  // namespace b12x
