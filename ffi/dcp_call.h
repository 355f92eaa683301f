// The checks of a dcp_a2a call against its prepared channel, shared by the
// CPU and CUDA handlers. Python checks the same at trace time with fixes in
// its messages; these keep a bad call from touching channel memory.
#pragma once

#include <string>

#include "dcp.h"
#include "xla/ffi/api/ffi.h"

namespace b12x {

// Fills `shape` from the buffers and returns an empty string, or what is
// wrong, prefixed with the op's name.
inline std::string dcp_call_shape(const xla::ffi::AnyBuffer& out, const xla::ffi::AnyBuffer& lse,
                                  size_t extra_rets, bool return_lse, const ChannelView& v, bool base2,
                                  DcpShape& shape) {
  namespace ffi = xla::ffi;
  const std::string op = "b12x_jax.dcp_a2a: ";
  const auto dims = out.dimensions();
  const auto lse_dims = lse.dimensions();
  if (out.element_type() != ffi::DataType::BF16 && out.element_type() != ffi::DataType::F16) {
    return op + "out must be bfloat16 or float16";
  }
  if (dims.size() != 3 || lse_dims.size() != 2 || lse_dims[0] != dims[0] || lse_dims[1] != dims[1] ||
      lse.element_type() != ffi::DataType::F32) {
    return op + "out must be [B, H, D] and lse float32 [B, H]";
  }
  if (dims[0] <= 0 || dims[1] <= 0 || dims[2] <= 0) {  // the kernels divide by a row's packs
    return op + "out [B, H, D] must have B, H and D above 0";
  }
  if (dims[1] % v.world != 0) {
    return op + "H=" + std::to_string(dims[1]) + " is not a multiple of the " + std::to_string(v.world) + " ranks";
  }
  const size_t row_bytes = dims[2] * ffi::ByteWidth(out.element_type());
  if (row_bytes % kPackBytes != 0) {
    return op + "a row of out is " + std::to_string(row_bytes) + " bytes, not a multiple of 16";
  }
  if (!dcp_tag_carries(dims[1], row_bytes / kPackBytes)) {
    return op + "out [B, H, D] has H=" + std::to_string(dims[1]) + " or rows of " + std::to_string(row_bytes) +
           " bytes; the call tag carries at most " + std::to_string(kDcpMaxTagHeads) + " heads of at most " +
           std::to_string(kDcpMaxTagRowPacks * kPackBytes) + " bytes: split H or D over calls";
  }
  if (extra_rets != (return_lse ? 1u : 0u)) {
    return op + "expected " + std::string(return_lse ? "two results (out, lse)" : "one result (out)");
  }
  shape = DcpShape{static_cast<int>(dims[0]), static_cast<int>(dims[1]), v.world,
                   static_cast<int>(row_bytes / kPackBytes), base2};
  return {};
}

// What is wrong with a call's results (empty: nothing): the merged out is
// [B, H/N, D] in out's dtype, the merged lse (where asked) float32 [B, H/N].
// A call built by hand could hand smaller ones, and a merge would write past them.
inline std::string dcp_results_problem(const xla::ffi::AnyBuffer& out, const xla::ffi::AnyBuffer& y,
                                       const xla::ffi::AnyBuffer* merged_lse, const DcpShape& s) {
  const size_t rows = static_cast<size_t>(s.rows());
  if (y.element_type() != out.element_type() || y.size_bytes() != rows * s.row_bytes()) {
    return "b12x_jax.dcp_a2a: the merged out must be [B, H/N, D] in out's dtype";
  }
  if (merged_lse != nullptr &&
      (merged_lse->element_type() != xla::ffi::DataType::F32 || merged_lse->element_count() != rows)) {
    return "b12x_jax.dcp_a2a: the merged lse must be float32 [B, H/N]";
  }
  return {};
}

inline std::string dcp_capacity_message(const DcpShape& s, const StagingLayout& layout) {
  return "b12x_jax.dcp_a2a: " + std::to_string(s.rows()) + " rows of " +
         std::to_string(DcpCell::bytes_per_row(s.row_packs)) + " bytes per source do not fit the channel's " +
         std::to_string(layout.max_blocks) + " staging cells of " + std::to_string(layout.block_bytes) +
         " bytes; raise Communicator(capacity_bytes=...)";
}

}  // namespace b12x
