// all_reduce_residual_rmsnorm: the shape checks and the math after the sum,
// shared by the CPU and CUDA handlers.
//
// For rows of `hidden` elements, with the sum over ranks s (fp32, rank order):
//   residual_out = round(s + residual)                  (one rounding)
//   normed       = round(r * rsqrt(mean(r^2) + eps) * weight), r = residual_out
// The norm reads the rounded residual, the values the next layer adds to, so
// it is what all_reduce, a jnp add and a jnp RMSNorm on its result compute.
#pragma once

#include <cmath>
#include <string>

#include "all_reduce.h"
#include "channel.h"
#include "numeric.h"
#include "xla/ffi/api/ffi.h"

namespace b12x {

struct RowsShape {
  int rows;
  int row_packs;  // packs per row
  int hidden;     // elements per row
};

// Fills `shape` from the buffers and returns an empty string, or what is
// wrong, prefixed with the op's name. Python checks the same at trace time
// with fixes in its messages; this keeps a bad call from touching memory.
inline std::string rows_call_shape(const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& residual,
                                   const xla::ffi::AnyBuffer& weight, RowsShape& shape) {
  const std::string op = "b12x_jax.all_reduce_residual_rmsnorm: ";
  if (residual.element_type() != x.element_type() || weight.element_type() != x.element_type()) {
    return op + "x, residual and weight must have one dtype";
  }
  const size_t hidden = weight.element_count();
  const size_t row_bytes = hidden * xla::ffi::ByteWidth(x.element_type());
  const auto x_dims = x.dimensions();
  if (hidden == 0 || x.element_count() == 0 || x_dims.size() == 0 || static_cast<size_t>(x_dims.back()) != hidden ||
      residual.element_count() != x.element_count()) {
    return op + "x and residual must be [..., hidden] with weight [hidden], at least one row";
  }
  if (row_bytes % kPackBytes != 0) return op + "a row of x is not a multiple of 16 bytes";
  shape = RowsShape{static_cast<int>(x.element_count() / hidden), static_cast<int>(row_bytes / kPackBytes),
                    static_cast<int>(hidden)};
  return {};
}

// How a call spreads its rows over the channel's Lamport cells: block b owns
// rows [b * rows_per_block, ...), one contiguous range of packs, exchanged
// as one Lamport call of the block (lamport.h). Depends only on the shape
// and the layout, so every rank plans the same. grid 0: the rows do not fit.
struct RowsPlan {
  int rows_per_block;
  int grid;

  // The call's tag (channel.h): its algorithm word carries the row's packs
  // too, so calls of one size but other rows never pass for each other.
  B12X_HD CallTag tag(const RowsShape& s, DType dtype, uint32_t site) const {
    const uint32_t algorithm = static_cast<uint32_t>(Algorithm::kLamport) | static_cast<uint32_t>(s.row_packs) << 2;
    return make_tag(Op::kResidualRmsnorm, static_cast<uint32_t>(dtype), grid, algorithm,
                    static_cast<size_t>(s.rows) * s.row_packs, site);
  }
};

inline RowsPlan plan_rows(const RowsShape& s, const StagingLayout& cells) {
  const int rows_per_block = (s.rows + cells.max_blocks - 1) / cells.max_blocks;
  if (static_cast<size_t>(rows_per_block) * s.row_packs * kPackBytes > cells.block_bytes) return {rows_per_block, 0};
  return {rows_per_block, (s.rows + rows_per_block - 1) / rows_per_block};
}

inline std::string rows_capacity_message(const RowsShape& s, const StagingLayout& cells) {
  return "b12x_jax.all_reduce_residual_rmsnorm: " + std::to_string(s.rows) + " rows of " +
         std::to_string(s.row_packs * kPackBytes) + " bytes do not fit the channel's " +
         std::to_string(cells.max_blocks) + " Lamport cells of " + std::to_string(cells.block_bytes) +
         " bytes; raise Communicator(lamport_bytes=...)";
}

// 1 / RMS of a row from its sum of squares.
B12X_HD float rms_scale(float sum_of_squares, int hidden, float eps) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(sum_of_squares / hidden + eps);
#else
  return 1.0f / std::sqrt(sum_of_squares / hidden + eps);
#endif
}

template <DType D>
B12X_HD float sum_of_squares(const Pack& p) {
  float s = 0.0f;
  for (int e = 0; e < Elements<D>::kCount; ++e) {
    const float x = Elements<D>::get(p, e);
    s += x * x;
  }
  return s;
}

// One pack of normed output from the pack of residual_out and of weight.
template <DType D>
B12X_HD Pack normalize_pack(const Pack& r, const Pack& w, float scale) {
  float out[Elements<D>::kCount];
  for (int e = 0; e < Elements<D>::kCount; ++e) out[e] = Elements<D>::get(r, e) * scale * Elements<D>::get(w, e);
  return round_pack<D>(out);
}

}  // namespace b12x
