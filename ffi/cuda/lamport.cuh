// The Lamport exchange of lamport.h for one CUDA block: every thread pushes,
// then polls and reduces its own packs, so a pack is reduced as soon as it
// landed from every source (docs/DESIGN.md, "Lamport").
#pragma once

#include <cstdint>
#include <type_traits>

#include "../channel.h"
#include "../lamport.h"
#include "../numeric.h"
#include "../protocol.h"
#include "cuda_memory.cuh"

namespace b12x {

// One Lamport call of this block (block b = blockIdx.x, every thread of the
// block must call it) for call `tag`, of `n` packs per source: `load(i)` is
// what pack i sends (its loads from the op's inputs), `push(c, i, loaded)`
// sends it to every peer (the same pack, or each peer its own), `own(i)` is
// this rank's own pack i where a sum reads it from the input
// (from_own_input); each pack's sources in rank order (C9) go to
// `reduce(i, staged)` as they arrive, while the refill of what the
// previous call read is in flight; then it moves on to the next buffer.
// One thread checks every source's header (the tag); a mismatch stops the
// block like a timeout.
// Every op that uses the Lamport buffers of a channel goes through here, so
// their calls interleave on one channel by the reuse argument of lamport.h.
// Returns the buffer B(k) the call read (its cells stay as they are until
// this block's next call; every thread's `reduce` stores are visible to the
// block), or -1, with nothing counted, when the channel is poisoned or
// stale or a wait failed (C8: bounded, error recorded): the caller then
// fills its outputs with NaN (also over what `reduce` wrote).
//
// A small call is a few round trips to memory long, so none is paid twice:
// each thread's first pack and the block's start words (lamport_start) are
// loaded together, thread 0 decides for the block (one reading of the
// poison word, so no thread leaves while others meet at a barrier), and
// the header is polled beside the others' polls by a thread that holds no
// packs where there is one, in a warp of its own where there is one: in a
// warp with packs its polls would run before theirs, not beside them
// (docs/DESIGN.md, "Lamport").
// The loops over sources run to kRanks, which must hold the world (the
// kernel's unroll bound, picked by by_ranks): `reduce` gets kRanks packs.
template <int kThreads, int kRanks, class Load, class Push, class Own, class Reduce>
__device__ __forceinline__ int lamport_exchange_with(const ChannelView& v, const CallTag& tag, size_t n, Load load,
                                                     Push push, Own own, Reduce reduce) {
  static_assert(kRanks <= kMaxRanks);
  // Thread 0's decision at the start, apart from `failed`: a wait may set
  // that one before a slow warp has read the decision, and that warp would
  // leave without its pushes.
  __shared__ int halted;
  __shared__ volatile int failed;  // volatile: read while other threads write it
  __shared__ LamportStart start;
  const size_t first = threadIdx.x;
  decltype(load(first)) loaded{};
  if (first < n) loaded = load(first);
  if (threadIdx.x == 0) {
    if (v.world > kRanks) __trap();  // a launch bug that would skip sources: never a quiet wrong sum
    const LamportStart s = lamport_start<CudaMem>(v, blockIdx.x);
    halted = lamport_halted<CudaMem>(v, s) ? 1 : 0;
    failed = 0;
    start = s;
  }
  __syncthreads();
  if (halted) return -1;
  const LamportCall c = lamport_begin(blockIdx.x, tag, start);
  Deadline deadline = call_deadline(v, start.served == 0);  // served only by lamport_advance

  // 1. Push this rank's part, and the call's tag, to every peer.
  const size_t spare_warp = (n + 31) / 32 * 32;  // the first thread of the first warp without packs
  const size_t header_thread = spare_warp < kThreads ? spare_warp : n < kThreads ? n : 0;
  if (threadIdx.x == header_thread) lamport_push_header<CudaMem>(v, c);
  for (size_t i = first; i < n; i += kThreads) push(c, i, i == first ? loaded : load(i));

  // 2. Refill the cells this block read in its previous call: its stores
  //    overlap the polls (lamport.h: any time in call k is before call
  //    k + 1's pushes, which is all the reuse argument asks).
  for (size_t i = first; i < lamport_refill_packs(c); i += kThreads) lamport_refill<CudaMem, kRanks>(v, c, i);

  // 3. Poll each source's pack until every word arrived, then reduce. One
  //    failed thread stops the block.
  // Spins on `probe` (bounded by poll_peer every 64 spins); false once this
  // thread or another one of the block failed.
  const auto await = [&](int q, auto probe) {
    for (uint32_t spins = 1;; ++spins) {
      const PeerState state = (spins & 63) == 0 ? poll_peer<CudaMem>(v, q, c.call + 1u, deadline, probe) : probe();
      if (state == PeerState::kArrived) return true;
      if (state == PeerState::kFailed || ((spins & 63) == 0 && failed)) {
        failed = 1;
        return false;
      }
    }
  };
  if (threadIdx.x == header_thread) {
    for (int q = 0; q < v.world; ++q) {
      if (exchanges_with(v, q) && !await(q, [&] { return lamport_header_state<CudaMem>(v, c, q); })) break;
    }
  }
  for (size_t i = first; i < n && !failed; i += kThreads) {
    Pack staged[kRanks];
    bool ok = true;
#pragma unroll
    for (int q = 0; q < kRanks; ++q) {
      if (q >= v.world || !ok) continue;
      // Loaded into a local, then stored at the unrolled index: loaded
      // through a reference into staged[q], the array lived in local
      // memory (ptxas: 128-160 bytes of stack, spills for 16-bit dtypes).
      Pack x;
      if (from_own_input(v, q)) {
        x = lamport_encode(own(i));  // as its peers sum it: the same bits everywhere (C9)
      } else {
        ok = await(q, [&] { return lamport_load<CudaMem>(v, c, q, i, x) ? PeerState::kArrived : PeerState::kPending; });
      }
      staged[q] = x;
    }
    if (!ok) break;
    reduce(i, staged);
  }
  __syncthreads();
  if (failed) return -1;

  // 4. Advance: read only by this block's next call, a later kernel.
  if (threadIdx.x == 0) lamport_advance<CudaMem>(v, c, static_cast<uint32_t>(n));
  return c.buffer;
}

// The exchange of a sum: every peer gets this rank's `in[0, n)`. True
// where lamport_exchange_with returns a buffer.
template <int kThreads, int kRanks, class Reduce>
__device__ __forceinline__ bool lamport_exchange(const ChannelView& v, const CallTag& tag,
                                                 const Pack* __restrict__ in, size_t n, Reduce reduce) {
  const auto load = [&](size_t i) { return in[i]; };
  const auto push = [&](const LamportCall& c, size_t i, const Pack& x) { lamport_push<CudaMem, kRanks>(v, c, i, x); };
  return lamport_exchange_with<kThreads, kRanks>(v, tag, n, load, push, load, reduce) >= 0;
}

// `pick(std::integral_constant<int, kRanks>{})` for the smallest kRanks of
// 2, 4 and kMaxRanks that holds `world`: a Lamport kernel's unroll bound over
// sources, so a small world runs shorter loops (docs/DESIGN.md, "Lamport").
// Every bound's `pick` must return the same type (a kernel pointer).
template <class Pick>
auto by_ranks(int world, Pick pick) {
  if (world <= 2) return pick(std::integral_constant<int, 2>{});
  if (world <= 4) return pick(std::integral_constant<int, 4>{});
  return pick(std::integral_constant<int, kMaxRanks>{});
}

}  // namespace b12x
