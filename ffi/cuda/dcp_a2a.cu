// DCP all-to-all merge between the GPUs of a channel: push, meet and merge
// in one kernel (DESIGN C5-C10), by the Lamport exchange of lamport.h where
// the rows fit the Lamport cells, else by the barrier protocol of
// protocol.h, on the rows and math of dcp.h.
#include <cuda_runtime.h>

#include <optional>
#include <string>
#include <string_view>

#include "../dcp.h"
#include "../dcp_call.h"
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
// Result bytes one block merges before the grid grows by another block: a
// decode-sized call is latency-bound (one barrier whatever the size), a
// large one wants enough blocks to keep NVLink busy.
constexpr size_t kBytesPerBlock = 8 * 1024;

// What a call that cannot finish leaves in a block's rows [lo, lo + n):
// NaN, never a stale result (C8).
__device__ void fill_failed(const DcpShape& s, int lo, int n, Pack* out, float* out_lse) {
  fill_nan(out + static_cast<size_t>(lo) * s.row_packs, static_cast<size_t>(n) * s.row_packs);
  if (out_lse != nullptr) {
    for (int i = threadIdx.x; i < n; i += kThreads) out_lse[lo + i] = __int_as_float(-1);
  }
}

// One merged pack from each source's pack `src[q]` and the row's weights
// (merge_weights): sources in rank order (C9); one whose weight is 0 is
// never read. Sources up to kRanks (>= the world), as merge_weights.
template <DType D, int kRanks = kMaxRanks>
__device__ __forceinline__ Pack merge_pack(const ChannelView& v, const Pack* src, const float* scale) {
  float acc[Elements<D>::kCount] = {};
#pragma unroll
  for (int q = 0; q < kRanks; ++q) {
    if (q < v.world && scale[q] != 0.0f) accumulate_scaled<D>(acc, src[q], scale[q]);
  }
  return round_pack<D>(acc);
}

// Merges the block's result rows [lo, lo + n) from every source's cell
// (`cells[q]`, laid out as `cell`, whose rows may be more than n: the
// barrier protocol's cells hold per_block rows also in a last, shorter
// block; this rank's own rows from its input where from_own_input), in
// chunks of kThreads rows: one thread per row turns the lse of every source
// into weights, then every thread merges packs. Cells are read through L2
// (.cg): L1 is not coherent with the peers' writes.
template <DType D>
__device__ void merge_block(const ChannelView& v, const DcpShape& s, int lo, int n, const DcpCell& cell,
                            char* const* cells, const Pack* __restrict__ in, const float* __restrict__ in_lse,
                            Pack* __restrict__ out, float* __restrict__ out_lse) {
  const int row_packs = s.row_packs;
  const Pack* payload[kMaxRanks];
  const float* lse[kMaxRanks];
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) {
    payload[q] = q < v.world ? cell.payload(cells[q]) : nullptr;
    lse[q] = q < v.world ? cell.lse(cells[q]) : nullptr;
  }
  __shared__ float scales[kThreads][kMaxRanks];
  for (int c = 0; c < n; c += kThreads) {
    const int m = min(kThreads, n - c);
    if (threadIdx.x < m) {
      const int row = c + threadIdx.x;
      float row_lse[kMaxRanks];
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) {
        if (q < v.world) {
          row_lse[q] = from_own_input(v, q) ? in_lse[s.input_row(v.rank, lo + row)] : __ldcg(lse[q] + row);
        }
      }
      const float merged = merge_weights(row_lse, v.world, s.base2, scales[threadIdx.x]);
      if (out_lse != nullptr) out_lse[lo + row] = merged;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < m * row_packs; i += kThreads) {
      const int r = i / row_packs;
      const int k = i - r * row_packs;
      const int row = c + r;
      const size_t own = s.input_row(v.rank, lo + row) * row_packs + k;
      const size_t staged_at = static_cast<size_t>(row) * row_packs + k;
      // All loads first, then the sums in rank order (C9).
      Pack src[kMaxRanks];
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) {
        if (q < v.world && scales[r][q] != 0.0f) {
          src[q] = from_own_input(v, q) ? in[own] : CudaMem::load_staged(payload[q] + staged_at);
        }
      }
      out[static_cast<size_t>(lo + row) * row_packs + k] = merge_pack<D>(v, src, scales[r]);
    }
    __syncthreads();  // the next chunk overwrites scales
  }
}

// The barrier protocol: push, meet, merge. Block b owns result rows
// [b * per_block, (b + 1) * per_block) on every rank (same plan everywhere:
// the shape is static) and only its own staging cells, so blocks never wait
// on each other.
template <DType D>
__global__ void __launch_bounds__(kThreads, 1)
    dcp_a2a_kernel(ChannelView v, DcpShape s, DcpPlan plan, CallTag tag, Placement placement,
                   const Pack* __restrict__ in, const float* __restrict__ in_lse, Pack* __restrict__ out,
                   float* __restrict__ out_lse) {
  tag = placed_tag(tag, placement, v.rank);
  const int block = blockIdx.x;
  const int row_packs = s.row_packs;
  const int lo = block * plan.per_block;
  const int n = lo < s.rows() ? min(plan.per_block, s.rows() - lo) : 0;
  if (block_halted(v)) return fill_failed(s, lo, n, out, out_lse);  // a timed-out channel fails fast
  const uint32_t epoch = next_epoch<CudaMem>(v, block);
  const int slot = epoch & 1;
  const DcpCell cell{plan.per_block, row_packs};

  // 1. Push to every peer p the rows of p's heads into this rank's cell on
  //    p: remote stores are posted, so the merge below reads locally. A row
  //    whose lse is not finite sends no payload: nobody reads it.
  for (int p = 0; p < v.world; ++p) {
    if (!exchanges_with(v, p)) continue;
    char* base = v.staging[p] + v.layout.cell_offset(slot, v.rank, block);
    Pack* payload = cell.payload(base);
    float* lse = cell.lse(base);
    for (int i = threadIdx.x; i < n; i += kThreads) lse[i] = in_lse[s.input_row(p, lo + i)];
    for (int i = threadIdx.x; i < n * row_packs; i += kThreads) {
      const int row = i / row_packs;
      const size_t src = s.input_row(p, lo + row);
      if (lse_finite(in_lse[src])) payload[i] = in[src * row_packs + (i - row * row_packs)];
    }
  }

  // 2. Meet the peers (C6); on a timeout nothing staged may be read.
  if (!block_barrier(v, block, epoch, tag)) return fill_failed(s, lo, n, out, out_lse);

  // 3. Merge, from cells laid out for `per_block` rows (the pushes' `cell`).
  char* cells[kMaxRanks];
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q) cells[q] = q < v.world ? v.staging[v.rank] + v.layout.cell_offset(slot, q, block) : nullptr;
  merge_block<D>(v, s, lo, n, cell, cells, in, in_lse, out, out_lse);
}

// The Lamport exchange (lamport.cuh; docs/DESIGN.md, "DCP in the Lamport
// window"): each peer gets its own cell, the rows of its heads with their
// lse, polled by the owner word by word; no barrier, no flag. The merge
// needs every source's lse of a row before its payload, so it runs after the
// exchange, which only waits. kInRegisters (a block's cell is at most
// kThreads packs: thread t polls pack t of every source): each thread keeps
// the packs it polled, the lse packs' threads share theirs through shared
// memory before the exchange's last barrier, and this rank's own rows and
// lse are loaded before the exchange, so the merge waits for no load and
// no other barrier. Else it reads the cells of the buffer the exchange
// returned, which stay as they are until this block's next call
// (merge_block). Both merge the same bits in the same order. kRanks (>= the
// world, by_ranks) bounds the loops over sources of the exchange and of the
// merge from registers, so a small world's are shorter.
template <DType D, bool kInRegisters, int kRanks>
__global__ void __launch_bounds__(kThreads, 1)
    dcp_a2a_lamport_kernel(ChannelView v, DcpShape s, DcpPlan plan, CallTag tag, Placement placement,
                           const Pack* __restrict__ in, const float* __restrict__ in_lse, Pack* __restrict__ out,
                           float* __restrict__ out_lse) {
  tag = placed_tag(tag, placement, v.rank);
  const int lo = blockIdx.x * plan.per_block;
  const int n = min(plan.per_block, s.rows() - lo);  // >= 1: the plan's grid covers the rows exactly
  const DcpCell cell{n, s.row_packs};  // dcp_lamport_pack's layout
  const auto part = [&](int dest, size_t i) { return dcp_lamport_pack(s, in, in_lse, dest, lo, n, i); };
  // Each peer's pack is loaded where it is pushed (`load` loads nothing).
  const auto load = [](size_t) { return 0; };
  const auto push = [&](const LamportCall& c, size_t i, int) {
    for (int p = 0; p < v.world; ++p) {
      if (exchanges_with(v, p)) lamport_push_to<CudaMem>(v, c, p, i, part(p, i));
    }
  };
  const auto no_own = [](size_t) { return Pack{}; };
  // kInRegisters: thread t's pack of this rank's input and the lse of its
  // row (t below the payload's packs), loaded before the exchange.
  const int t = threadIdx.x;
  const int payload_packs = n * s.row_packs;
  const int row = t / s.row_packs;
  Pack own{};
  float own_lse = 0.0f;
  if (kInRegisters && t < payload_packs) {
    own = part(v.rank, t);
    own_lse = in_lse[s.input_row(v.rank, lo + row)];
  }
  // Each row's lse from every peer, stored by the lse packs' threads as they
  // arrive: the exchange's last barrier makes them visible to the block.
  static_assert(kRanks <= kMaxRanks);
  __shared__ float peer_lse[kInRegisters ? kThreads : 1][kRanks];
  Pack held[kRanks];
  const auto keep = [&](size_t, const Pack* staged) {
    if constexpr (kInRegisters) {  // called once, for pack t
#pragma unroll
      for (int q = 0; q < kRanks; ++q) held[q] = from_own_input(v, q) ? own : staged[q];
      if (t >= payload_packs) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int lse_row = (t - payload_packs) * 4 + k;
#pragma unroll
          for (int q = 0; q < kRanks; ++q) {
            if (lse_row < n && q < v.world && !from_own_input(v, q)) {
              peer_lse[lse_row][q] = bits_f32(staged[q].words[k]);
            }
          }
        }
      }
    }
  };
  const int buffer = lamport_exchange_with<kThreads, kRanks>(v, tag, cell.lamport_packs(), load, push, no_own, keep);
  if (buffer < 0) return fill_failed(s, lo, n, out, out_lse);
  if constexpr (kInRegisters) {
    // Every thread of a row turns the row's lse into the same weights (one
    // computation, the same bits): no barrier beyond the exchange's.
    if (t < payload_packs) {
      float row_lse[kRanks];
      float scale[kRanks];
#pragma unroll
      for (int q = 0; q < kRanks; ++q) {
        if (q < v.world) row_lse[q] = from_own_input(v, q) ? own_lse : peer_lse[row][q];
      }
      const float merged = merge_weights<kRanks>(row_lse, v.world, s.base2, scale);
      if (out_lse != nullptr && t == row * s.row_packs) out_lse[lo + row] = merged;
      out[static_cast<size_t>(lo) * s.row_packs + t] = merge_pack<D, kRanks>(v, held, scale);
    }
  } else {
    char* cells[kMaxRanks];
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      cells[q] = q < v.world ? v.lamport[v.rank] + v.lamport_layout.cell_offset(buffer, q, blockIdx.x) : nullptr;
    }
    merge_block<D>(v, s, lo, n, cell, cells, in, in_lse, out, out_lse);
  }
}

int want_grid(const DcpShape& s) {
  const size_t bytes = static_cast<size_t>(s.rows()) * s.row_bytes();
  return static_cast<int>((bytes + kBytesPerBlock - 1) / kBytesPerBlock);
}

ffi::Error DcpA2aCuda(cudaStream_t stream, int32_t ordinal, ffi::Token, ffi::AnyBuffer x, ffi::AnyBuffer lse,
                      std::optional<ffi::AnyBuffer> expected_device, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, ffi::RemainingRets rets,
                      std::string_view channel_id, std::string_view group, int32_t site, bool base2,
                      bool return_lse) {
  const RankLease handle = Registry::get().lease(Platform::kCuda, channel_id, group, ordinal);
  if (!handle) return ffi::Error::InvalidArgument(unprepared_message("dcp_a2a", channel_id, ordinal));
  // A timeout recorded by an earlier call (also one replayed from a CUDA
  // graph) surfaces here, without a sync: the record is in mapped host memory.
  const std::string earlier = pending_error(*handle.group, handle.rank);
  if (!earlier.empty()) return ffi::Error::Internal(earlier);
  const ChannelView& v = handle.view();
  DcpShape s{};
  const std::string problem = dcp_call_shape(x, lse, rets.size(), return_lse, v, base2, s);
  if (!problem.empty()) return ffi::Error::InvalidArgument(problem);
  const DcpPlan plan = plan_dcp_call(s, v, want_grid(s));
  if (plan.grid == 0) return ffi::Error::InvalidArgument(dcp_capacity_message(s, v.layout));
  std::optional<ffi::AnyBuffer> lse_out;  // only looked up where asked: a missing result costs an error string
  if (return_lse) {
    auto found = rets.get<ffi::AnyBuffer>(0);
    if (!found.has_value()) return found.error();
    lse_out.emplace(**found);
  }
  const ffi::AnyBuffer* merged_lse = lse_out ? &*lse_out : nullptr;
  const std::string results = dcp_results_problem(x, *y, merged_lse, s);
  if (!results.empty()) return ffi::Error::InvalidArgument(results);
  float* out_lse = merged_lse == nullptr ? nullptr : static_cast<float*>(merged_lse->untyped_data());
  const auto* in = static_cast<const Pack*>(x.untyped_data());
  const auto* in_lse = static_cast<const float*>(lse.untyped_data());
  auto* out = static_cast<Pack*>(y->untyped_data());
  if (handle.group->options().poison_outputs) {  // NaN everywhere: a row the kernel misses shows up
    cudaMemsetAsync(out, 0xFF, y->size_bytes(), stream);
    if (out_lse != nullptr) cudaMemsetAsync(out_lse, 0xFF, static_cast<size_t>(s.rows()) * sizeof(float), stream);
  }
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  // Every block's cell fits a pack a thread: the merge from registers.
  const bool in_registers = DcpCell{plan.per_block, s.row_packs}.lamport_packs() <= kThreads;
  const auto lamport_kernel = [&](auto ranks) {
    constexpr int kRanks = ranks.value;
    return bf16 ? (in_registers ? dcp_a2a_lamport_kernel<DType::kBF16, true, kRanks>
                                : dcp_a2a_lamport_kernel<DType::kBF16, false, kRanks>)
                : (in_registers ? dcp_a2a_lamport_kernel<DType::kF16, true, kRanks>
                                : dcp_a2a_lamport_kernel<DType::kF16, false, kRanks>);
  };
  const auto kernel = !plan.lamport ? (bf16 ? dcp_a2a_kernel<DType::kBF16> : dcp_a2a_kernel<DType::kF16>)
                                    : by_ranks(v.world, lamport_kernel);
  kernel<<<plan.grid, kThreads, 0, stream>>>(v, s, plan, plan.tag(s, bf16 ? DType::kBF16 : DType::kF16, site),
                                            placement_of(expected_device, Platform::kCuda, ordinal), in, in_lse, out,
                                            out_lse);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("b12x_jax.dcp_a2a: kernel launch failed: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace b12x

// Command-buffer compatible (C5): the handler only launches on its stream
// and the kernel reads and advances the epoch in device memory, so a CUDA
// graph replay is a correct call.
XLA_FFI_DEFINE_HANDLER_SYMBOL(b12x_dcp_a2a_cuda, b12x::DcpA2aCuda,
                              b12x::dcp_a2a_signature(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
