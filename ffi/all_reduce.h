// The all-reduce of every backend: which protocol a call takes (plan_for,
// decided here for CUDA and the host alike), and the steps of the
// barrier-protocol algorithms, one-shot push, one-shot pull and two-shot,
// written once (docs/DESIGN.md, "Two-shot", "Pull"). The Lamport exchange
// is lamport.h.
//
// A backend runs the steps with its own mapping of packs to threads, the
// `ForEach` argument: `each(n, fn)` calls fn(i) for every i < n that the
// calling thread owns (CUDA: i = threadIdx.x, + blockDim.x, ...; the host:
// all of them). Between two steps it meets its peers at the step's epoch
// (protocol.h: block_barrier on CUDA, the progress thread on the host).
#pragma once

#include <cstddef>
#include <cstdint>

#include "channel.h"
#include "numeric.h"
#include "protocol.h"

namespace b12x {

// The `algorithm` attribute of the all_reduce custom call
// (b12x_jax/ops/all_reduce.py) above the Lamport window: push one-shot,
// push two-shot, pull one-shot; kLamport is what plan_for takes inside it.
enum class Algorithm : uint32_t { kOneShot = 0, kTwoShot = 1, kPull = 2, kLamport = 3 };
inline constexpr uint32_t kLastRequestable = static_cast<uint32_t>(Algorithm::kPull);

// Bytes one CUDA block takes before the grid grows by another block. Small
// payloads are latency-bound (one barrier whatever the size), large ones
// want enough blocks to keep NVLink busy. The host has one block.
inline constexpr size_t kBytesPerBlock = 16 * 1024;
// The Lamport path spreads small payloads wider: every thread polls its own
// packs, so more blocks means more loads in flight while peers' data lands.
inline constexpr size_t kLamportBytesPerBlock = 4 * 1024;

// The launch of one call: which protocol, its grid, and the packs each block
// owns (of the payload, or of each shard for two-shot).
struct Plan {
  Algorithm algorithm;
  int grid;
  size_t packs;
  size_t shard_packs;
  size_t per_block;

  // The tag of this plan's call on elements of `dtype` at `site` (channel.h).
  B12X_HD CallTag tag(DType dtype, uint32_t site) const {
    return make_tag(Op::kAllReduce, static_cast<uint32_t>(dtype), grid, static_cast<uint32_t>(algorithm), packs, site);
  }
};

inline int grid_for(size_t bytes, const StagingLayout& layout, size_t bytes_per_block) {
  const size_t by_capacity = (bytes + layout.block_bytes - 1) / layout.block_bytes;
  const size_t by_speed = (bytes + bytes_per_block - 1) / bytes_per_block;
  size_t grid = by_capacity > by_speed ? by_capacity : by_speed;
  if (grid < 1) grid = 1;
  if (grid > static_cast<size_t>(layout.max_blocks)) grid = layout.max_blocks;
  return static_cast<int>(grid);
}

// Payloads within the channel's Lamport window take the Lamport exchange,
// whatever `chosen` says; larger ones the algorithm chosen. Depends only on
// the payload size and the channel's layouts, so every rank plans the same.
inline Plan plan_for(size_t bytes, int world, Algorithm chosen, const ChannelView& v) {
  const size_t packs = bytes / kPackBytes;
  if (v.lamport_layout.block_bytes > 0 && bytes <= v.lamport_window) {
    const int grid = grid_for(bytes, v.lamport_layout, kLamportBytesPerBlock);
    return {Algorithm::kLamport, grid, packs, packs, (packs + grid - 1) / grid};
  }
  if (chosen == Algorithm::kTwoShot) {
    // Each block stages one slice of a shard per phase; the grid spreads the
    // whole payload's bytes as the one-shot kernel does.
    const size_t shard_packs = (packs + world - 1) / world;
    const int grid = grid_for(shard_packs * kPackBytes, v.layout, kBytesPerBlock / world);
    return {Algorithm::kTwoShot, grid, packs, shard_packs, (shard_packs + grid - 1) / grid};
  }
  const int grid = grid_for(bytes, v.layout, kBytesPerBlock);
  return {chosen == Algorithm::kPull ? Algorithm::kPull : Algorithm::kOneShot, grid, packs, packs,
          (packs + grid - 1) / grid};
}

// The packs [lo, lo + n) of `total` that block `block` owns, `per_block`
// each. Block b owns the same range on every rank (the grid is a function of
// the static shape) and only its own staging cells, so blocks never wait on
// each other.
struct Slice {
  size_t lo;
  size_t n;
};
B12X_HD Slice block_slice(int block, size_t per_block, size_t total) {
  const size_t lo = block * per_block;
  return {lo, lo < total ? (per_block < total - lo ? per_block : total - lo) : 0};
}

// Pack i of the sum over `sources` (rank order, C9): every load first, then
// the sum.
template <class Mem, DType D>
B12X_HD Pack reduce_at(const Pack* const* sources, int world, size_t i) {
  Pack staged[kMaxRanks];
  B12X_UNROLL
  for (int q = 0; q < kMaxRanks; ++q) {
    if (q < world) staged[q] = Mem::load_staged(sources[q] + i);
  }
  return sum_in_rank_order<D>(staged, world);
}

// One block's part of a barrier-protocol all-reduce call at `epoch`.
struct AllReduceBlock {
  const ChannelView& v;
  const Plan& plan;
  int block;
  uint32_t epoch;
  const Pack* in;
  Pack* out;

  B12X_HD Pack* cell(int owner, int slot, int source) const {
    return reinterpret_cast<Pack*>(v.staging[owner] + v.layout.cell_offset(slot, source, block));
  }
  // One-shot: this block's slice of the payload.
  B12X_HD Slice slice() const { return block_slice(block, plan.per_block, plan.packs); }
  // Two-shot: this block's slice of shard `shard` (rank `shard` reduces it).
  B12X_HD Slice shard_slice(int shard) const {
    const size_t shard_lo = shard * plan.shard_packs;
    const size_t in_shard = shard_lo < plan.packs ? plan.packs - shard_lo : 0;
    const Slice s = block_slice(block, plan.per_block, in_shard < plan.shard_packs ? in_shard : plan.shard_packs);
    return Slice{shard_lo + s.lo, s.n};
  }
};

// One-shot, step 1 (slot epoch % 2, protocol.h's reuse argument). Push
// (kPull false): this rank's part goes into its cell on every peer, so the
// reads after the barrier stay local (remote stores are posted). Pull: it
// goes into this rank's own cell, and the reads after the barrier cross the
// link instead; the barrier protocol's reuse argument holds for both: a
// cell is written in call k and again in call k + 2, after every reader
// passed the barrier of call k + 1.
template <bool kPull, class ForEach>
B12X_HD void one_shot_stage(const AllReduceBlock& b, ForEach each) {
  const Slice s = b.slice();
  const int slot = b.epoch & 1;
  each(s.n, [&](size_t i) {
    const Pack x = b.in[s.lo + i];
    if constexpr (kPull) {
      b.cell(b.v.rank, slot, b.v.rank)[i] = x;
    } else {
      B12X_UNROLL
      for (int p = 0; p < kMaxRanks; ++p) {
        if (exchanges_with(b.v, p)) b.cell(p, slot, b.v.rank)[i] = x;
      }
    }
  });
}

// One-shot, step 2, after the barrier of `epoch`: every source's slice, this
// rank's own from its input, summed in rank order.
template <class Mem, DType D, bool kPull, class ForEach>
B12X_HD void one_shot_reduce(const AllReduceBlock& b, ForEach each) {
  const Slice s = b.slice();
  const int slot = b.epoch & 1;
  const Pack* sources[kMaxRanks];
  B12X_UNROLL
  for (int q = 0; q < kMaxRanks; ++q) {
    sources[q] = from_own_input(b.v, q) ? b.in + s.lo
                 : q < b.v.world       ? b.cell(kPull ? q : b.v.rank, slot, q)
                                       : nullptr;
  }
  each(s.n, [&](size_t i) { b.out[s.lo + i] = reduce_at<Mem, D>(sources, b.v.world, i); });
}

// Two-shot: reduce-scatter, then all-gather, as two barriers (epochs e and
// e + 1, so each phase has its own staging slot, e % 2 and (e + 1) % 2, and
// protocol.h's reuse argument holds phase by phase). Rank r owns shard r of
// the payload; block b owns the same slice of every shard.
//   1. push my slice of shard p into my cell on p, for every peer p; meet at e;
//   2. reduce my shard's slice in rank order (C9): the result goes to my
//      output and into my cell of the other slot on every peer; meet at e + 1;
//   3. copy each peer's reduced slice from my staging into my output.
// The owner reduces each element once, so all ranks hold the same bits.
template <class ForEach>
B12X_HD void two_shot_scatter(const AllReduceBlock& b, ForEach each) {
  for (int p = 0; p < b.v.world; ++p) {
    if (!exchanges_with(b.v, p)) continue;
    const Slice s = b.shard_slice(p);
    Pack* dst = b.cell(p, b.epoch & 1, b.v.rank);
    each(s.n, [&](size_t i) { dst[i] = b.in[s.lo + i]; });
  }
}

template <class Mem, DType D, class ForEach>
B12X_HD void two_shot_reduce(const AllReduceBlock& b, ForEach each) {
  const Slice mine = b.shard_slice(b.v.rank);
  const Pack* sources[kMaxRanks];
  B12X_UNROLL
  for (int q = 0; q < kMaxRanks; ++q) {
    sources[q] = from_own_input(b.v, q) ? b.in + mine.lo : q < b.v.world ? b.cell(b.v.rank, b.epoch & 1, q) : nullptr;
  }
  const int gather_slot = (b.epoch + 1u) & 1;
  each(mine.n, [&](size_t i) {
    const Pack sum = reduce_at<Mem, D>(sources, b.v.world, i);
    b.out[mine.lo + i] = sum;
    B12X_UNROLL
    for (int p = 0; p < kMaxRanks; ++p) {
      if (exchanges_with(b.v, p)) b.cell(p, gather_slot, b.v.rank)[i] = sum;
    }
  });
}

template <class Mem, class ForEach>
B12X_HD void two_shot_gather(const AllReduceBlock& b, ForEach each) {
  for (int q = 0; q < b.v.world; ++q) {
    if (!exchanges_with(b.v, q)) continue;
    const Slice s = b.shard_slice(q);
    const Pack* src = b.cell(b.v.rank, (b.epoch + 1u) & 1, q);
    each(s.n, [&](size_t i) { b.out[s.lo + i] = Mem::load_staged(src + i); });
  }
}

// What a call that cannot finish leaves in this block's outputs: NaN, never
// a stale result (DESIGN C8).
template <class ForEach>
B12X_HD void fill_nan_outputs(const AllReduceBlock& b, ForEach each) {
  const auto fill = [&](const Slice& s) { each(s.n, [&](size_t i) { b.out[s.lo + i] = nan_pack(); }); };
  if (b.plan.algorithm != Algorithm::kTwoShot) return fill(b.slice());
  for (int q = 0; q < b.v.world; ++q) fill(b.shard_slice(q));
}

}  // namespace b12x
