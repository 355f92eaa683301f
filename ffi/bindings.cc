// The nanobind module `b12x_jax._b12x`: FFI handler capsules and the
// preparation, release and inspection calls the Python layer makes before
// and after executions (never during one).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "all_reduce.h"
#include "dcp.h"
#include "lamport.h"
#include "cpu/host_channel.h"
#include "cpu/progress.h"
#include "cpu/shm_channel.h"
#include "registry.h"
#include "rmsnorm.h"
#include "shared_group.h"
#include "xla/ffi/api/c_api.h"

#if defined(B12X_WITH_CUDA)
#include "cuda/cuda_channel.h"
#include "cuda/ipc_channel.h"
#endif

namespace nb = nanobind;

extern "C" XLA_FFI_Error* b12x_all_reduce_host(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* b12x_dcp_a2a_host(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* b12x_residual_rmsnorm_host(XLA_FFI_CallFrame*);
#if defined(B12X_WITH_CUDA)
extern "C" XLA_FFI_Error* b12x_all_reduce_cuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* b12x_dcp_a2a_cuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* b12x_residual_rmsnorm_cuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* b12x_dispatch_probe_cuda(XLA_FFI_CallFrame*);
#endif

namespace b12x {
namespace {

template <typename Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

Platform parse_platform(const std::string& platform) {
  if (platform == "cpu") return Platform::kHost;
  if (platform == "cuda") return Platform::kCuda;
  throw std::invalid_argument("b12x_jax: unknown platform '" + platform + "'");
}

void add_group(std::unique_ptr<ChannelGroup> group, const std::string& partition, std::string preparation) {
  group->set_partition(partition);
  group->set_preparation(std::move(preparation));
  const std::string problem = Registry::get().add(std::move(group));
  if (!problem.empty()) throw std::invalid_argument("b12x_jax: " + problem);
}

DType parse_dtype(const std::string& dtype) {
  if (dtype == "float32") return DType::kF32;
  if (dtype == "bfloat16") return DType::kBF16;
  if (dtype == "float16") return DType::kF16;
  throw std::invalid_argument("b12x_jax: no b12x call takes dtype '" + dtype + "'");
}

#if defined(B12X_WITH_CUDA)
// The ordinals of the ranks this process holds.
std::vector<int> local_ordinals(const std::vector<int>& ordinals) {
  std::vector<int> local;
  for (int ordinal : ordinals) {
    if (ordinal != kRemoteRank) local.push_back(ordinal);
  }
  return local;
}
#endif

nb::tuple tag_tuple(const CallTag& tag) { return nb::make_tuple(tag.call, tag.algorithm, tag.packs, tag.site); }

RankHandle find_or_throw(const std::string& platform, const std::string& channel, int ordinal) {
  RankHandle handle = Registry::get().find(parse_platform(platform), channel, {}, ordinal);
  if (!handle) throw std::invalid_argument(unprepared_message("stats", channel, ordinal));
  return handle;
}

// A group spread over processes while the Python layer prepares it
// (shared_group.h): the steps between two collective verdicts.
class PendingGroup {
 public:
  PendingGroup(std::unique_ptr<SharedGroup> group, std::string partition, std::string preparation)
      : group_(std::move(group)), partition_(std::move(partition)), preparation_(std::move(preparation)) {}

  nb::dict exports() const {
    nb::dict out;
    for (int r = 0; r < get().world(); ++r) {
      if (!get().is_local(r)) continue;
      const std::string bytes = get().exported(r);
      out[nb::int_(r)] = nb::bytes(bytes.data(), bytes.size());
    }
    return out;
  }
  void open(int rank, nb::bytes exported) { get().open(rank, std::string(exported.c_str(), exported.size())); }
  nb::tuple layout() const {
    int rank = 0;
    while (!get().is_local(rank)) ++rank;
    const ChannelView& v = get().view(rank);
    return nb::make_tuple(v.layout.block_bytes, v.lamport_layout.block_bytes, v.layout.max_blocks);
  }
  void close_imports() { get().close_imports(); }
  void drop_names() { get().drop_names(); }
  // Every rank opened every import: the group serves handlers from now on.
  void install() {
    get().drop_names();
    add_group(std::move(group_), partition_, preparation_);
  }
  // Frees the exports: only after every rank closed its imports.
  void free() { group_.reset(); }

 private:
  SharedGroup& get() const {
    if (!group_) throw std::invalid_argument("b12x_jax: this pending group was installed or freed");
    return *group_;
  }
  std::unique_ptr<SharedGroup> group_;
  std::string partition_;
  std::string preparation_;
};

// Prepares a group held by this process alone: the memory of a released one
// where one fits (Registry::reusable), else new.
template <class Make>
void prepare_local(Platform platform, const std::string& channel, const std::string& partition,
                   const std::vector<int>& ordinals, const ChannelOptions& options, Make make) {
  Registry& registry = Registry::get();
  const std::string reused = registry.reusable(platform, channel, partition, ordinals, options);
  if (!reused.empty() && registry.revive(platform, reused, channel)) return;
  add_group(make(), partition, registry.local_preparation());
}

// The protocol this build speaks, as one word (FNV-1a over its revision,
// its layout and its exchanges' constants): processes whose words differ
// must not meet on a channel (b12x_jax/rendezvous.py, Frame).
uint64_t protocol_fingerprint() {
  const uint64_t words[] = {
      kProtocolRevision, kMaxRanks, kMaxBlocks, kMaxRowSplit, kPackBytes, kStagingSlots, kLamportBuffers,
      kLamportEmptyWord, kLamportNaNWord, kFailureTimeout, kFailureMismatch, kFailureStale, kErrorComplete, sizeof(CallTag),
      sizeof(Signal), offsetof(Signal, flag), offsetof(Signal, tag), offsetof(Signal, lamport_calls),
      offsetof(Signal, lamport_buffer), offsetof(Signal, lamport_packs), offsetof(Signal, served),
      offsetof(Signal, row_arrivals), offsetof(Signal, row_shares), offsetof(Signal, poisoned),
      offsetof(Signal, generation), sizeof(ErrorRecord), offsetof(ErrorRecord, kind), offsetof(ErrorRecord, rank),
      offsetof(ErrorRecord, peer), offsetof(ErrorRecord, epoch), offsetof(ErrorRecord, peer_gave_up),
      offsetof(ErrorRecord, first_call), offsetof(ErrorRecord, expected), offsetof(ErrorRecord, seen),
      offsetof(ErrorRecord, channel_generation)};
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const uint64_t word : words) {
    for (int byte = 0; byte < 8; ++byte) hash = (hash ^ (word >> 8 * byte & 0xFF)) * 0x100000001b3ull;
  }
  return hash;
}

}  // namespace
}  // namespace b12x

NB_MODULE(_b12x, m) {
  using namespace b12x;
  m.doc() = "b12x_jax native layer: channel memory, transports, kernels and FFI handlers.";

  m.def("handlers", [] {
    nb::dict out;
    nb::dict cpu;
    cpu["b12x_all_reduce"] = capsule(b12x_all_reduce_host);
    cpu["b12x_dcp_a2a"] = capsule(b12x_dcp_a2a_host);
    cpu["b12x_residual_rmsnorm"] = capsule(b12x_residual_rmsnorm_host);
    out["cpu"] = cpu;
#if defined(B12X_WITH_CUDA)
    nb::dict cuda;
    cuda["b12x_all_reduce"] = capsule(b12x_all_reduce_cuda);
    cuda["b12x_dcp_a2a"] = capsule(b12x_dcp_a2a_cuda);
    cuda["b12x_residual_rmsnorm"] = capsule(b12x_residual_rmsnorm_cuda);
    cuda["b12x_dispatch_probe"] = capsule(b12x_dispatch_probe_cuda);
    out["CUDA"] = cuda;
#endif
    return out;
  }, "FFI handler capsules by XLA platform name, then target name.");

  // The native facts the Python layer plans with (b12x_jax/_native.py),
  // read from here rather than restated.
  nb::dict algorithms;
  algorithms["one_shot"] = static_cast<uint32_t>(Algorithm::kOneShot);
  algorithms["two_shot"] = static_cast<uint32_t>(Algorithm::kTwoShot);
  algorithms["one_shot_pull"] = static_cast<uint32_t>(Algorithm::kPull);
  algorithms["lamport"] = static_cast<uint32_t>(Algorithm::kLamport);
  nb::dict constants;
  constants["max_ranks"] = kMaxRanks;
  constants["max_blocks"] = kMaxBlocks;
  constants["max_row_split"] = kMaxRowSplit;
  constants["pack_bytes"] = kPackBytes;
  constants["max_capacity_bytes"] = kMaxCapacityBytes;
  constants["algorithms"] = algorithms;
  m.attr("constants") = constants;
  m.attr("protocol") = protocol_fingerprint();

  m.def("ffi_api_version", [] { return std::make_pair(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); },
        "The XLA FFI API version of the headers this extension was built against.");
  m.attr("built_jaxlib") = B12X_BUILT_JAXLIB;  // the jaxlib whose headers those were (CMakeLists.txt)

  m.def("has_cuda", [] {
#if defined(B12X_WITH_CUDA)
    return true;
#else
    return false;
#endif
  });

  nb::class_<ChannelOptions>(m, "ChannelOptions", "What a channel is prepared with (ffi/registry.h).")
      .def(nb::init<>())
      .def_rw("capacity_bytes", &ChannelOptions::capacity_bytes)
      .def_rw("lamport_bytes", &ChannelOptions::lamport_bytes)
      .def_rw("timeout_s", &ChannelOptions::timeout_s)
      .def_rw("setup_timeout_s", &ChannelOptions::setup_timeout_s)
      .def_rw("max_blocks", &ChannelOptions::max_blocks)
      .def_rw("poison_outputs", &ChannelOptions::poison_outputs)
      .def_rw("loopback", &ChannelOptions::loopback);

  // Both wait for host calls to complete without the GIL: a completion runs
  // XLA's continuation, which may call into Python (a copy to the host); held,
  // the wait ran out its bound and the continuation ran while Python finalized
  // (std::terminate at exit).
  m.def("shutdown_host_progress", &shutdown_host_progress, nb::arg("seconds"),
        nb::call_guard<nb::gil_scoped_release>(),
        "At exit: waits (bounded) for the host backend's queued calls, then joins its progress thread.");

  m.def("payload_limits", [](const ChannelOptions& options) {
    const ChannelView v = base_view(options, 1, 1);
    return nb::make_tuple(v.capacity_bytes, v.lamport_window);
  }, nb::arg("options"),
     "(capacity_bytes, lamport_window) of a channel prepared with `options`: the one capacity rule (ffi/channel.h "
     "ChannelView).");

  m.def("lamport_cell_bytes", [](const ChannelOptions& options, int blocks) {
    if (blocks < 1 || blocks > kMaxBlocks) throw std::invalid_argument("b12x_jax: blocks must be in [1, 64]");
    return base_view(options, 1, blocks).lamport_layout.block_bytes;
  }, nb::arg("options"), nb::arg("blocks"),
     "Bytes of one Lamport cell of a channel prepared with `options` and `blocks` blocks (0: no Lamport path).");

  m.def("dcp_lamport_plan", [](size_t cell_bytes, int max_blocks, int batch, int heads, int world, size_t row_bytes,
                               const std::string& dtype, uint32_t site, bool base2) {
    if (max_blocks < 1 || max_blocks > kMaxBlocks) throw std::invalid_argument("b12x_jax: blocks must be in [1, 64]");
    if (world < 1 || world > kMaxRanks || heads % world != 0 || row_bytes % kPackBytes != 0 ||
        !dcp_tag_carries(heads, row_bytes / kPackBytes)) {
      return nb::make_tuple(0, 0, nb::make_tuple(0, 0, 0, 0));  // no channel serves the call
    }
    const StagingLayout cells{cell_bytes, world, max_blocks, kLamportBuffers};
    const DcpShape shape{batch, heads, world, static_cast<int>(row_bytes / kPackBytes), base2};
    const DcpPlan plan = plan_dcp_lamport(shape, cells);
    return nb::make_tuple(plan.grid, plan.per_block, tag_tuple(plan.tag(shape, parse_dtype(dtype), site)));
  }, nb::arg("cell_bytes"), nb::arg("max_blocks"), nb::arg("batch"), nb::arg("heads"), nb::arg("world"),
     nb::arg("row_bytes"), nb::arg("dtype"), nb::arg("site"), nb::arg("base2"),
     "(grid, rows per block, tag) of a dcp_a2a call of out [batch, heads, row_bytes] of `dtype` at `site` in the "
     "Lamport cells of "
     "`cell_bytes` of `max_blocks` blocks (ffi/dcp.h plan_dcp_lamport); grid 0 where the rows do not fit or no "
     "channel serves the call (more than 8 ranks, heads not a multiple of them, rows not of whole packs, beyond "
     "dcp_tag_limits).");

  m.def("rows_tag", [](int rows, size_t row_bytes, int grid, const std::string& dtype, uint32_t site) {
    const DType type = parse_dtype(dtype);
    const int item = type == DType::kF32 ? 4 : 2;
    const RowsShape shape{rows, static_cast<int>(row_bytes / kPackBytes), static_cast<int>(row_bytes / item)};
    return tag_tuple(RowsPlan{0, grid}.tag(shape, type, site));
  }, nb::arg("rows"), nb::arg("row_bytes"), nb::arg("grid"), nb::arg("dtype"), nb::arg("site"),
     "The call tag of the fused op on `rows` rows of `row_bytes` of `dtype` over `grid` blocks at `site` "
     "(ffi/rmsnorm.h RowsPlan::tag).");

  m.def("set_device_id", [](const std::string& platform, int ordinal, int id) {
    set_device_id(parse_platform(platform), ordinal, id);
  }, nb::arg("platform"), nb::arg("ordinal"), nb::arg("id"),
        "Registers the global id of this process's device `ordinal` (ffi/registry.h device_id).");
  m.def("name_site", [](uint32_t site, const std::string& name) { name_site(site, name); }, nb::arg("site"),
        nb::arg("name"), "Names a call site for error messages (ffi/registry.h name_site).");

  m.def("dcp_tag_limits", [] { return nb::make_tuple(kDcpMaxTagHeads, kDcpMaxTagRowPacks * kPackBytes); },
        "(heads, row bytes): the largest H and row of out a dcp_a2a call tag carries (ffi/dcp.h dcp_tag_algorithm).");

  m.def("prepare_host", [](const std::string& channel, const std::string& partition, std::vector<int> ordinals,
                           const ChannelOptions& options) {
    prepare_local(Platform::kHost, channel, partition, ordinals, options,
                  [&] { return make_host_group(channel, ordinals, options); });
  }, nb::arg("channel"), nb::arg("partition"), nb::arg("ordinals"), nb::arg("options"),
     nb::call_guard<nb::gil_scoped_release>(),  // it may wait for host calls (revive), as release does
     "Allocates the channel in host memory for the given CPU devices, ranks in list order, or reuses the "
     "memory of a released group on the same devices and options (of this channel first, else renamed).");

#if defined(B12X_WITH_CUDA)
  m.def("prepare_cuda", [](const std::string& channel, const std::string& partition, std::vector<int> ordinals,
                           ChannelOptions options) {
    options.max_blocks = resolve_max_blocks(options, ordinals);  // as the group stores them
    prepare_local(Platform::kCuda, channel, partition, ordinals, options,
                  [&] { return make_cuda_group(channel, ordinals, options); });
  }, nb::arg("channel"), nb::arg("partition"), nb::arg("ordinals"), nb::arg("options"),
     nb::call_guard<nb::gil_scoped_release>(),  // device syncs: other Python threads go on meanwhile
     "Allocates the channel on the given GPUs of this process (peer access probed before), or reuses the "
     "memory of a released group on the same devices and options (of this channel first, else renamed).");
  m.def("probe_peer_access", &probe_peer_access, nb::arg("ordinals"),
        "Empty when every pair of the GPUs can read and write each other's memory, else why not.");
#endif

  nb::class_<PendingGroup>(m, "PendingGroup",
                           "A channel group shared with other processes, between preparation steps.")
      .def("exports", &PendingGroup::exports, "Local rank -> bytes another process opens it from.")
      .def("open", &PendingGroup::open, nb::arg("rank"), nb::arg("exported"), "Maps a remote rank's memory.")
      .def("layout", &PendingGroup::layout, "(block_bytes, lamport_block_bytes, max_blocks), equal on every rank.")
      .def("close_imports", &PendingGroup::close_imports, "Unmaps what open() mapped (rollback).")
      .def("drop_names", &PendingGroup::drop_names, "Unlinks the local exports' names (rollback).")
      .def("install", &PendingGroup::install, "Hands the group to the handlers.")
      .def("free", &PendingGroup::free, "Frees the local memory (rollback, after every rank closed its imports).");

  m.def("share_host", [](const std::string& channel, const std::string& partition, std::vector<int> ordinals,
                         const ChannelOptions& options, const std::string& preparation) {
    return PendingGroup(make_shm_group(channel, std::move(ordinals), options), partition, preparation);
  }, nb::arg("channel"), nb::arg("partition"), nb::arg("ordinals"), nb::arg("options"), nb::arg("preparation"),
     "Allocates the local ranks of a channel shared with other processes in POSIX shared memory; "
     "ordinals[r] is -1 for a rank another process holds.");

#if defined(B12X_WITH_CUDA)
  m.def("share_cuda", [](const std::string& channel, const std::string& partition, std::vector<int> ordinals,
                         const ChannelOptions& options, const std::string& preparation) {
    return PendingGroup(make_ipc_group(channel, std::move(ordinals), options), partition, preparation);
  }, nb::arg("channel"), nb::arg("partition"), nb::arg("ordinals"), nb::arg("options"), nb::arg("preparation"),
     "Allocates and exports (CUDA IPC) this process's rank of a channel shared with other processes; "
     "ordinals[r] is -1 for a rank another process holds.");
#endif

  m.def("reusable", [](const std::string& platform, const std::string& channel, const std::string& partition,
                       const std::vector<int>& ordinals, ChannelOptions options) {
    const Platform on = parse_platform(platform);
#if defined(B12X_WITH_CUDA)
    if (on == Platform::kCuda) options.max_blocks = resolve_max_blocks(options, local_ordinals(ordinals));
#endif
    return Registry::get().reusable(on, channel, partition, ordinals, options);
  }, nb::arg("platform"), nb::arg("channel"), nb::arg("partition"), nb::arg("ordinals"), nb::arg("options"),
     "The preparation of a released group a new preparation of the channel can reuse (ffi/registry.h), or ''.");
  m.def("revive", [](const std::string& platform, const std::string& preparation, const std::string& channel) {
    return Registry::get().revive(parse_platform(platform), preparation, channel);
  }, nb::arg("platform"), nb::arg("preparation"), nb::arg("channel"), nb::call_guard<nb::gil_scoped_release>(),
     "Puts the released group of `preparation` back into use as `channel`, reset; False if it cannot.");
  m.def("retire", [](const std::string& platform, const std::string& preparation) {
    Registry::get().retire(parse_platform(platform), preparation);
  }, nb::arg("platform"), nb::arg("preparation"), nb::call_guard<nb::gil_scoped_release>(),
     "Takes a revived group out of use again (a failed preparation).");
  m.def("refusals", [](const std::string& platform, const std::string& channel, const std::string& partition,
                       const std::vector<int>& ordinals) {
    return Registry::get().refusals(parse_platform(platform), channel, partition, ordinals);
  }, nb::arg("platform"), nb::arg("channel"), nb::arg("partition"), nb::arg("ordinals"),
     "(even, calls): host calls of the channel over the partition refused as not prepared on each device since "
     "it was last prepared there, and whether a group of them may go into use (ffi/registry.h).");
  m.def("forgive_refusals", [](const std::string& platform, const std::string& channel, const std::string& partition,
                               const std::vector<int>& ordinals) {
    Registry::get().forgive_refusals(parse_platform(platform), channel, partition, ordinals);
  }, nb::arg("platform"), nb::arg("channel"), nb::arg("partition"), nb::arg("ordinals"),
     "Counts the devices' refusals as even at their present counts (after a preparation reported them uneven).");
  m.def("unlink_export", [](const std::string& platform, nb::bytes exported) {
    if (parse_platform(platform) == Platform::kHost) unlink_shm_export(std::string(exported.c_str(), exported.size()));
  }, nb::arg("platform"), nb::arg("exported"),
     "Unlinks the name in a peer's export where it has one (shared memory): a failed preparation leaves none.");

  m.def("release", [](const std::string& platform, const std::string& channel,
                       const std::vector<std::pair<std::string, std::vector<int>>>& groups) {
    const Platform parsed = parse_platform(platform);
    nb::gil_scoped_release unlocked;  // as shutdown_host_progress
    return Registry::get().release(parsed, channel, groups);
  }, nb::arg("platform"), nb::arg("channel"), nb::arg("groups"),
     "Takes the groups of the channel on the platform over `groups` ((partition, ordinals) each) out of use "
     "once their queued work is done; their memory stays for the life of the process (executables may point "
     "at it) and is reused by the next preparation of the same group. Returns how many groups there were.");

  m.def("stats", [](const std::string& platform, const std::string& channel, int ordinal) {
    const RankHandle h = find_or_throw(platform, channel, ordinal);
    nb::dict out;
    out["rank"] = h.rank;
    out["world"] = h.group->world();
    out["epoch"] = h.group->read_calls(h.rank);
    out["poisoned"] = h.group->read_poisoned(h.rank);
    out["capacity_bytes"] = h.view().capacity_bytes;
    out["lamport_bytes"] = h.view().lamport_window;
    return out;
  }, nb::arg("platform"), nb::arg("channel"), nb::arg("ordinal"),
     "Read-only state of one rank of a channel, for tests and debugging.");

  m.def("start_counters", [](const std::string& platform, const std::string& channel, uint32_t calls) {
    const Platform on = parse_platform(platform);
    size_t started = 0;
    Registry::get().for_each_group([&](const ChannelGroup& group, bool released) {
      if (released || group.platform() != on || group.channel() != channel) return;
      group.start_counters(calls);
      ++started;
    });
    if (started == 0) throw std::invalid_argument(unprepared_message("start_counters", channel, -1));
  }, nb::arg("platform"), nb::arg("channel"), nb::arg("calls"),
     "Test hook (docs/DESIGN.md, Wrap): every group of the channel on the platform starts as if `calls` calls "
     "had run. Only right after preparation, before any call on the channel, on every process of the group.");

  m.def("kernel_view", [](const std::string& platform, const std::string& channel, const std::string& partition,
                          int ordinal, size_t bytes, const std::string& dtype, uint32_t site) {
    // Held while the view and its generation are read: a release and a
    // revive under another name in between would give this channel's
    // kernel the other one's memory under its own generation.
    const RankLease h = Registry::get().hold(parse_platform(platform), channel, partition, ordinal);
    if (!h) throw std::invalid_argument(unprepared_message("all_reduce", channel, ordinal));
    const ChannelView& v = h.view();
    const auto address = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
    nb::list signals, lamport;
    for (int r = 0; r < v.world; ++r) {
      signals.append(address(v.signals[r]));
      lamport.append(address(v.lamport[r]));
    }
    const Plan plan = plan_for(bytes, v.world, Algorithm::kOneShot, v);
    nb::dict signal_offsets, error_offsets;
    signal_offsets["lamport_calls"] = offsetof(Signal, lamport_calls);
    signal_offsets["lamport_buffer"] = offsetof(Signal, lamport_buffer);
    signal_offsets["lamport_packs"] = offsetof(Signal, lamport_packs);
    signal_offsets["served"] = offsetof(Signal, served);
    signal_offsets["row_arrivals"] = offsetof(Signal, row_arrivals);
    signal_offsets["row_shares"] = offsetof(Signal, row_shares);
    signal_offsets["poisoned"] = offsetof(Signal, poisoned);
    signal_offsets["generation"] = offsetof(Signal, generation);
    error_offsets["state"] = offsetof(ErrorRecord, state);
    error_offsets["kind"] = offsetof(ErrorRecord, kind);
    error_offsets["rank"] = offsetof(ErrorRecord, rank);
    error_offsets["peer"] = offsetof(ErrorRecord, peer);
    error_offsets["epoch"] = offsetof(ErrorRecord, epoch);
    error_offsets["peer_gave_up"] = offsetof(ErrorRecord, peer_gave_up);
    error_offsets["first_call"] = offsetof(ErrorRecord, first_call);
    error_offsets["expected"] = offsetof(ErrorRecord, expected);
    error_offsets["seen"] = offsetof(ErrorRecord, seen);
    error_offsets["channel_generation"] = offsetof(ErrorRecord, channel_generation);
    nb::dict out;
    out["rank"] = h.rank;
    out["world"] = v.world;
    out["loopback"] = v.loopback != 0;
    out["generation"] = h.group->generation();
    out["signals"] = signals;
    out["lamport"] = lamport;
    out["error"] = address(v.error);
    out["cell_bytes"] = v.lamport_layout.block_bytes;
    out["cells_bytes"] = v.lamport_layout.total_bytes();
    out["max_blocks"] = v.lamport_layout.max_blocks;
    out["timeout_ns"] = v.timeout_ns;
    out["first_timeout_ns"] = v.first_timeout_ns;
    out["algorithm"] = static_cast<uint32_t>(plan.algorithm);
    out["grid"] = plan.grid;
    out["packs"] = plan.packs;
    out["per_block"] = plan.per_block;
    out["tag"] = tag_tuple(plan.tag(parse_dtype(dtype), site));
    out["empty_word"] = kLamportEmptyWord;
    out["nan_word"] = kLamportNaNWord;
    out["buffers"] = kLamportBuffers;
    out["failure_timeout"] = kFailureTimeout;
    out["failure_mismatch"] = kFailureMismatch;
    out["failure_stale"] = kFailureStale;
    out["error_complete"] = kErrorComplete;
    out["poison_grace_ns"] = kPeerPoisonGraceNs;
    out["signal_offsets"] = signal_offsets;
    out["error_offsets"] = error_offsets;
    return out;
  }, nb::arg("platform"), nb::arg("channel"), nb::arg("partition"), nb::arg("ordinal"), nb::arg("bytes"),
     nb::arg("dtype"), nb::arg("site"),
     "What a kernel outside the native layer needs to run an all_reduce of `bytes` bytes of `dtype` at `site` on "
     "the channel's "
     "Lamport buffers with this rank (docs/DESIGN.md, \"Triton kernels\"): its device addresses (valid for the "
     "life of the process, DESIGN C16), the generation of this preparation, the layout, the plan "
     "(all_reduce.h plan_for) and the protocol's constants.");

  m.def("pending_errors", [] {
    // A call that raised may have a local peer whose own wait is still
    // running on the host progress thread: let the calls queued so far end
    // (each within its timeout), so that such a record is read, not missed.
    double bound = 1;
    Registry::get().for_each_group([&](const ChannelGroup& group, bool) {
      bound = std::max(bound, host_idle_bound_s(group.options()));
    });
    bool idle;
    {
      nb::gil_scoped_release unlocked;
      idle = wait_submitted_host_calls(bound);
    }
    std::vector<std::string> out;
    if (!idle) {
      out.push_back("b12x_jax: host collectives queued before this check were still running after " +
                    std::to_string(static_cast<int>(bound)) + " s without one finishing; their errors, if any, "
                    "are not in this report");
    }
    // A released group's record counts only where an executable lowered
    // before the release ran on it (its earlier failures were released).
    Registry::get().for_each_group([&](const ChannelGroup& group, bool released) {
      for (int r = 0; r < group.world(); ++r) {
        if (!group.is_local(r)) continue;  // another process reports its own ranks
        std::string message = pending_error(group, r);  // its kind is read after the state's acquire
        if (!message.empty() && (!released || group.error_record(r).kind == kFailureStale)) {
          out.push_back(std::move(message));
        }
      }
    });
    return out;
  }, "Messages of every recorded timeout, on any channel and rank of this process, once the host calls queued "
     "before it ended (bounded).");
}
