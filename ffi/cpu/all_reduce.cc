// One-shot all-reduce on the host backend: the protocol of protocol.h with
// one block, driven by the progress thread (progress.h).
#include <cstring>
#include <string_view>

#include "../numeric.h"
#include "../registry.h"
#include "progress.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace b12x {
namespace {

template <DType D>
void reduce_sources(const ChannelView& v, int slot, const Pack* own, Pack* out, size_t packs) {
  float acc[Elements<D>::kCount];
  const Pack* sources[kMaxRanks];
  for (int q = 0; q < v.world; ++q) {
    sources[q] = q == v.rank ? own
                             : reinterpret_cast<const Pack*>(v.staging[v.rank] + v.layout.cell_offset(slot, q, 0));
  }
  for (size_t i = 0; i < packs; ++i) {
    for (float& a : acc) a = 0.0f;
    for (int q = 0; q < v.world; ++q) accumulate<D>(acc, sources[q][i]);  // rank order: C9
    out[i] = round_pack<D>(acc);
  }
}

using Reducer = void (*)(const ChannelView&, int, const Pack*, Pack*, size_t);

Reducer reducer_for(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return reduce_sources<DType::kF32>;
    case ffi::DataType::BF16: return reduce_sources<DType::kBF16>;
    case ffi::DataType::F16: return reduce_sources<DType::kF16>;
    default: return nullptr;
  }
}

ffi::Future AllReduceHost(int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          std::string_view channel_id) {
  ffi::Promise promise;
  ffi::Future future(promise);
  const RankHandle handle = Registry::get().find(Platform::kHost, channel_id, ordinal);
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
    HostCall call{handle};
    call.stage = [in, bytes](const ChannelView& v, uint32_t epoch) {
      for (int p = 0; p < v.world; ++p) {
        if (p != v.rank) std::memcpy(v.staging[p] + v.layout.cell_offset(epoch & 1, v.rank, 0), in, bytes);
      }
    };
    call.finish = [in, out, bytes, reduce](const ChannelView& v, uint32_t epoch) {
      reduce(v, epoch & 1, in, out, bytes / kPackBytes);
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
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<std::string_view>("channel_id"));
