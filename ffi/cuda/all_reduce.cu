// One-shot all-reduce between the GPUs of a channel, in one kernel per call
// (DESIGN C5-C10): payloads up to the channel's Lamport window take the
// flagless exchange of lamport.cuh, larger ones stage, barrier and reduce by
// the protocol of protocol.h.
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

// Stage, meet, reduce. Block b owns packs [b * per_block, (b + 1) * per_block)
// on every rank (same grid everywhere: the shape is static), and only its
// own staging cell, so blocks never wait on each other.
template <DType D>
__global__ void __launch_bounds__(kThreads)
    one_shot_all_reduce(ChannelView v, const Pack* __restrict__ in, Pack* __restrict__ out, size_t packs,
                        size_t per_block) {
  const int block = blockIdx.x;
  const size_t lo = block * per_block;
  const size_t n = lo < packs ? min(per_block, packs - lo) : 0;
  // A timed-out channel fails fast (C8), leaving NaN, never a stale result.
  if (channel_poisoned<CudaMem>(v)) return fill_nan(out + lo, n);
  const uint32_t epoch = next_epoch<CudaMem>(v, block);
  const int slot = epoch & 1;

  // 1. Push this rank's part into its cell on every peer: remote stores are
  //    posted, so the peers' reads below stay local.
  Pack* cells[kMaxRanks];
#pragma unroll
  for (int p = 0; p < kMaxRanks; ++p) {
    cells[p] = p < v.world ? reinterpret_cast<Pack*>(v.staging[p] + v.layout.cell_offset(slot, v.rank, block))
                           : nullptr;
  }
  for (size_t i = threadIdx.x; i < n; i += kThreads) {
    const Pack x = in[lo + i];
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p) {
      if (p < v.world && p != v.rank) cells[p][i] = x;
    }
  }

  // 2. Meet the peers (C6); on a timeout nothing staged may be read.
  if (!block_barrier(v, block, epoch)) return fill_nan(out + lo, n);

  // 3. Reduce the sources in rank order (C9). Staged cells are read through
  //    L2 (.cg): L1 is not coherent with the peers' writes.
  const Pack* sources[kMaxRanks];
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) {
    sources[q] = q == v.rank ? in + lo
                             : reinterpret_cast<const Pack*>(v.staging[v.rank] + v.layout.cell_offset(slot, q, block));
  }
  for (size_t i = threadIdx.x; i < n; i += kThreads) {
    float acc[Elements<D>::kCount] = {};
    Pack staged[kMaxRanks];
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      if (q < v.world) {
        const uint4 w = __ldcg(reinterpret_cast<const uint4*>(sources[q]) + i);
        staged[q] = Pack{{w.x, w.y, w.z, w.w}};
      }
    }
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      if (q < v.world) accumulate<D>(acc, staged[q]);
    }
    out[lo + i] = round_pack<D>(acc);
  }
}

// Push, poll, reduce, refill (lamport.cuh). Block b owns the same packs as
// in the barrier kernel, and its own cells of the three buffers.
template <DType D>
__global__ void __launch_bounds__(kThreads)
    lamport_all_reduce(ChannelView v, const Pack* __restrict__ in, Pack* __restrict__ out, size_t packs,
                       size_t per_block) {
  const size_t lo = blockIdx.x * per_block;
  const size_t n = lo < packs ? min(per_block, packs - lo) : 0;
  const bool done = lamport_exchange<kThreads>(v, in + lo, n, [&](size_t i, const Pack* staged) {
    float acc[Elements<D>::kCount] = {};
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      if (q < v.world) accumulate<D>(acc, staged[q]);
    }
    out[lo + i] = round_pack<D>(acc);
  });
  if (!done) fill_nan(out + lo, n);
}

int grid_for(size_t bytes, const StagingLayout& layout, size_t bytes_per_block) {
  const size_t by_capacity = (bytes + layout.block_bytes - 1) / layout.block_bytes;
  const size_t by_speed = (bytes + bytes_per_block - 1) / bytes_per_block;
  size_t grid = by_capacity > by_speed ? by_capacity : by_speed;
  if (grid < 1) grid = 1;
  if (grid > static_cast<size_t>(layout.max_blocks)) grid = layout.max_blocks;
  return static_cast<int>(grid);
}

template <DType D>
void launch(bool lamport, int grid, cudaStream_t stream, const ChannelView& v, const Pack* in, Pack* out,
            size_t packs, size_t per_block) {
  if (lamport) {
    lamport_all_reduce<D><<<grid, kThreads, 0, stream>>>(v, in, out, packs, per_block);
  } else {
    one_shot_all_reduce<D><<<grid, kThreads, 0, stream>>>(v, in, out, packs, per_block);
  }
}

ffi::Error AllReduceCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         std::string_view channel_id) {
  const RankHandle handle = Registry::get().find(Platform::kCuda, channel_id, ordinal);
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
  const bool lamport = bytes <= v.lamport_layout.capacity();
  const int grid = lamport ? grid_for(bytes, v.lamport_layout, kLamportBytesPerBlock)
                           : grid_for(bytes, v.layout, kBytesPerBlock);
  const size_t per_block = (packs + grid - 1) / grid;
  const auto* in = static_cast<const Pack*>(x.untyped_data());
  switch (x.element_type()) {
    case ffi::DataType::F32:
      launch<DType::kF32>(lamport, grid, stream, v, in, out, packs, per_block);
      break;
    case ffi::DataType::BF16:
      launch<DType::kBF16>(lamport, grid, stream, v, in, out, packs, per_block);
      break;
    case ffi::DataType::F16:
      launch<DType::kF16>(lamport, grid, stream, v, in, out, packs, per_block);
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
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<std::string_view>("channel_id"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
