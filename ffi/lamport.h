// The Lamport exchange, written once for every backend (docs/DESIGN.md,
// "Lamport"): small payloads without flags or fences.
//
// Every rank pushes its payload into its cell of every peer's Lamport buffer;
// the owner polls the data itself: a 32-bit word that still holds the
// "empty" pattern has not arrived. Nothing else is paid: no fence, no flag,
// no second round trip, which is what the barrier protocol (protocol.h)
// costs a small call on top of the data. Beside each cell, one header pack
// carries the call's tag (channel.h CallTag), checked by the reader before
// it trusts the data (docs/DESIGN.md, "The call tag").
//
// Reuse, per block b (each block only touches its own cells, as in the
// barrier protocol): call k of block b uses buffer B(k) and refills with
// "empty" the cells (and headers) of buffer B(k - 1) it read in call k - 1,
// at any point of call k (a backend overlaps the refill's stores with its
// polls, or refills last). A peer writes buffer B(k - 1) of this rank
// again in its call k + 2, which it starts only after reading this rank's
// data of call k + 1, written after the refill in this rank's call order
// (its stream on CUDA, its progress thread on the host). Buffer B(k + 1) is
// never refilled during call k: a peer one call ahead may already be
// writing it. So three buffers, one refill per call, no barrier.
// B(k) is Signal::lamport_buffer, a word cycling 0, 1, 2 by itself: right
// across any wrap of the call count (docs/DESIGN.md, "Wrap"; k % 3 on a
// uint32 is not, 2^32 = 1 mod 3, and two calls would share a buffer).
//
// The empty pattern is the word 0xFFFFFFFF: a NaN in fp32 and two NaNs in
// bf16/fp16, so it can only come from a payload that is NaN there. The sender
// rewrites such a word to another NaN pattern (0x7FFF7FFF), which leaves every
// value the same, and the receiver can never mistake data for "empty". A tag
// never holds it (channel.h). Arrival is decided per 32-bit word: a 16-byte
// store may land in parts.
//
// A backend composes a call from the steps below with its own mapping of
// packs to threads: CUDA interleaves polling and reducing per thread
// (cuda/lamport.cuh), the host stages, polls, then finishes
// (cpu/host_calls.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "channel.h"
#include "numeric.h"
#include "protocol.h"

namespace b12x {

inline constexpr int kLamportEmptyByte = 0xFF;
inline constexpr uint32_t kLamportEmptyWord = 0xFFFFFFFFu;
inline constexpr uint32_t kLamportNaNWord = 0x7FFF7FFFu;

// `x` as it goes on the wire: never containing the empty word.
B12X_HD Pack lamport_encode(Pack x) {
  B12X_UNROLL
  for (uint32_t& w : x.words) w = w == kLamportEmptyWord ? kLamportNaNWord : w;
  return x;
}

B12X_HD bool lamport_arrived(const Pack& x) {
  return x.words[0] != kLamportEmptyWord && x.words[1] != kLamportEmptyWord &&
         x.words[2] != kLamportEmptyWord && x.words[3] != kLamportEmptyWord;
}

B12X_HD Pack lamport_empty_pack() {
  return Pack{{kLamportEmptyWord, kLamportEmptyWord, kLamportEmptyWord, kLamportEmptyWord}};
}

// What a Lamport call of one block reads before it pushes: its Signal words
// as its previous call left them, and the words others write (the poison
// word, the generation). No load depends on another, so a backend issues
// them together: one round trip where a CUDA block paid one per word.
struct LamportStart {
  uint32_t poisoned;
  uint32_t generation;
  uint32_t buffer;
  uint32_t calls;
  uint32_t packs;
  uint32_t served;
};

template <class Mem>
B12X_HD LamportStart lamport_start(const ChannelView& v, int block) {
  const Signal* own = v.signals[v.rank];
  return LamportStart{Mem::load_relaxed(&own->poisoned),          Mem::load_relaxed(&own->generation),
                      Mem::load_relaxed(&own->lamport_buffer[block]), Mem::load_relaxed(&own->lamport_calls[block]),
                      Mem::load_relaxed(&own->lamport_packs[block]),  Mem::load_relaxed(&own->served[block])};
}

// Whether a call that read `s` must leave NaN without touching channel
// memory: the channel is poisoned, or its memory serves another preparation
// (recorded: protocol.h stale_generation).
template <class Mem>
B12X_HD bool lamport_halted(const ChannelView& v, const LamportStart& s) {
  return s.poisoned != 0 || stale_generation<Mem>(v, s.generation);
}

// One Lamport call of one block, as its Signal words stood at the start.
// Written by this block's previous call: an earlier kernel on this stream,
// or an earlier call of the progress thread.
struct LamportCall {
  int block;
  uint32_t call;            // calls before this one (errors report call + 1)
  int buffer;               // B(k): this call's buffer
  int previous;             // B(k - 1): what the previous call read, refilled now
  uint32_t previous_packs;  // how many packs of it the previous call read
  CallTag tag;

  B12X_HD Pack* cell(const ChannelView& v, int owner, int buf, int source) const {
    return reinterpret_cast<Pack*>(v.lamport[owner] + v.lamport_layout.cell_offset(buf, source, block));
  }
  B12X_HD Pack* header(const ChannelView& v, int owner, int buf, int source) const {
    return reinterpret_cast<Pack*>(v.lamport[owner] + v.lamport_layout.header_offset(buf, source, block));
  }
};

B12X_HD LamportCall lamport_begin(int block, const CallTag& tag, const LamportStart& s) {
  const int buffer = static_cast<int>(s.buffer);
  return LamportCall{block, s.calls, buffer, buffer == 0 ? kLamportBuffers - 1 : buffer - 1, s.packs, tag};
}

// This call's tag into this rank's header of every peer's buffer.
template <class Mem>
B12X_HD void lamport_push_header(const ChannelView& v, const LamportCall& c) {
  Pack header;
  static_assert(sizeof(header) == sizeof(c.tag));
  header.words[0] = c.tag.call;
  header.words[1] = c.tag.algorithm;
  header.words[2] = c.tag.packs;
  header.words[3] = c.tag.site;
  for (int p = 0; p < v.world; ++p) {
    if (exchanges_with(v, p)) Mem::store_pack(c.header(v, p, c.buffer, v.rank), header);
  }
}

// Pack i of this rank's payload, `x`, into its cell of every peer's buffer
// (peers below kRanks, which holds the world: a kernel's unroll bound).
template <class Mem, int kRanks = kMaxRanks>
B12X_HD void lamport_push(const ChannelView& v, const LamportCall& c, size_t i, const Pack& x) {
  const Pack wire = lamport_encode(x);
  B12X_UNROLL
  for (int p = 0; p < kRanks; ++p) {
    if (exchanges_with(v, p)) Mem::store_pack(c.cell(v, p, c.buffer, v.rank) + i, wire);
  }
}

// Pack i of what this rank sends peer `p` alone (an all-to-all: each peer
// gets its own payload), into this rank's cell of p's buffer.
template <class Mem>
B12X_HD void lamport_push_to(const ChannelView& v, const LamportCall& c, int p, size_t i, const Pack& x) {
  Mem::store_pack(c.cell(v, p, c.buffer, v.rank) + i, lamport_encode(x));
}

// Source q's header: kPending until every word of it arrived, then the tag
// check (a mismatch is recorded: kFailed).
template <class Mem>
B12X_HD PeerState lamport_header_state(const ChannelView& v, const LamportCall& c, int q) {
  const Pack h = Mem::load_volatile(c.header(v, v.rank, c.buffer, q));
  if (!lamport_arrived(h)) return PeerState::kPending;
  return check_tag<Mem>(v, q, c.call + 1u, c.tag, CallTag{h.words[0], h.words[1], h.words[2], h.words[3]});
}

// Pack i of source q into `x`; true once every word of it arrived.
template <class Mem>
B12X_HD bool lamport_load(const ChannelView& v, const LamportCall& c, int q, size_t i, Pack& x) {
  x = Mem::load_volatile(c.cell(v, v.rank, c.buffer, q) + i);
  return lamport_arrived(x);
}

// Empties pack i of every source's cell of the previous buffer (for i below
// previous_packs), and, for i == 0, the headers: run by this block for
// every i < max(previous_packs, 1) at any point of its call (see Reuse);
// sources below kRanks, as lamport_push.
template <class Mem, int kRanks = kMaxRanks>
B12X_HD void lamport_refill(const ChannelView& v, const LamportCall& c, size_t i) {
  B12X_UNROLL
  for (int q = 0; q < kRanks; ++q) {
    if (!exchanges_with(v, q)) continue;
    if (i < c.previous_packs) Mem::store_pack(c.cell(v, v.rank, c.previous, q) + i, lamport_empty_pack());
    if (i == 0) Mem::store_pack(c.header(v, v.rank, c.previous, q), lamport_empty_pack());
  }
}

// How many packs lamport_refill must be run for.
B12X_HD size_t lamport_refill_packs(const LamportCall& c) { return c.previous_packs > 0 ? c.previous_packs : 1; }

// Counts the call of `packs` packs and moves this block on to the next
// buffer: by one step of the cycle, never by a count. The block met its
// peers: later calls are bounded by the timeout (wait_deadline).
template <class Mem>
B12X_HD void lamport_advance(const ChannelView& v, const LamportCall& c, uint32_t packs) {
  mark_served<Mem>(v, c.block);
  Signal* own = v.signals[v.rank];
  Mem::store_relaxed(&own->lamport_calls[c.block], c.call + 1u);  // read_host_calls reads it meanwhile
  own->lamport_buffer[c.block] = c.buffer == kLamportBuffers - 1 ? 0u : static_cast<uint32_t>(c.buffer + 1);
  own->lamport_packs[c.block] = packs;
}

}  // namespace b12x
