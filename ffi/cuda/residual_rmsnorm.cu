// all_reduce_residual_rmsnorm on CUDA: the Lamport exchange of the
// all-reduce (lamport.cuh), with the residual add and RMSNorm of rmsnorm.h
// applied in the same kernel, so the decode step's all-reduce, add and norm
// cost one launch.
#include <cuda_runtime.h>

#include <optional>
#include <string>
#include <string_view>

#include "../registry.h"
#include "../rmsnorm.h"
#include "../signatures.h"
#include "block_barrier.cuh"
#include "cuda_memory.cuh"
#include "lamport.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace b12x {
namespace {

// One row of 8192 bf16 is 1024 packs: one pack per thread, all in flight at once.
constexpr int kThreads = 1024;

// Sum of `x` over the block in a fixed order (warp shuffles, then warp 0
// over the warps' sums), so every rank normalises with the same bits. Every
// thread must call it; all get the sum.
__device__ __forceinline__ float block_sum(float x) {
  __shared__ float warp_sums[kThreads / 32];
  __shared__ float total;
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = x;
  __syncthreads();
  if (threadIdx.x < 32) {
    float w = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) w += __shfl_xor_sync(0xffffffffu, w, offset);
    if (threadIdx.x == 0) total = w;
  }
  __syncthreads();
  const float sum = total;
  __syncthreads();  // `total` and `warp_sums` are reused by the next row
  return sum;
}

// Brings the line of `p` into L1 for a load issued later: the exchange's
// polls are memory barriers to the compiler, so a load issued before them
// would hold its registers across them (ptxas spills at 1024 threads).
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(__cvta_generic_to_global(p)));
}

// Block b owns rows [b * rows_per_block, ...): their packs are one
// contiguous range, exchanged as one Lamport call of the block; then each
// row is normalised. kInRegisters (every block one row of at most kThreads
// packs: thread k owns pack k): the residual and the weight are prefetched
// before the exchange, and the norm reads the sum from registers, so after
// the polls no load waits on memory. Else the row is read back from
// residual_out. Both paths sum the squares over the same threads in the
// same order: the same bits. Sources up to kRanks (by_ranks).
template <DType D, bool kInRegisters, int kRanks>
__global__ void __launch_bounds__(kThreads)
    residual_rmsnorm_kernel(ChannelView v, RowsShape s, RowsPlan plan, CallTag tag, Placement placement, float eps,
                            const Pack* __restrict__ in,
                            const Pack* __restrict__ residual, const Pack* __restrict__ weight,
                            Pack* __restrict__ normed, Pack* __restrict__ residual_out) {
  tag = placed_tag(tag, placement, v.rank);
  const int first = blockIdx.x * plan.rows_per_block;
  const int rows = first < s.rows ? min(plan.rows_per_block, s.rows - first) : 0;
  const size_t lo = static_cast<size_t>(first) * s.row_packs;
  const size_t n = static_cast<size_t>(rows) * s.row_packs;
  const bool mine = threadIdx.x < n;  // kInRegisters: this thread owns pack threadIdx.x of the row
  Pack sum{};
  if (kInRegisters && mine) {
    prefetch_l1(residual + lo + threadIdx.x);
    prefetch_l1(weight + threadIdx.x);
  }
  const bool done = lamport_exchange<kThreads, kRanks>(v, tag, in + lo, n, [&](size_t i, const Pack* staged) {
    const Pack r = residual[lo + i];
    const Pack total = sum_in_rank_order<D, kRanks>(staged, v.world, &r);
    residual_out[lo + i] = total;
    if constexpr (kInRegisters) sum = total;  // i == threadIdx.x: this thread's one pass
  });
  if (!done) {
    fill_nan(normed + lo, n);
    fill_nan(residual_out + lo, n);
    return;
  }
  if constexpr (kInRegisters) {
    Pack w{};
    if (mine) w = weight[threadIdx.x];
    const float scale = rms_scale(block_sum(mine ? sum_of_squares<D>(sum) : 0.0f), s.hidden, eps);
    if (mine) normed[lo + threadIdx.x] = normalize_pack<D>(sum, w, scale);
  } else {
    // lamport_exchange met at a block barrier after its polls: every
    // thread's residual_out stores are visible to the whole block.
    for (int r = 0; r < rows; ++r) {
      const Pack* row = residual_out + lo + static_cast<size_t>(r) * s.row_packs;
      float squares = 0.0f;
      for (int k = threadIdx.x; k < s.row_packs; k += kThreads) squares += sum_of_squares<D>(row[k]);
      const float scale = rms_scale(block_sum(squares), s.hidden, eps);
      Pack* out = normed + lo + static_cast<size_t>(r) * s.row_packs;
      for (int k = threadIdx.x; k < s.row_packs; k += kThreads) out[k] = normalize_pack<D>(row[k], weight[k], scale);
    }
  }
}

ffi::Error ResidualRmsnormCuda(cudaStream_t stream, int32_t ordinal, ffi::Token, ffi::AnyBuffer x,
                               ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                               std::optional<ffi::AnyBuffer> expected_device, ffi::Result<ffi::Token>,
                               ffi::Result<ffi::AnyBuffer> normed,
                               ffi::Result<ffi::AnyBuffer> residual_out, std::string_view channel_id,
                               std::string_view group, int32_t site, float eps) {
  const std::string op = "b12x_jax.all_reduce_residual_rmsnorm: ";
  const RankLease handle = Registry::get().lease(Platform::kCuda, channel_id, group, ordinal);
  if (!handle) return ffi::Error::InvalidArgument(unprepared_message("all_reduce_residual_rmsnorm", channel_id, ordinal));
  const std::string earlier = pending_error(*handle.group, handle.rank);
  if (!earlier.empty()) return ffi::Error::Internal(earlier);
  const ChannelView& v = handle.view();
  RowsShape s{};
  const std::string problem = rows_call_shape(x, residual, weight, s);
  if (!problem.empty()) return ffi::Error::InvalidArgument(problem);
  const RowsPlan plan = plan_rows(s, v.lamport_layout);
  if (plan.grid == 0) return ffi::Error::InvalidArgument(rows_capacity_message(s, v.lamport_layout));
  const size_t bytes = x.size_bytes();
  if (!like(x, *normed) || !like(x, *residual_out)) {
    return ffi::Error::InvalidArgument(op + "both results must have x's shape and dtype");
  }
  auto* out = static_cast<Pack*>(normed->untyped_data());
  auto* res_out = static_cast<Pack*>(residual_out->untyped_data());
  if (handle.group->options().poison_outputs) {  // NaN everywhere: an element the kernel misses shows up
    cudaMemsetAsync(out, 0xFF, bytes, stream);
    cudaMemsetAsync(res_out, 0xFF, bytes, stream);
  }
  const auto* in = static_cast<const Pack*>(x.untyped_data());
  const auto* res = static_cast<const Pack*>(residual.untyped_data());
  const auto* w = static_cast<const Pack*>(weight.untyped_data());
  const Placement placement = placement_of(expected_device, Platform::kCuda, ordinal);
  const bool in_registers = plan.rows_per_block == 1 && s.row_packs <= kThreads;
  const auto launch = [&](auto dtype) {
    constexpr DType kD = decltype(dtype)::value;
    const auto kernel = by_ranks(v.world, [&](auto ranks) {
      return in_registers ? residual_rmsnorm_kernel<kD, true, ranks.value>
                          : residual_rmsnorm_kernel<kD, false, ranks.value>;
    });
    kernel<<<plan.grid, kThreads, 0, stream>>>(v, s, plan, plan.tag(s, kD, site), placement, eps, in, res, w, out,
                                               res_out);
  };
  switch (x.element_type()) {
    case ffi::DataType::F32:
      launch(std::integral_constant<DType, DType::kF32>{});
      break;
    case ffi::DataType::BF16:
      launch(std::integral_constant<DType, DType::kBF16>{});
      break;
    case ffi::DataType::F16:
      launch(std::integral_constant<DType, DType::kF16>{});
      break;
    default:
      return ffi::Error::InvalidArgument(op + "dtype must be float32, bfloat16 or float16");
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(op + "kernel launch failed: " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace b12x

// Command-buffer compatible (C5), like all_reduce: the handler only launches
// on its stream; the call counter lives in device memory.
XLA_FFI_DEFINE_HANDLER_SYMBOL(b12x_residual_rmsnorm_cuda, b12x::ResidualRmsnormCuda,
                              b12x::residual_rmsnorm_signature(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
