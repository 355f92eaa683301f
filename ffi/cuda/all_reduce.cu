// All-reduce between the GPUs of a channel, in one kernel per call (DESIGN
// C5-C10): the protocol plan_for (all_reduce.h) picks, run with this
// backend's thread mapping: payloads up to the channel's Lamport window take
// the flagless exchange of lamport.h; larger ones stage, barrier and reduce
// by the steps of all_reduce.h, in one shot (every rank reduces everything)
// or in two (reduce-scatter, then all-gather: each rank reduces 1/N, and
// moves 2(N-1)/N of the payload instead of N-1 times it), as the caller
// chose.
#include <cuda_runtime.h>

#include <optional>
#include <string_view>

#include "../all_reduce.h"
#include "../numeric.h"
#include "../protocol.h"
#include "../registry.h"
#include "../signatures.h"
#include "block_barrier.cuh"
#include "cuda_memory.cuh"
#include "lamport.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace b12x {
namespace {

// A block of kThreads, one block an SM in the launch bounds (docs/DESIGN.md,
// "Lamport": registers).
constexpr int kThreads = 512;

// Stage, meet, reduce (all_reduce.h: one_shot_stage, one_shot_reduce). On a
// failed wait nothing staged may be read (C6).
template <DType D, bool kPull>
__global__ void __launch_bounds__(kThreads, 1)
    one_shot_all_reduce(ChannelView v, Plan plan, CallTag tag, Placement placement, const Pack* __restrict__ in,
                        Pack* __restrict__ out) {
  const int block = blockIdx.x;
  tag = placed_tag(tag, placement, v.rank);
  // A failed channel fails fast (C8), leaving NaN, never a stale result.
  const AllReduceBlock b{v, plan, block, next_epoch<CudaMem>(v, block), in, out};
  if (block_halted(v)) return fill_nan_outputs(b, BlockThreads{});
  one_shot_stage<kPull>(b, BlockThreads{});
  if (!block_barrier(v, block, b.epoch, tag)) return fill_nan_outputs(b, BlockThreads{});
  one_shot_reduce<CudaMem, D, kPull>(b, BlockThreads{});
}

// Reduce-scatter, meet at e, reduce and push, meet at e + 1, gather
// (all_reduce.h: two_shot_*).
template <DType D>
__global__ void __launch_bounds__(kThreads, 1)
    two_shot_all_reduce(ChannelView v, Plan plan, CallTag tag, Placement placement, const Pack* __restrict__ in,
                        Pack* __restrict__ out) {
  const int block = blockIdx.x;
  tag = placed_tag(tag, placement, v.rank);
  const AllReduceBlock b{v, plan, block, next_epoch<CudaMem>(v, block), in, out};
  if (block_halted(v)) return fill_nan_outputs(b, BlockThreads{});
  two_shot_scatter(b, BlockThreads{});
  if (!block_barrier(v, block, b.epoch, tag)) return fill_nan_outputs(b, BlockThreads{});
  two_shot_reduce<CudaMem, D>(b, BlockThreads{});
  if (!block_barrier(v, block, b.epoch + 1u, tag)) return fill_nan_outputs(b, BlockThreads{});
  two_shot_gather<CudaMem>(b, BlockThreads{});
}

// Push, poll, reduce, refill (lamport.cuh), over sources up to kRanks
// (by_ranks). Block b owns the same packs as in the one-shot kernel, and its
// own cells of the three buffers.
template <DType D, int kRanks>
__global__ void __launch_bounds__(kThreads, 1)
    lamport_all_reduce(ChannelView v, Plan plan, CallTag tag, Placement placement, const Pack* __restrict__ in,
                       Pack* __restrict__ out) {
  tag = placed_tag(tag, placement, v.rank);
  const Slice s = block_slice(blockIdx.x, plan.per_block, plan.packs);
  const bool done = lamport_exchange<kThreads, kRanks>(v, tag, in + s.lo, s.n, [&](size_t i, const Pack* staged) {
    out[s.lo + i] = sum_in_rank_order<D, kRanks>(staged, v.world);
  });
  if (!done) fill_nan(out + s.lo, s.n);
}

template <DType D>
void launch(const Plan& plan, uint32_t site, const Placement& placement, cudaStream_t stream, const ChannelView& v,
            const Pack* in, Pack* out) {
  const CallTag tag = plan.tag(D, site);
  switch (plan.algorithm) {
    case Algorithm::kLamport: {
      const auto kernel = by_ranks(v.world, [](auto ranks) { return lamport_all_reduce<D, ranks.value>; });
      kernel<<<plan.grid, kThreads, 0, stream>>>(v, plan, tag, placement, in, out);
      break;
    }
    case Algorithm::kOneShot:
      one_shot_all_reduce<D, false><<<plan.grid, kThreads, 0, stream>>>(v, plan, tag, placement, in, out);
      break;
    case Algorithm::kPull:
      one_shot_all_reduce<D, true><<<plan.grid, kThreads, 0, stream>>>(v, plan, tag, placement, in, out);
      break;
    case Algorithm::kTwoShot:
      two_shot_all_reduce<D><<<plan.grid, kThreads, 0, stream>>>(v, plan, tag, placement, in, out);
      break;
  }
}

ffi::Error AllReduceCuda(cudaStream_t stream, int32_t ordinal, ffi::Token, ffi::AnyBuffer x,
                         std::optional<ffi::AnyBuffer> expected_device, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                         std::string_view channel_id, std::string_view group, int32_t site, int32_t algorithm) {
  const RankLease handle = Registry::get().lease(Platform::kCuda, channel_id, group, ordinal);
  if (!handle) return ffi::Error::InvalidArgument(unprepared_message("all_reduce", channel_id, ordinal));
  // A timeout recorded by an earlier call (also one replayed from a CUDA
  // graph) surfaces here, without a sync: the record is in mapped host memory.
  const std::string earlier = pending_error(*handle.group, handle.rank);
  if (!earlier.empty()) return ffi::Error::Internal(earlier);
  const ChannelView& v = handle.view();
  const size_t bytes = x.size_bytes();
  if (bytes % kPackBytes != 0 || bytes > v.capacity_bytes) {
    return ffi::Error::InvalidArgument("b12x_jax.all_reduce: payload of " + std::to_string(bytes) +
                                       " bytes is outside the channel's window (a multiple of 16 up to " +
                                       std::to_string(v.capacity_bytes) + ")");
  }
  if (!like(x, *y)) return ffi::Error::InvalidArgument("b12x_jax.all_reduce: the result must have x's shape and dtype");
  auto* out = static_cast<Pack*>(y->untyped_data());
  if (handle.group->options().poison_outputs) cudaMemsetAsync(out, 0xFF, bytes, stream);  // NaN everywhere
  if (algorithm < 0 || static_cast<uint32_t>(algorithm) > kLastRequestable) {
    return ffi::Error::InvalidArgument("b12x_jax.all_reduce: unknown algorithm " + std::to_string(algorithm));
  }
  const Plan plan = plan_for(bytes, v.world, static_cast<Algorithm>(algorithm), v);
  const auto* in = static_cast<const Pack*>(x.untyped_data());
  const Placement placement = placement_of(expected_device, Platform::kCuda, ordinal);
  switch (x.element_type()) {
    case ffi::DataType::F32:
      launch<DType::kF32>(plan, site, placement, stream, v, in, out);
      break;
    case ffi::DataType::BF16:
      launch<DType::kBF16>(plan, site, placement, stream, v, in, out);
      break;
    case ffi::DataType::F16:
      launch<DType::kF16>(plan, site, placement, stream, v, in, out);
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
                              b12x::all_reduce_signature(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
