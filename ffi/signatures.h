// The operands, results and attributes of the b12x custom calls, written
// once for both backends: a backend's binding starts with its own context
// (the CUDA stream) and appends one of these. A handler whose parameters
// do not match its binding does not compile. (A binding moves only as an
// rvalue reference: its move constructor is private.)
#pragma once

#include <optional>
#include <string_view>
#include <utility>

#include "channel.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace b12x {

// Whether a result is the size and dtype of the operand it is written from:
// a custom call built by hand (not by the Python layer) could hand a smaller
// one, and a kernel would write past it.
inline bool like(const xla::ffi::AnyBuffer& operand, const xla::ffi::AnyBuffer& result) {
  return result.element_type() == operand.element_type() && result.size_bytes() == operand.size_bytes();
}

// The context and operands every b12x call starts with: the device, then
// the channel's order token (DESIGN C15).
template <class Binding>
auto ordered_call(Binding&& binding) {
  return std::move(binding).template Ctx<xla::ffi::DeviceOrdinal>().template Arg<xla::ffi::Token>();
}

// The attributes every b12x call ends with: which channel, which group of
// it (the axis partition, registry.h), and the call's site in its program
// (channel.h CallTag).
template <class Binding>
auto on_channel(Binding&& binding) {
  return std::move(binding)
      .template Attr<std::string_view>("channel_id")
      .template Attr<std::string_view>("group")
      .template Attr<int32_t>("site");
}

// The operand exported modules end their operands with (docs/DESIGN.md,
// "Placement"): int32[], the id of the device the module's lowering put at
// this device's mesh position. Absent from every other lowering.
template <class Binding>
auto placed(Binding&& binding) {
  return std::move(binding).template OptionalArg<xla::ffi::AnyBuffer>();
}

// The placement of a call on device `ordinal` of `platform` (channel.h).
// Only an exported call looks up its device's id: every other call pays
// nothing for placement.
inline Placement placement_of(const std::optional<xla::ffi::AnyBuffer>& expected_device, Platform platform,
                              int ordinal) {
  if (!expected_device) return Placement{nullptr, -1};
  return Placement{static_cast<const int32_t*>(expected_device->untyped_data()), device_id(platform, ordinal)};
}

template <class Binding>
auto all_reduce_signature(Binding&& binding) {
  auto operands = ordered_call(std::move(binding))
                      .template Arg<xla::ffi::AnyBuffer>();  // x
  auto results = placed(std::move(operands))
                      .template Ret<xla::ffi::Token>()
                      .template Ret<xla::ffi::AnyBuffer>();  // the sum, like x
  return on_channel(std::move(results)).template Attr<int32_t>("algorithm");  // above the Lamport window: Algorithm
}

template <class Binding>
auto residual_rmsnorm_signature(Binding&& binding) {
  auto operands = ordered_call(std::move(binding))
                      .template Arg<xla::ffi::AnyBuffer>()  // x [..., hidden], this rank's partial sum
                      .template Arg<xla::ffi::AnyBuffer>()  // residual, like x
                      .template Arg<xla::ffi::AnyBuffer>();  // weight [hidden]
  auto results = placed(std::move(operands))
                      .template Ret<xla::ffi::Token>()
                      .template Ret<xla::ffi::AnyBuffer>()   // normed, like x
                      .template Ret<xla::ffi::AnyBuffer>();  // residual_out, like x
  return on_channel(std::move(results)).template Attr<float>("eps");
}

template <class Binding>
auto dcp_a2a_signature(Binding&& binding) {
  auto operands = ordered_call(std::move(binding))
                      .template Arg<xla::ffi::AnyBuffer>()  // out [B, H, D]
                      .template Arg<xla::ffi::AnyBuffer>();  // lse [B, H], float32
  auto results = placed(std::move(operands))
                      .template Ret<xla::ffi::Token>()
                      .template Ret<xla::ffi::AnyBuffer>()  // merged out [B, H/N, D]
                      .RemainingRets();                     // merged lse [B, H/N], when asked for
  return on_channel(std::move(results)).template Attr<bool>("base2").template Attr<bool>("return_lse");
}

}  // namespace b12x
