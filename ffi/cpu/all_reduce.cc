// all_reduce and all_reduce_residual_rmsnorm on the host backend: the
// protocol plan_for (all_reduce.h) picks, the same as on CUDA, with one
// block, driven by the progress thread (progress.h): the Lamport exchange
// (lamport.h) within the channel's Lamport window, else the barrier
// algorithm the `algorithm` attribute asks for (all_reduce.h); the fused op
// on the Lamport exchange, then rmsnorm.h. Sums are sum_in_rank_order, so
// the bits are CUDA's.
#include <cstring>
#include <memory>
#include <optional>
#include <string_view>

#include "../all_reduce.h"
#include "../numeric.h"
#include "../registry.h"
#include "../rmsnorm.h"
#include "../signatures.h"
#include "host_calls.h"
#include "progress.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace b12x {
namespace {

// One-shot (push or pull) or two-shot, by the steps of all_reduce.h.
template <DType D>
class BarrierAllReduce final : public BarrierCall {
 public:
  BarrierAllReduce(RankHandle handle, ffi::Promise promise, const Plan& plan, uint32_t site, const Pack* in, Pack* out)
      : BarrierCall(handle, std::move(promise), plan.tag(D, site), plan.algorithm == Algorithm::kTwoShot ? 2 : 1),
        plan_(plan), in_(in), out_(out) {}

 private:
  void stage(const ChannelView& v, uint32_t epoch, int phase) override {
    const AllReduceBlock b{v, plan_, 0, epoch, in_, out_};
    switch (plan_.algorithm) {
      case Algorithm::kOneShot: return one_shot_stage<false>(b, AllPacks{});
      case Algorithm::kPull: return one_shot_stage<true>(b, AllPacks{});
      case Algorithm::kTwoShot:
        return phase == 0 ? two_shot_scatter(b, AllPacks{}) : two_shot_reduce<HostMem, D>(b, AllPacks{});
      case Algorithm::kLamport: return;  // LamportAllReduce
    }
  }

  void done(const ChannelView& v, uint32_t epoch) override {
    const AllReduceBlock b{v, plan_, 0, epoch, in_, out_};
    switch (plan_.algorithm) {
      case Algorithm::kOneShot: return one_shot_reduce<HostMem, D, false>(b, AllPacks{});
      case Algorithm::kPull: return one_shot_reduce<HostMem, D, true>(b, AllPacks{});
      case Algorithm::kTwoShot: return two_shot_gather<HostMem>(b, AllPacks{});
      case Algorithm::kLamport: return;
    }
  }

  Plan plan_;
  const Pack* in_;
  Pack* out_;
};

template <DType D>
class LamportAllReduce final : public LamportSumCall {
 public:
  LamportAllReduce(RankHandle handle, ffi::Promise promise, const Plan& plan, uint32_t site, const Pack* in, Pack* out)
      : LamportSumCall(handle, std::move(promise), plan.tag(D, site), in, plan.packs), out_(out) {}

 private:
  void reduce(const ChannelView& v, size_t i, const Pack* staged) override {
    out_[i] = sum_in_rank_order<D>(staged, v.world);
  }

  Pack* out_;
};

// The Lamport exchange of the rows with the residual added in the same sum
// (one rounding), then RMSNorm of every row of residual_out (rmsnorm.h).
template <DType D>
class ResidualRmsnormCall final : public LamportSumCall {
 public:
  ResidualRmsnormCall(RankHandle handle, ffi::Promise promise, const RowsShape& s, const RowsPlan& plan, uint32_t site,
                      float eps, const Pack* in, const Pack* residual, const Pack* weight, Pack* normed,
                      Pack* residual_out)
      : LamportSumCall(handle, std::move(promise), plan.tag(s, D, site), in, static_cast<size_t>(s.rows) * s.row_packs),
        s_(s), eps_(eps), residual_(residual), weight_(weight), normed_(normed), residual_out_(residual_out) {}

  void finish(const ChannelView& v) override {
    LamportSumCall::finish(v);
    for (int r = 0; r < s_.rows; ++r) {
      const Pack* row = residual_out_ + static_cast<size_t>(r) * s_.row_packs;
      float squares = 0.0f;
      for (int k = 0; k < s_.row_packs; ++k) squares += sum_of_squares<D>(row[k]);
      const float scale = rms_scale(squares, s_.hidden, eps_);
      Pack* out = normed_ + static_cast<size_t>(r) * s_.row_packs;
      for (int k = 0; k < s_.row_packs; ++k) out[k] = normalize_pack<D>(row[k], weight_[k], scale);
    }
  }

 private:
  void reduce(const ChannelView& v, size_t i, const Pack* staged) override {
    residual_out_[i] = sum_in_rank_order<D>(staged, v.world, residual_ + i);
  }

  RowsShape s_;
  float eps_;
  const Pack* residual_;
  const Pack* weight_;
  Pack* normed_;
  Pack* residual_out_;
};

// A call of `Call<D>` for the buffers' dtype; null for an unsupported one.
template <template <DType> class Call, class... Args>
std::unique_ptr<HostCall> make_call(ffi::DataType type, Args&&... args) {
  switch (type) {
    case ffi::DataType::F32: return std::make_unique<Call<DType::kF32>>(std::forward<Args>(args)...);
    case ffi::DataType::BF16: return std::make_unique<Call<DType::kBF16>>(std::forward<Args>(args)...);
    case ffi::DataType::F16: return std::make_unique<Call<DType::kF16>>(std::forward<Args>(args)...);
    default: return nullptr;
  }
}

bool supported(ffi::DataType type) {
  return type == ffi::DataType::F32 || type == ffi::DataType::BF16 || type == ffi::DataType::F16;
}

ffi::Future AllReduceHost(int32_t ordinal, ffi::Token, ffi::AnyBuffer x, std::optional<ffi::AnyBuffer> expected_device,
                          ffi::Result<ffi::Token>,
                          ffi::Result<ffi::AnyBuffer> y,
                          std::string_view channel_id, std::string_view group, int32_t site, int32_t algorithm) {
  ffi::Promise promise;
  ffi::Future future(promise);
  const RankLease handle = Registry::get().lease(Platform::kHost, channel_id, group, ordinal);
  const size_t bytes = x.size_bytes();
  if (!handle) {
    promise.SetError(ffi::Error::InvalidArgument(unprepared_message("all_reduce", channel_id, ordinal)));
  } else if (bytes % kPackBytes != 0 || bytes > handle.view().capacity_bytes) {
    promise.SetError(ffi::Error::InvalidArgument(
        "b12x_jax.all_reduce: payload of " + std::to_string(bytes) + " bytes is outside the channel's window "
        "(a multiple of 16 up to " + std::to_string(handle.view().capacity_bytes) + ")"));
  } else if (!supported(x.element_type())) {
    promise.SetError(ffi::Error::InvalidArgument("b12x_jax.all_reduce: dtype must be float32, bfloat16 or float16"));
  } else if (!like(x, *y)) {
    promise.SetError(ffi::Error::InvalidArgument("b12x_jax.all_reduce: the result must have x's shape and dtype"));
  } else if (algorithm < 0 || static_cast<uint32_t>(algorithm) > kLastRequestable) {
    promise.SetError(ffi::Error::InvalidArgument("b12x_jax.all_reduce: unknown algorithm " + std::to_string(algorithm)));
  } else {
    const ChannelView& v = handle.view();
    const auto* in = static_cast<const Pack*>(x.untyped_data());
    auto* out = static_cast<Pack*>(y->untyped_data());
    if (handle.group->options().poison_outputs) std::memset(out, 0xFF, bytes);  // NaN everywhere
    const Plan plan = plan_for(bytes, v.world, static_cast<Algorithm>(algorithm), v);
    submit_host_call(plan.algorithm == Algorithm::kLamport
                         ? make_call<LamportAllReduce>(x.element_type(), handle, promise, plan, site, in, out)
                         : make_call<BarrierAllReduce>(x.element_type(), handle, promise, plan, site, in, out),
                     placement_of(expected_device, Platform::kHost, ordinal));
  }
  return future;
}

ffi::Future ResidualRmsnormHost(int32_t ordinal, ffi::Token, ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                                std::optional<ffi::AnyBuffer> expected_device, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> normed,
                                ffi::Result<ffi::AnyBuffer> residual_out,
                                std::string_view channel_id, std::string_view group, int32_t site, float eps) {
  ffi::Promise promise;
  ffi::Future future(promise);
  const RankLease handle = Registry::get().lease(Platform::kHost, channel_id, group, ordinal);
  const size_t bytes = x.size_bytes();
  RowsShape s{};
  const std::string problem = rows_call_shape(x, residual, weight, s);
  const RowsPlan plan = handle && problem.empty() ? plan_rows(s, handle.view().lamport_layout) : RowsPlan{};
  if (!handle) {
    promise.SetError(
        ffi::Error::InvalidArgument(unprepared_message("all_reduce_residual_rmsnorm", channel_id, ordinal)));
  } else if (!problem.empty() || !supported(x.element_type())) {
    promise.SetError(ffi::Error::InvalidArgument(
        problem.empty() ? "b12x_jax.all_reduce_residual_rmsnorm: dtype must be float32, bfloat16 or float16" : problem));
  } else if (!like(x, *normed) || !like(x, *residual_out)) {
    promise.SetError(ffi::Error::InvalidArgument(
        "b12x_jax.all_reduce_residual_rmsnorm: both results must have x's shape and dtype"));
  } else if (plan.grid == 0) {
    promise.SetError(ffi::Error::InvalidArgument(rows_capacity_message(s, handle.view().lamport_layout)));
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
    submit_host_call(make_call<ResidualRmsnormCall>(x.element_type(), handle, promise, s, plan, site, eps, in, res, w,
                                                    out, res_out),
                     placement_of(expected_device, Platform::kHost, ordinal));
  }
  return future;
}

}  // namespace
}  // namespace b12x

XLA_FFI_DEFINE_HANDLER_SYMBOL(b12x_all_reduce_host, b12x::AllReduceHost,
                              b12x::all_reduce_signature(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(b12x_residual_rmsnorm_host, b12x::ResidualRmsnormHost,
                              b12x::residual_rmsnorm_signature(xla::ffi::Ffi::Bind()));
