// DCP all-to-all merge on the host backend with one block, driven by the
// progress thread (progress.h): the Lamport exchange of lamport.h where the
// rows fit the Lamport cell, else the barrier protocol of protocol.h; the
// rows and the merge math are those of dcp.h.
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "../dcp.h"
#include "../dcp_call.h"
#include "../registry.h"
#include "../signatures.h"
#include "host_calls.h"
#include "progress.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace b12x {
namespace {

// Pushes, into every peer p's cell of this rank, the rows of p's heads: lse
// always, the payload only where the lse is finite (nobody reads it
// otherwise).
void stage_rows(const ChannelView& v, const DcpShape& s, int slot, const Pack* in, const float* in_lse) {
  const DcpCell cell{s.rows(), s.row_packs};
  for (int p = 0; p < v.world; ++p) {
    if (!exchanges_with(v, p)) continue;
    char* base = v.staging[p] + v.layout.cell_offset(slot, v.rank, 0);
    Pack* payload = cell.payload(base);
    float* lse = cell.lse(base);
    for (int row = 0; row < cell.rows; ++row) {
      const size_t src = s.input_row(p, row);
      lse[row] = in_lse[src];
      if (lse_finite(in_lse[src])) {
        std::memcpy(payload + static_cast<size_t>(row) * s.row_packs, in + src * s.row_packs, s.row_bytes());
      }
    }
  }
}

// Merges this rank's rows from every source's cell (`cells[q]`, laid out as
// DcpCell of all the rows), its own from the input where from_own_input.
template <DType D>
void merge_rows(const ChannelView& v, const DcpShape& s, const char* const* cells, const Pack* in,
                const float* in_lse, Pack* out, float* out_lse) {
  const DcpCell cell{s.rows(), s.row_packs};
  for (int row = 0; row < cell.rows; ++row) {
    const size_t own = s.input_row(v.rank, row);
    const Pack* rows[kMaxRanks];
    float row_lse[kMaxRanks], scale[kMaxRanks];
    for (int q = 0; q < v.world; ++q) {
      rows[q] = from_own_input(v, q) ? in + own * s.row_packs
                                     : cell.payload(cells[q]) + static_cast<size_t>(row) * s.row_packs;
      row_lse[q] = from_own_input(v, q) ? in_lse[own] : cell.lse(cells[q])[row];
    }
    const float merged = merge_weights(row_lse, v.world, s.base2, scale);
    for (int k = 0; k < s.row_packs; ++k) {
      float acc[Elements<D>::kCount] = {};
      for (int q = 0; q < v.world; ++q) {  // rank order: C9
        if (scale[q] != 0.0f) accumulate_scaled<D>(acc, rows[q][k], scale[q]);
      }
      out[static_cast<size_t>(row) * s.row_packs + k] = round_pack<D>(acc);
    }
    if (out_lse != nullptr) out_lse[row] = merged;
  }
}

using Merger = void (*)(const ChannelView&, const DcpShape&, const char* const*, const Pack*, const float*, Pack*,
                        float*);

// What both protocols' calls hold: the shape, its plan (plan_dcp_call), the
// buffers and the merge.
struct DcpArgs {
  DcpShape s;
  DcpPlan plan;
  CallTag tag;
  Merger merge;
  const Pack* in;
  const float* in_lse;
  Pack* out;
  float* out_lse;

  // Merges from the cells of slot (or buffer) `slot` of `region`, laid out as `layout`.
  void merge_from(const ChannelView& v, const char* region, const StagingLayout& layout, int slot) const {
    const char* cells[kMaxRanks] = {};
    for (int q = 0; q < v.world; ++q) cells[q] = region + layout.cell_offset(slot, q, 0);
    merge(v, s, cells, in, in_lse, out, out_lse);
  }
};

// One barrier: stage the rows, meet, merge.
class DcpCall final : public BarrierCall {
 public:
  DcpCall(RankHandle handle, ffi::Promise promise, const DcpArgs& a)
      : BarrierCall(handle, std::move(promise), a.tag, 1), a_(a) {}

 private:
  void stage(const ChannelView& v, uint32_t epoch, int /*phase*/) override {
    stage_rows(v, a_.s, epoch & 1, a_.in, a_.in_lse);
  }
  void done(const ChannelView& v, uint32_t epoch) override {
    a_.merge_from(v, v.staging[v.rank], v.layout, epoch & 1);
  }

  DcpArgs a_;
};

// The Lamport exchange of the rows (plan_dcp_lamport: one block, all rows):
// each peer's cell gets the rows of its heads; the merge reads the cells
// once every word arrived.
class LamportDcpCall final : public LamportHostCall {
 public:
  LamportDcpCall(RankHandle handle, ffi::Promise promise, const DcpArgs& a)
      : LamportHostCall(handle, std::move(promise), a.tag, DcpCell{a.s.rows(), a.s.row_packs}.lamport_packs()),
        a_(a) {}

  // The merge reads this call's buffer, which the advance leaves as it is.
  void finish(const ChannelView& v) override {
    complete(v);
    a_.merge_from(v, v.lamport[v.rank], v.lamport_layout, call().buffer);
  }

 private:
  void push(const ChannelView& v) override {
    for (size_t i = 0; i < packs(); ++i) {
      for (int p = 0; p < v.world; ++p) {
        if (exchanges_with(v, p)) {
          lamport_push_to<HostMem>(v, call(), p, i, dcp_lamport_pack(a_.s, a_.in, a_.in_lse, p, 0, a_.s.rows(), i));
        }
      }
    }
  }

  DcpArgs a_;
};

// Empty when the call can run; else why not. Fills `shape`, its `plan` and `out_lse`.
std::string check_call(const RankHandle& handle, const ffi::AnyBuffer& x, const ffi::AnyBuffer& lse,
                       const ffi::AnyBuffer& y, const ffi::RemainingRets& rets, bool base2, bool return_lse,
                       DcpShape& shape, DcpPlan& plan, float*& out_lse) {
  const ChannelView& v = handle.view();
  std::string problem = dcp_call_shape(x, lse, rets.size(), return_lse, v, base2, shape);
  if (!problem.empty()) return problem;
  plan = plan_dcp_call(shape, v, 1);
  if (plan.grid == 0) return dcp_capacity_message(shape, v.layout);
  std::optional<ffi::AnyBuffer> lse_out;  // only looked up where asked: a missing result costs an error string
  if (return_lse) {
    auto found = rets.get<ffi::AnyBuffer>(0);
    if (!found.has_value()) return "b12x_jax.dcp_a2a: the merged lse result is not a buffer";
    lse_out.emplace(**found);
  }
  const ffi::AnyBuffer* merged_lse = lse_out ? &*lse_out : nullptr;
  problem = dcp_results_problem(x, y, merged_lse, shape);
  if (!problem.empty() || merged_lse == nullptr) return problem;
  out_lse = static_cast<float*>(merged_lse->untyped_data());
  if (handle.group->options().poison_outputs) std::memset(out_lse, 0xFF, merged_lse->size_bytes());
  return {};
}

ffi::Future DcpA2aHost(int32_t ordinal, ffi::Token, ffi::AnyBuffer x, ffi::AnyBuffer lse,
                       std::optional<ffi::AnyBuffer> expected_device, ffi::Result<ffi::Token>,
                       ffi::Result<ffi::AnyBuffer> y,
                       ffi::RemainingRets rets, std::string_view channel_id, std::string_view group, int32_t site, bool base2,
                       bool return_lse) {
  ffi::Promise promise;
  ffi::Future future(promise);
  const RankLease handle = Registry::get().lease(Platform::kHost, channel_id, group, ordinal);
  DcpShape s{};
  DcpPlan plan{};
  float* out_lse = nullptr;
  const std::string problem = handle ? check_call(handle, x, lse, *y, rets, base2, return_lse, s, plan, out_lse)
                                     : unprepared_message("dcp_a2a", channel_id, ordinal);
  if (!problem.empty()) {
    promise.SetError(ffi::Error::InvalidArgument(problem));
    return future;
  }
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const Merger merge = bf16 ? merge_rows<DType::kBF16> : merge_rows<DType::kF16>;
  const auto* in = static_cast<const Pack*>(x.untyped_data());
  const auto* in_lse = static_cast<const float*>(lse.untyped_data());
  auto* out = static_cast<Pack*>(y->untyped_data());
  if (handle.group->options().poison_outputs) std::memset(out, 0xFF, y->size_bytes());  // NaN everywhere
  const DcpArgs args{s, plan, plan.tag(s, bf16 ? DType::kBF16 : DType::kF16, site), merge, in, in_lse, out, out_lse};
  const Placement placement = placement_of(expected_device, Platform::kHost, ordinal);
  if (plan.lamport) {
    submit_host_call(std::make_unique<LamportDcpCall>(handle, promise, args), placement);
  } else {
    submit_host_call(std::make_unique<DcpCall>(handle, promise, args), placement);
  }
  return future;
}

}  // namespace
}  // namespace b12x

XLA_FFI_DEFINE_HANDLER_SYMBOL(b12x_dcp_a2a_host, b12x::DcpA2aHost,
                              b12x::dcp_a2a_signature(xla::ffi::Ffi::Bind()));
