// One-shot all-reduce on the host backend, and all_reduce_residual_rmsnorm
// (the same exchange, then rmsnorm.h): the protocol of protocol.h with one
// block, driven by the progress thread (progress.h).
#include <cstring>
#include <string_view>

#include "../numeric.h"
#include "../registry.h"
#include "../rmsnorm.h"
#include "progress.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace b12x {
namespace {

// out = the sum of every rank's packs (+ `residual` where given), one rounding.
template <DType D>
void reduce_sources(const ChannelView& v, int slot, const Pack* own, Pack* out, size_t packs,
                    const Pack* residual = nullptr) {
  const Pack* sources[kMaxRanks];
  for (int q = 0; q < v.world; ++q) {
    sources[q] = q == v.rank ? own
                             : reinterpret_cast<const Pack*>(v.staging[v.rank] + v.layout.cell_offset(slot, q, 0));
  }
  for (size_t i = 0; i < packs; ++i) {
    Pack staged[kMaxRanks];
    for (int q = 0; q < v.world; ++q) staged[q] = sources[q][i];
    out[i] = sum_in_rank_order<D>(staged, v.world, residual != nullptr ? residual + i : nullptr);
  }
}

using Reducer = void (*)(const ChannelView&, int, const Pack*, Pack*, size_t, const Pack*);

Reducer reducer_for(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return reduce_sources<DType::kF32>;
    case ffi::DataType::BF16: return reduce_sources<DType::kBF16>;
    case ffi::DataType::F16: return reduce_sources<DType::kF16>;
    default: return nullptr;
  }
}

// RMSNorm of every row of residual_out into normed (rmsnorm.h).
template <DType D>
void normalize_rows(const RowsShape& s, float eps, const Pack* residual_out, const Pack* weight, Pack* normed) {
  for (int r = 0; r < s.rows; ++r) {
    const Pack* row = residual_out + static_cast<size_t>(r) * s.row_packs;
    float squares = 0.0f;
    for (int k = 0; k < s.row_packs; ++k) squares += sum_of_squares<D>(row[k]);
    const float scale = rms_scale(squares, s.hidden, eps);
    for (int k = 0; k < s.row_packs; ++k) normed[r * s.row_packs + k] = normalize_pack<D>(row[k], weight[k], scale);
  }
}

using Normalizer = void (*)(const RowsShape&, float, const Pack*, const Pack*, Pack*);

Normalizer normalizer_for(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return normalize_rows<DType::kF32>;
    case ffi::DataType::BF16: return normalize_rows<DType::kBF16>;
    case ffi::DataType::F16: return normalize_rows<DType::kF16>;
    default: return nullptr;
  }
}

// Pushes this rank's payload into its staging cell on every peer.
void push_to_peers(const ChannelView& v, uint32_t epoch, const Pack* in, size_t bytes) {
  for (int p = 0; p < v.world; ++p) {
    if (p != v.rank) std::memcpy(v.staging[p] + v.layout.cell_offset(epoch & 1, v.rank, 0), in, bytes);
  }
}

// `algorithm` selects the CUDA kernel; the host backend reduces in one shot
// whatever it is, with the same bits (every element summed in rank order).
ffi::Future AllReduceHost(int32_t ordinal, ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                          ffi::Result<ffi::AnyBuffer> y,
                          std::string_view channel_id, int32_t /*algorithm*/) {
  ffi::Promise promise;
  ffi::Future future(promise);
  const RankLease handle = Registry::get().lease(Platform::kHost, channel_id, ordinal);
  const size_t bytes = x.size_bytes();
  const Reducer reduce = reducer_for(x.element_type());
  if (!handle) {
    promise.SetError(ffi::Error::InvalidArgument(unprepared_message("all_reduce", channel_id, ordinal)));
  } else if (bytes % kPackBytes != 0 || bytes > handle.view().layout.capacity()) {
    promise.SetError(ffi::Error::InvalidArgument(
        "b12x_jax.all_reduce: payload of " + std::to_string(bytes) + " bytes is outside the channel's window "
        "(a multiple of 16 up to " + std::to_string(handle.view().layout.capacity()) + ")"));
  } else if (reduce == nullptr) {
    promise.SetError(ffi::Error::InvalidArgument("b12x_jax.all_reduce: dtype must be float32, bfloat16 or float16"));
  } else {
    const auto* in = static_cast<const Pack*>(x.untyped_data());
    auto* out = static_cast<Pack*>(y->untyped_data());
    if (handle.group->options().poison_outputs) std::memset(out, 0xFF, bytes);  // NaN everywhere
    HostCall call;
    call.handle = handle;
    call.stage = [in, bytes](const ChannelView& v, uint32_t epoch) { push_to_peers(v, epoch, in, bytes); };
    call.finish = [in, out, bytes, reduce](const ChannelView& v, uint32_t epoch) {
      reduce(v, epoch & 1, in, out, bytes / kPackBytes, nullptr);
    };
    call.promise = promise;
    submit_host_call(std::move(call));
  }
  return future;
}

ffi::Future ResidualRmsnormHost(int32_t ordinal, ffi::Token, ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                                ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> normed,
                                ffi::Result<ffi::AnyBuffer> residual_out,
                                std::string_view channel_id, float eps) {
  ffi::Promise promise;
  ffi::Future future(promise);
  const RankLease handle = Registry::get().lease(Platform::kHost, channel_id, ordinal);
  const size_t bytes = x.size_bytes();
  const Reducer reduce = reducer_for(x.element_type());
  const Normalizer normalize = normalizer_for(x.element_type());
  RowsShape s{};
  const std::string problem = rows_call_shape(x, residual, weight, s);
  if (!handle) {
    promise.SetError(
        ffi::Error::InvalidArgument(unprepared_message("all_reduce_residual_rmsnorm", channel_id, ordinal)));
  } else if (!problem.empty() || reduce == nullptr) {
    promise.SetError(ffi::Error::InvalidArgument(
        problem.empty() ? "b12x_jax.all_reduce_residual_rmsnorm: dtype must be float32, bfloat16 or float16" : problem));
  } else if (bytes > handle.view().layout.capacity()) {
    promise.SetError(ffi::Error::InvalidArgument(
        "b12x_jax.all_reduce_residual_rmsnorm: payload of " + std::to_string(bytes) +
        " bytes exceeds the channel's capacity of " + std::to_string(handle.view().layout.capacity())));
  } else {
    const auto* in = static_cast<const Pack*>(x.untyped_data());
    const auto* res = static_cast<const Pack*>(residual.untyped_data());
    const auto* w = static_cast<const Pack*>(weight.untyped_data());
    auto* out = static_cast<Pack*>(normed->untyped_data());
    auto* res_out = static_cast<Pack*>(residual_out->untyped_data());
    if (handle.group->options().poison_outputs) {  // NaN everywhere
      std::memset(out, 0xFF, bytes);
      std::memset(res_out, 0xFF, bytes);
    }
    HostCall call;
    call.handle = handle;
    call.stage = [in, bytes](const ChannelView& v, uint32_t epoch) { push_to_peers(v, epoch, in, bytes); };
    call.finish = [=](const ChannelView& v, uint32_t epoch) {
      reduce(v, epoch & 1, in, res_out, bytes / kPackBytes, res);
      normalize(s, eps, res_out, w, out);
    };
    call.promise = promise;
    submit_host_call(std::move(call));
  }
  return future;
}

}  // namespace
}  // namespace b12x

XLA_FFI_DEFINE_HANDLER_SYMBOL(b12x_all_reduce_host, b12x::AllReduceHost,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::Token>()  // the channel's order (DESIGN C15)
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Token>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<std::string_view>("channel_id")
                                  .Attr<int32_t>("algorithm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(b12x_residual_rmsnorm_host, b12x::ResidualRmsnormHost,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::Token>()  // the channel's order (DESIGN C15)
                                  .Arg<xla::ffi::AnyBuffer>()  // x [..., hidden], this rank's partial sum
                                  .Arg<xla::ffi::AnyBuffer>()  // residual, like x
                                  .Arg<xla::ffi::AnyBuffer>()  // weight [hidden]
                                  .Ret<xla::ffi::Token>()
                                  .Ret<xla::ffi::AnyBuffer>()  // normed, like x
                                  .Ret<xla::ffi::AnyBuffer>()  // residual_out, like x
                                  .Attr<std::string_view>("channel_id")
                                  .Attr<float>("eps"));
