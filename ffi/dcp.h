// The DCP merge, shared by the CPU and CUDA backends: which rows
// a rank sends where, how they sit in a staging cell, and the merge math.
//
// Rank r holds out [B, H, D] and lse [B, H] over its KV shard, for all heads;
// destination p owns heads [p*H/N, (p+1)*H/N). Row i = b*(H/N) + j of p's
// result is head p*H/N + j of batch b. Every rank sends p the rows of p's
// heads, p merges the N versions of each row.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "all_reduce.h"
#include "channel.h"
#include "numeric.h"

namespace b12x {

// The static shape of one call, equal on every rank.
struct DcpShape {
  int batch;
  int heads;      // H: all heads, as held by every source
  int world;      // N
  int row_packs;  // D * itemsize / 16: one row of out in 16-byte packs
  bool base2;     // lse is log2-sum-exp2 instead of ln-sum-exp

  B12X_HD int shard_heads() const { return heads / world; }
  // Rows of each rank's result, [B, H/N] flattened.
  B12X_HD int rows() const { return batch * shard_heads(); }
  B12X_HD size_t row_bytes() const { return static_cast<size_t>(row_packs) * kPackBytes; }
  // Row of the [B*H] input that holds row `row` of destination `dest`.
  B12X_HD size_t input_row(int dest, int row) const {
    const int hn = shard_heads();
    return static_cast<size_t>(row / hn) * heads + static_cast<size_t>(dest) * hn + row % hn;
  }
};

// One staging cell of the DCP exchange, for a block that owns `rows` rows:
// the rows' payloads, then their lse. The payload comes first so every pack
// stays 16-byte aligned (cells are, and a row is a whole number of packs).
struct DcpCell {
  int rows;
  int row_packs;

  B12X_HD static size_t bytes_per_row(int row_packs) { return row_packs * kPackBytes + sizeof(float); }
  B12X_HD size_t bytes() const { return rows * bytes_per_row(row_packs); }
  // A Lamport cell (lamport.h) in packs: the payloads, then the lse padded
  // with 0 to a whole pack (every word a reader polls is written).
  B12X_HD size_t lamport_packs() const { return static_cast<size_t>(rows) * row_packs + (rows + 3) / 4; }
  B12X_HD Pack* payload(char* cell) const { return reinterpret_cast<Pack*>(cell); }
  B12X_HD float* lse(char* cell) const {
    return reinterpret_cast<float*>(cell + static_cast<size_t>(rows) * row_packs * kPackBytes);
  }
  B12X_HD const Pack* payload(const char* cell) const { return reinterpret_cast<const Pack*>(cell); }
  B12X_HD const float* lse(const char* cell) const {
    return reinterpret_cast<const float*>(cell + static_cast<size_t>(rows) * row_packs * kPackBytes);
  }
};

// The algorithm word of a dcp_a2a tag: the protocol in bits 0-1 (0: the
// barrier, Algorithm::kLamport), H in bits 2-16, D's packs in bits 17-30
// (never the Lamport empty word 0xFFFFFFFF). Calls beyond these limits are
// refused (dcp_call_shape; the Python layer takes all_to_all): masked, their
// tags would alias other shapes'.
inline constexpr int kDcpMaxTagHeads = 0x7FFF;
inline constexpr int kDcpMaxTagRowPacks = 0x3FFF;
B12X_HD uint32_t dcp_tag_algorithm(bool lamport, int heads, int row_packs) {
  const uint32_t protocol = lamport ? static_cast<uint32_t>(Algorithm::kLamport) : 0u;
  return protocol | static_cast<uint32_t>(heads) << 2 | static_cast<uint32_t>(row_packs) << 17;
}
// Whether a call of H = `heads` and rows of `row_packs` packs has a tag of its own.
inline bool dcp_tag_carries(int64_t heads, size_t row_packs) {
  return heads <= kDcpMaxTagHeads && row_packs <= static_cast<size_t>(kDcpMaxTagRowPacks);
}
B12X_HD bool dcp_tag_lamport(uint32_t algorithm) { return (algorithm & 3u) == static_cast<uint32_t>(Algorithm::kLamport); }
B12X_HD int dcp_tag_heads(uint32_t algorithm) { return static_cast<int>((algorithm >> 2) & kDcpMaxTagHeads); }
B12X_HD int dcp_tag_row_packs(uint32_t algorithm) { return static_cast<int>((algorithm >> 17) & kDcpMaxTagRowPacks); }

// The flag of a dcp_a2a tag whose lse are in base 2 (merged with exp2).
inline constexpr uint32_t kDcpTagBase2 = 1;

// How a call spreads its rows over blocks: block b owns rows
// [b * per_block, min((b + 1) * per_block, rows)) on every rank, and stages
// them in its own cell (channel.h: the reuse argument holds block by block).
struct DcpPlan {
  int grid;       // 0: the rows do not fit the channel's staging
  int per_block;
  bool lamport;   // the Lamport exchange (lamport.h) on the Lamport cells, else the barrier protocol

  // The call's tag (channel.h): the input [B, H, D] in packs; the algorithm
  // word also carries H and D's packs (dcp_tag_algorithm), so calls of one
  // size and grid but other rows never pass for each other.
  B12X_HD CallTag tag(const DcpShape& s, DType dtype, uint32_t site) const {
    const size_t packs = static_cast<size_t>(s.batch) * s.heads * s.row_packs;
    return make_tag(Op::kDcpA2a, static_cast<uint32_t>(dtype), grid, dcp_tag_algorithm(lamport, s.heads, s.row_packs),
                    packs, site, s.base2 ? kDcpTagBase2 : 0u);
  }
};

// The plan with `want_grid` blocks, clamped to the rows and to the
// channel's blocks, or more where a cell would overflow. Depends only on the
// shape and the layout, so every rank gets the same grid (C6).
B12X_HD DcpPlan plan_dcp(const DcpShape& s, const StagingLayout& layout, int want_grid) {
  const size_t rows = static_cast<size_t>(s.rows());
  const size_t fit = layout.block_bytes / DcpCell::bytes_per_row(s.row_packs);  // rows per cell
  if (fit == 0) return {0, 0, false};
  const size_t need = (rows + fit - 1) / fit;
  size_t grid = want_grid > 0 ? static_cast<size_t>(want_grid) : 1;
  if (grid > rows) grid = rows;
  if (grid > static_cast<size_t>(layout.max_blocks)) grid = layout.max_blocks;
  if (grid < need) grid = need;
  if (grid < 1) grid = 1;
  if (grid > static_cast<size_t>(layout.max_blocks)) return {0, 0, false};
  const int g = static_cast<int>(grid);
  return {g, static_cast<int>((rows + grid - 1) / grid), false};  // <= fit, since grid >= rows / fit
}

// The Lamport plan of a call (docs/DESIGN.md, "DCP in the Lamport window"),
// or grid 0 where its rows do not fit the Lamport cells. A block owns whole
// batch rows (all H/N heads of ceil(B / blocks) of them) where B exceeds
// the blocks, else the heads of one batch row halved while a block takes
// more than the all-reduce's kLamportBytesPerBlock (more blocks poll more of
// the peers' data at once; or overflows its cell) and the grid
// stays within the blocks: so with B <= blocks a block's rows are always a
// contiguous run of one batch row's heads, which the Triton kernel tiles.
// Depends only on the shape and the layout, so every rank plans the same.
B12X_HD DcpPlan plan_dcp_lamport(const DcpShape& s, const StagingLayout& cells) {
  if (cells.block_bytes == 0 || s.rows() == 0) return {0, 0, true};
  const auto fits = [&](int rows) { return DcpCell{rows, s.row_packs}.lamport_packs() * kPackBytes <= cells.block_bytes; };
  const int heads = s.shard_heads();
  int per_block = heads * ((s.batch + cells.max_blocks - 1) / cells.max_blocks);
  if (s.batch <= cells.max_blocks) {
    while (per_block % 2 == 0 && s.rows() / (per_block / 2) <= cells.max_blocks &&
           (!fits(per_block) || static_cast<size_t>(per_block) * s.row_bytes() > kLamportBytesPerBlock)) {
      per_block /= 2;
    }
  }
  if (!fits(per_block)) return {0, 0, true};
  return {(s.rows() + per_block - 1) / per_block, per_block, true};
}

// The plan a call takes: the Lamport exchange where its rows fit the Lamport
// cells, else the barrier protocol with `want_grid` blocks (plan_dcp).
B12X_HD DcpPlan plan_dcp_call(const DcpShape& s, const ChannelView& v, int want_grid) {
  const DcpPlan lamport = plan_dcp_lamport(s, v.lamport_layout);
  return lamport.grid > 0 ? lamport : plan_dcp(s, v.layout, want_grid);
}

// Pack i of the Lamport cell a source sends `dest` for its result rows
// [lo, lo + rows): the rows' payloads, then their lse, 0 after the last.
B12X_HD Pack dcp_lamport_pack(const DcpShape& s, const Pack* in, const float* in_lse, int dest, int lo, int rows,
                              size_t i) {
  const size_t payload = static_cast<size_t>(rows) * s.row_packs;
  if (i < payload) {
    const size_t row = i / s.row_packs;
    return in[s.input_row(dest, lo + static_cast<int>(row)) * s.row_packs + (i - row * s.row_packs)];
  }
  Pack lse{};
  B12X_UNROLL
  for (int k = 0; k < 4; ++k) {
    const int row = static_cast<int>(i - payload) * 4 + k;
    lse.words[k] = row < rows ? f32_bits(in_lse[s.input_row(dest, lo + row)]) : 0u;
  }
  return lse;
}

// A source contributes only if its lse is finite: -inf marks an empty KV
// shard or a padded row, and NaN or +inf are treated the same way, so a
// payload of such a row is never read (it may hold anything, NaN included).
B12X_HD bool lse_finite(float lse) { return (f32_bits(lse) & 0x7f800000u) != 0x7f800000u; }

B12X_HD float lse_exp(float x, bool base2) {
#if defined(__CUDA_ARCH__)
  return base2 ? exp2f(x) : expf(x);
#else
  return base2 ? std::exp2(x) : std::exp(x);
#endif
}

B12X_HD float lse_log(float x, bool base2) {
#if defined(__CUDA_ARCH__)
  return base2 ? log2f(x) : logf(x);
#else
  return base2 ? std::log2(x) : std::log(x);
#endif
}

B12X_HD float negative_infinity() { return bits_f32(0xff800000u); }

// The weights of one row: scale[q] = w_q / sum_s w_s with w_q =
// exp(lse_q - max lse), 0 where source q does not contribute (its payload
// must then not be read). Returns the merged lse, m + log(sum w); -inf and
// every scale 0 when no source contributes. Sources in rank order (C9).
// The loops run to kRanks (>= world), unrolled, so a kernel's lse and scale
// arrays stay in registers; a kernel for small worlds passes a smaller
// kRanks, for a shorter merge (docs/DESIGN.md, "DCP in the Lamport window").
template <int kRanks = kMaxRanks>
B12X_HD float merge_weights(const float* lse, int world, bool base2, float* scale) {
  float m = negative_infinity();
  B12X_UNROLL
  for (int q = 0; q < kRanks; ++q) {
    if (q < world && lse_finite(lse[q]) && lse[q] > m) m = lse[q];
  }
  float sum = 0.0f;
  B12X_UNROLL
  for (int q = 0; q < kRanks; ++q) {
    if (q >= world) continue;
    scale[q] = lse_finite(lse[q]) ? lse_exp(lse[q] - m, base2) : 0.0f;
    sum += scale[q];
  }
  if (sum == 0.0f) return negative_infinity();  // every source empty: output 0
  B12X_UNROLL
  for (int q = 0; q < kRanks; ++q) {
    if (q < world) scale[q] /= sum;
  }
  return m + lse_log(sum, base2);
}

// acc[i] += scale * element i of `src`, in fp32.
template <DType D>
B12X_HD void accumulate_scaled(float* acc, const Pack& src, float scale) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < Elements<D>::kCount; ++i) acc[i] += scale * Elements<D>::get(src, i);
}

}  // namespace b12x
