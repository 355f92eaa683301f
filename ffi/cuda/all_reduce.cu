// All-reduce between the GPUs of a channel, in one kernel per call (DESIGN
// C5-C10): payloads up to the channel's Lamport window take the flagless
// exchange of lamport.cuh; larger ones stage, barrier and reduce by the
// protocol of protocol.h, in one shot (every rank reduces everything) or in
// two (reduce-scatter, then all-gather: each rank reduces 1/N, and moves
// 2(N-1)/N of the payload instead of N-1 times it), as the caller chose.
#include <cuda_runtime.h>

#include <string_view>

#include "../numeric.h"
#include "../protocol.h"
#include "../registry.h"
#include "block_barrier.cuh"
#include "cuda_memory.cuh"
#include "lamport.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace b12x {
namespace {

constexpr int kThreads = 512;
// Bytes one block takes before the grid grows by another block. Small
// payloads are latency-bound (one barrier whatever the size), large ones
// want enough blocks to keep NVLink busy.
constexpr size_t kBytesPerBlock = 16 * 1024;
// The Lamport path spreads small payloads wider: every thread polls its own
// packs, so more blocks means more loads in flight while peers' data lands.
constexpr size_t kLamportBytesPerBlock = 4 * 1024;

// The packs [lo, lo + n) of `total` that this block owns, `per_block` each.
// Block b owns the same range on every rank (the grid is a function of the
// static shape) and only its own staging cells, so blocks never wait on each
// other.
struct Slice {
  size_t lo;
  size_t n;
};
__device__ __forceinline__ Slice block_slice(size_t per_block, size_t total) {
  const size_t lo = blockIdx.x * per_block;
  return {lo, lo < total ? min(per_block, total - lo) : 0};
}

// Pack i of the sum over `sources` (rank order, C9): every load first, then
// the sum.
template <DType D>
__device__ __forceinline__ Pack reduce_at(const Pack* const* sources, int world, size_t i) {
  Pack staged[kMaxRanks];
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) {
    if (q < world) staged[q] = load_l2(sources[q] + i);
  }
  return sum_in_rank_order<D>(staged, world);
}

// Stage, meet, reduce. Push (kPull false): this rank's part goes into its
// cell on every peer (remote stores are posted, so the reads after the
// barrier stay local). Pull: it goes into this rank's own cell, and the
// reads after the barrier cross the link instead (loads in flight instead
// of posted stores; kept to measure against push, benchmarks/RESULTS.md).
// The barrier protocol's reuse argument holds for both: a cell is written
// in call k and again in call k + 2, after every reader passed the barrier
// of call k + 1. On a timeout nothing staged may be read (C6).
template <DType D, bool kPull>
__global__ void __launch_bounds__(kThreads)
    one_shot_all_reduce(ChannelView v, const Pack* __restrict__ in, Pack* __restrict__ out, size_t packs,
                        size_t per_block) {
  const int block = blockIdx.x;
  const Slice s = block_slice(per_block, packs);
  // A timed-out channel fails fast (C8), leaving NaN, never a stale result.
  if (channel_poisoned<CudaMem>(v)) return fill_nan(out + s.lo, s.n);
  const uint32_t epoch = next_epoch<CudaMem>(v, block);
  const int slot = epoch & 1;
  const auto cell = [&](int owner, int source) {
    return reinterpret_cast<Pack*>(v.staging[owner] + v.layout.cell_offset(slot, source, block));
  };
  for (size_t i = threadIdx.x; i < s.n; i += kThreads) {
    const Pack x = in[s.lo + i];
    if constexpr (kPull) {
      cell(v.rank, v.rank)[i] = x;
    } else {
#pragma unroll
      for (int p = 0; p < kMaxRanks; ++p) {
        if (p < v.world && p != v.rank) cell(p, v.rank)[i] = x;
      }
    }
  }
  if (!block_barrier(v, block, epoch)) return fill_nan(out + s.lo, s.n);
  const Pack* sources[kMaxRanks];
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) {
    sources[q] = q == v.rank ? in + s.lo : q < v.world ? cell(kPull ? q : v.rank, q) : nullptr;
  }
  for (size_t i = threadIdx.x; i < s.n; i += kThreads) out[s.lo + i] = reduce_at<D>(sources, v.world, i);
}

// Reduce-scatter, then all-gather, as two barrier calls of protocol.h
// (epochs e and e + 1, so each phase has its own staging slot and the reuse
// argument of protocol.h holds phase by phase). Rank r owns shard r of the
// payload; block b owns the same slice of every shard.
//   1. push my slice of shard p into my cell on p, for every peer p; meet;
//   2. reduce my shard's slice in rank order (C9): the result goes to my
//      output and into my cell of the other slot on every peer; meet;
//   3. copy each peer's reduced slice from my staging into my output.
// The owner reduces each element once, so all ranks hold the same bits.
template <DType D>
__global__ void __launch_bounds__(kThreads)
    two_shot_all_reduce(ChannelView v, const Pack* __restrict__ in, Pack* __restrict__ out, size_t packs,
                        size_t shard_packs, size_t per_block) {
  const int block = blockIdx.x;
  const auto slice = [&](int shard) {
    const size_t shard_lo = shard * shard_packs;
    const Slice s = block_slice(per_block, shard_lo < packs ? min(shard_packs, packs - shard_lo) : 0);
    return Slice{shard_lo + s.lo, s.n};
  };
  const auto fail = [&] {
    for (int q = 0; q < v.world; ++q) {
      const Slice s = slice(q);
      fill_nan(out + s.lo, s.n);
    }
  };
  if (channel_poisoned<CudaMem>(v)) return fail();
  const uint32_t epoch = next_epoch<CudaMem>(v, block);
  const int scatter_slot = epoch & 1;
  const int gather_slot = (epoch + 1) & 1;
  const auto cell = [&](int owner, int slot, int source) {
    return reinterpret_cast<Pack*>(v.staging[owner] + v.layout.cell_offset(slot, source, block));
  };

  // 1. Reduce-scatter: my slice of every peer's shard goes to that peer.
  for (int p = 0; p < v.world; ++p) {
    if (p == v.rank) continue;
    const Slice s = slice(p);
    Pack* dst = cell(p, scatter_slot, v.rank);
    for (size_t i = threadIdx.x; i < s.n; i += kThreads) dst[i] = in[s.lo + i];
  }
  if (!block_barrier(v, block, epoch)) return fail();

  // 2. Reduce my shard's slice; keep it and send it to every peer.
  const Slice mine = slice(v.rank);
  const Pack* sources[kMaxRanks];
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) {
    sources[q] = q == v.rank ? in + mine.lo : q < v.world ? cell(v.rank, scatter_slot, q) : nullptr;
  }
  for (size_t i = threadIdx.x; i < mine.n; i += kThreads) {
    const Pack sum = reduce_at<D>(sources, v.world, i);
    out[mine.lo + i] = sum;
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p) {
      if (p < v.world && p != v.rank) cell(p, gather_slot, v.rank)[i] = sum;
    }
  }
  if (!block_barrier(v, block, epoch + 1)) return fail();

  // 3. All-gather: the peers' reduced slices, from my staging.
  for (int q = 0; q < v.world; ++q) {
    if (q == v.rank) continue;
    const Slice s = slice(q);
    const Pack* src = cell(v.rank, gather_slot, q);
    for (size_t i = threadIdx.x; i < s.n; i += kThreads) out[s.lo + i] = load_l2(src + i);
  }
}

// Push, poll, reduce, refill (lamport.cuh). Block b owns the same packs as
// in the barrier kernel, and its own cells of the three buffers.
template <DType D>
__global__ void __launch_bounds__(kThreads)
    lamport_all_reduce(ChannelView v, const Pack* __restrict__ in, Pack* __restrict__ out, size_t packs,
                       size_t per_block) {
  const Slice s = block_slice(per_block, packs);
  const bool done = lamport_exchange<kThreads>(v, in + s.lo, s.n, [&](size_t i, const Pack* staged) {
    out[s.lo + i] = sum_in_rank_order<D>(staged, v.world);
  });
  if (!done) fill_nan(out + s.lo, s.n);
}

int grid_for(size_t bytes, const StagingLayout& layout, size_t bytes_per_block) {
  const size_t by_capacity = (bytes + layout.block_bytes - 1) / layout.block_bytes;
  const size_t by_speed = (bytes + bytes_per_block - 1) / bytes_per_block;
  size_t grid = by_capacity > by_speed ? by_capacity : by_speed;
  if (grid < 1) grid = 1;
  if (grid > static_cast<size_t>(layout.max_blocks)) grid = layout.max_blocks;
  return static_cast<int>(grid);
}

// Above the Lamport window, the caller's choice (the `algorithm` attribute,
// b12x_jax/ops/all_reduce.py): push one-shot, push two-shot, pull one-shot.
enum class Algorithm : int32_t { kOneShot = 0, kTwoShot = 1, kPull = 2, kLamport = 3 };

// The launch of one call: which kernel, its grid, and the packs each block
// owns (of the payload, or of each shard for two-shot).
struct Plan {
  Algorithm algorithm;
  int grid;
  size_t shard_packs;
  size_t per_block;
};

Plan plan_for(size_t bytes, int world, Algorithm chosen, const ChannelView& v) {
  const size_t packs = bytes / kPackBytes;
  if (v.lamport_layout.block_bytes > 0 && bytes <= v.lamport_layout.capacity()) {
    const int grid = grid_for(bytes, v.lamport_layout, kLamportBytesPerBlock);
    return {Algorithm::kLamport, grid, packs, (packs + grid - 1) / grid};
  }
  if (chosen == Algorithm::kTwoShot) {
    // Each block stages one slice of a shard per phase; the grid spreads the
    // whole payload's bytes as the one-shot kernel does.
    const size_t shard_packs = (packs + world - 1) / world;
    const int grid = grid_for(shard_packs * kPackBytes, v.layout, kBytesPerBlock / world);
    return {Algorithm::kTwoShot, grid, shard_packs, (shard_packs + grid - 1) / grid};
  }
  const int grid = grid_for(bytes, v.layout, kBytesPerBlock);
  return {chosen == Algorithm::kPull ? Algorithm::kPull : Algorithm::kOneShot, grid, packs, (packs + grid - 1) / grid};
}

template <DType D>
void launch(const Plan& plan, cudaStream_t stream, const ChannelView& v, const Pack* in, Pack* out, size_t packs) {
  switch (plan.algorithm) {
    case Algorithm::kLamport:
      lamport_all_reduce<D><<<plan.grid, kThreads, 0, stream>>>(v, in, out, packs, plan.per_block);
      break;
    case Algorithm::kOneShot:
      one_shot_all_reduce<D, false><<<plan.grid, kThreads, 0, stream>>>(v, in, out, packs, plan.per_block);
      break;
    case Algorithm::kPull:
      one_shot_all_reduce<D, true><<<plan.grid, kThreads, 0, stream>>>(v, in, out, packs, plan.per_block);
      break;
    case Algorithm::kTwoShot:
      two_shot_all_reduce<D><<<plan.grid, kThreads, 0, stream>>>(v, in, out, packs, plan.shard_packs,
                                                                 plan.per_block);
      break;
  }
}

ffi::Error AllReduceCuda(cudaStream_t stream, int32_t ordinal, ffi::Token, ffi::AnyBuffer x,
                         ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                         std::string_view channel_id, int32_t algorithm) {
  const RankLease handle = Registry::get().lease(Platform::kCuda, channel_id, ordinal);
  if (!handle) return ffi::Error::InvalidArgument(unprepared_message("all_reduce", channel_id, ordinal));
  // A timeout recorded by an earlier call (also one replayed from a CUDA
  // graph) surfaces here, without a sync: the record is in mapped host memory.
  const std::string earlier = pending_error(*handle.group, handle.rank);
  if (!earlier.empty()) return ffi::Error::Internal(earlier);
  const ChannelView& v = handle.view();
  const size_t bytes = x.size_bytes();
  if (bytes % kPackBytes != 0 || bytes > v.layout.capacity()) {
    return ffi::Error::InvalidArgument("b12x_jax.all_reduce: payload of " + std::to_string(bytes) +
                                       " bytes is outside the channel's window (a multiple of 16 up to " +
                                       std::to_string(v.layout.capacity()) + ")");
  }
  auto* out = static_cast<Pack*>(y->untyped_data());
  if (handle.group->options().poison_outputs) cudaMemsetAsync(out, 0xFF, bytes, stream);  // NaN everywhere
  const size_t packs = bytes / kPackBytes;
  if (algorithm < 0 || algorithm > static_cast<int32_t>(Algorithm::kPull)) {
    return ffi::Error::InvalidArgument("b12x_jax.all_reduce: unknown algorithm " + std::to_string(algorithm));
  }
  const Plan plan = plan_for(bytes, v.world, static_cast<Algorithm>(algorithm), v);
  const auto* in = static_cast<const Pack*>(x.untyped_data());
  switch (x.element_type()) {
    case ffi::DataType::F32:
      launch<DType::kF32>(plan, stream, v, in, out, packs);
      break;
    case ffi::DataType::BF16:
      launch<DType::kBF16>(plan, stream, v, in, out, packs);
      break;
    case ffi::DataType::F16:
      launch<DType::kF16>(plan, stream, v, in, out, packs);
      break;
    default:
      return ffi::Error::InvalidArgument("b12x_jax.all_reduce: dtype must be float32, bfloat16 or float16");
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("b12x_jax.all_reduce: kernel launch failed: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace b12x

// Command-buffer compatible (C5): the handler only launches on its stream
// and the kernel reads and advances the epoch in device memory, so a CUDA
// graph replay is a correct call.
XLA_FFI_DEFINE_HANDLER_SYMBOL(b12x_all_reduce_cuda, b12x::AllReduceCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::Token>()  // the channel's order (DESIGN C15)
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Token>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<std::string_view>("channel_id")
                                  .Attr<int32_t>("algorithm"),  // above the Lamport window: see Algorithm
                              {xla::ffi::Traits::kCmdBufferCompatible});
