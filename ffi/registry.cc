#include "registry.h"

#include <algorithm>

#include <cstdio>
#include <mutex>
#include <set>
#include <unordered_map>
#include <stdexcept>

#include "dcp.h"

namespace b12x {

Registry& Registry::get() {
  static Registry* registry = new Registry();  // never destroyed: handlers may run at exit
  return *registry;
}

namespace {

// This process's devices of `group`, as "[0, 1]".
std::string ordinal_list(const ChannelGroup& group) {
  std::string out = "[";
  for (int ordinal : group.ordinals()) {
    if (ordinal != kRemoteRank) out += (out.size() > 1 ? ", " : "") + std::to_string(ordinal);
  }
  return out + "]";
}

}  // namespace

std::string Registry::conflict_locked(Platform platform, std::string_view channel, std::string_view partition,
                                      const std::vector<int>& ordinals) const {
  for (const auto& existing : groups_) {
    if (existing->platform() != platform || existing->channel() != channel || existing->partition() != partition) {
      continue;
    }
    for (int ordinal : ordinals) {
      for (int other : existing->ordinals()) {
        if (ordinal == other && ordinal != kRemoteRank) {
          if (existing->ordinals() == ordinals) {  // the same group, held by another Communicator
            return "channel '" + std::string(channel) + "' is already prepared for devices " +
                   ordinal_list(*existing) + " by another Communicator of this process: use "
                   "b12x_jax.get_communicator(), or close() the other one first";
          }
          return "channel '" + std::string(channel) + "' is already prepared on device " + std::to_string(ordinal) +
                 " in another group of partition " + std::string(partition) + " (a device is in one group of a "
                 "partition)";
        }
      }
    }
  }
  return {};
}

std::string Registry::add(std::unique_ptr<ChannelGroup> group) {
  // Before the lock: it synchronises the devices (registry.h, "the lock").
  group->write_generation(next_generation());
  std::unique_lock lock(mutex_);
  std::string conflict = conflict_locked(group->platform(), group->channel(), group->partition(), group->ordinals());
  if (conflict.empty()) conflict = uneven_refusals(group->platform(), group->channel(), group->partition(), group->ordinals());
  if (!conflict.empty()) return conflict;
  forget_refusals(group->platform(), group->channel(), group->partition(), group->ordinals());
  groups_.push_back(std::move(group));
  return {};
}

RankHandle Registry::find(Platform platform, std::string_view channel, std::string_view partition,
                          int ordinal) const {
  std::shared_lock lock(mutex_);
  return find_locked(platform, channel, partition, ordinal);
}

RankLease Registry::hold(Platform platform, std::string_view channel, std::string_view partition,
                         int ordinal) const {
  RankLease lease;
  lease.lock = std::shared_lock(mutex_);
  static_cast<RankHandle&>(lease) = find_locked(platform, channel, partition, ordinal);
  return lease;
}

RankLease Registry::lease(Platform platform, std::string_view channel, std::string_view partition,
                          int ordinal) const {
  RankLease lease = hold(platform, channel, partition, ordinal);
  if (!lease && platform == Platform::kHost) {  // under the shared lock: add and revive see it
    std::lock_guard refusals(refusals_mutex_);
    ++refused_[{platform, std::string(channel), std::string(partition)}][ordinal].calls;
  }
  return lease;
}

std::pair<bool, std::vector<uint64_t>> Registry::refusals(Platform platform, std::string_view channel,
                                                          std::string_view partition,
                                                          const std::vector<int>& ordinals) const {
  std::lock_guard lock(refusals_mutex_);
  std::vector<uint64_t> calls(ordinals.size(), 0);
  const auto found = refused_.find({platform, std::string(channel), std::string(partition)});
  if (found == refused_.end()) return {true, calls};
  std::set<uint64_t> counts, forgiven;
  for (size_t r = 0; r < ordinals.size(); ++r) {
    if (ordinals[r] == kRemoteRank) continue;
    const auto device = found->second.find(ordinals[r]);
    const Refused refused = device == found->second.end() ? Refused{} : device->second;
    calls[r] = refused.calls;
    counts.insert(refused.calls);
    forgiven.insert(refused.calls + refused.forgiven);
  }
  return {counts.size() <= 1 || forgiven.size() <= 1, calls};
}

void Registry::forgive_refusals(Platform platform, std::string_view channel, std::string_view partition,
                                const std::vector<int>& ordinals) const {
  std::lock_guard lock(refusals_mutex_);
  auto& devices = refused_[{platform, std::string(channel), std::string(partition)}];
  uint64_t most = 0;
  for (int ordinal : ordinals) {
    if (ordinal != kRemoteRank) most = std::max(most, devices[ordinal].calls);
  }
  for (int ordinal : ordinals) {
    if (ordinal != kRemoteRank) devices[ordinal].forgiven = most - devices[ordinal].calls;
  }
}

void Registry::forget_refusals(Platform platform, std::string_view channel, std::string_view partition,
                               const std::vector<int>& ordinals) const {
  std::lock_guard lock(refusals_mutex_);
  const auto found = refused_.find({platform, std::string(channel), std::string(partition)});
  if (found == refused_.end()) return;
  for (int ordinal : ordinals) found->second.erase(ordinal);
  if (found->second.empty()) refused_.erase(found);
}

std::string Registry::uneven_refusals(Platform platform, std::string_view channel, std::string_view partition,
                                      const std::vector<int>& ordinals) const {
  const auto [even, calls] = refusals(platform, channel, partition, ordinals);
  if (even) return {};
  std::string counts;
  for (size_t r = 0; r < ordinals.size(); ++r) {
    if (ordinals[r] == kRemoteRank) continue;
    counts += (counts.empty() ? "" : ", ") + ("device " + std::to_string(ordinals[r])) + ": " +
              std::to_string(calls[r]);
  }
  return "channel '" + std::string(channel) + "': a call refused as not prepared on some of its devices had "
         "not reached the others when it was about to go into use (refused calls: " + counts + "). Block on "
         "every shard of its results, then prepare again";
}

RankHandle Registry::find_locked(Platform platform, std::string_view channel, std::string_view partition,
                                 int ordinal) const {
  for (const auto& group : groups_) {
    if (group->platform() != platform || group->channel() != channel) continue;
    if (!partition.empty() && group->partition() != partition) continue;
    const auto& ordinals = group->ordinals();
    for (size_t r = 0; r < ordinals.size(); ++r) {
      if (ordinals[r] == ordinal && ordinal != kRemoteRank) return RankHandle{group.get(), static_cast<int>(r)};
    }
  }
  return {};
}

std::string Registry::reusable(Platform platform, std::string_view channel, std::string_view partition,
                               const std::vector<int>& ordinals, const ChannelOptions& options) const {
  std::shared_lock lock(mutex_);
  const ChannelGroup* best = nullptr;
  for (const auto& group : released_) {
    if (group->platform() != platform || group->partition() != partition || group->ordinals() != ordinals ||
        !(group->options() == options)) {
      continue;
    }
    const auto rank = [&](const ChannelGroup* g) { return std::make_pair(g->channel() != channel, g->preparation()); };
    if (best == nullptr || rank(group.get()) < rank(best)) best = group.get();
  }
  return best == nullptr ? std::string() : best->preparation();
}

bool Registry::revive(Platform platform, std::string_view preparation, std::string_view channel) {
  // Out of released_ while it waits, resets and takes its name and
  // generation, outside the lock (registry.h, "the lock"): no other thread
  // finds it meanwhile, and it goes into use only if its devices are still
  // free of the channel then.
  std::unique_ptr<ChannelGroup> group;
  {
    std::unique_lock lock(mutex_);
    const auto it = std::find_if(released_.begin(), released_.end(), [&](const auto& g) {
      return g->platform() == platform && g->preparation() == preparation;
    });
    if (it == released_.end() || !usable_locked(platform, channel, **it)) return false;
    group = std::move(*it);
    released_.erase(it);
  }
  const Parking parking(*this, group);  // unless it goes into use
  if (!group->wait_idle() || !group->reset()) return false;
  const std::string parked_as = group->channel();
  group->set_channel(std::string(channel));
  group->write_generation(next_generation());
  {
    std::unique_lock lock(mutex_);
    if (usable_locked(platform, channel, *group)) {
      forget_refusals(platform, channel, group->partition(), group->ordinals());
      groups_.push_back(std::move(group));
      return true;
    }
  }
  // Another Communicator took its devices meanwhile: add then says so.
  group->set_channel(parked_as);
  group->write_generation(0);
  return false;
}

bool Registry::usable_locked(Platform platform, std::string_view channel, const ChannelGroup& group) const {
  // Not over a live group of its devices (another Communicator's), nor with
  // uneven refusals: add then says so.
  return conflict_locked(platform, channel, group.partition(), group.ordinals()).empty() &&
         uneven_refusals(platform, channel, group.partition(), group.ordinals()).empty();
}

void Registry::retire(Platform platform, std::string_view preparation) {
  std::unique_ptr<ChannelGroup> group;
  {
    std::unique_lock lock(mutex_);
    const auto it = std::find_if(groups_.begin(), groups_.end(), [&](const auto& g) {
      return g->platform() == platform && g->preparation() == preparation;
    });
    if (it == groups_.end()) return;
    group = std::move(*it);
    groups_.erase(it);
  }
  const Parking parking(*this, group);
  group->write_generation(0);  // outside the lock, as in release
}

std::string Registry::local_preparation() {
  std::unique_lock lock(mutex_);
  return "local/" + std::to_string(++local_preparations_);
}

size_t Registry::release(Platform platform, std::string_view channel,
                         const std::vector<std::pair<std::string, std::vector<int>>>& groups) {
  const auto listed = [&groups](const ChannelGroup& group) {
    for (const auto& [partition, ordinals] : groups) {
      if (group.partition() == partition && group.ordinals() == ordinals) return true;
    }
    return false;
  };
  std::vector<std::unique_ptr<ChannelGroup>> releasing;
  {
    std::unique_lock lock(mutex_);
    std::vector<std::unique_ptr<ChannelGroup>> kept;
    for (auto& group : groups_) {
      if (group->platform() == platform && group->channel() == channel && listed(*group)) {
        releasing.push_back(std::move(group));
      } else {
        kept.push_back(std::move(group));
      }
    }
    groups_ = std::move(kept);
  }
  // Outside the lock: waiting for queued work must not keep handlers of
  // other channels from finding theirs. Nor in released_ yet: revive could
  // take a group there and write its new generation before this 0.
  std::string busy;
  {
    const Parking parking(*this, releasing);
    for (const auto& group : releasing) {
      if (!group->wait_idle()) {
        busy += (busy.empty() ? "" : "\n") + busy_message(*group);
      } else {
        group->write_generation(0);  // an executable lowered before stops at its first call
      }
    }
  }
  if (!busy.empty()) throw std::runtime_error(busy);
  return releasing.size();
}

Registry::Parking::~Parking() {
  std::unique_lock lock(registry_.mutex_);
  for (std::unique_ptr<ChannelGroup>* group : groups_) {
    if (*group) registry_.released_.push_back(std::move(*group));
  }
}

uint32_t Registry::next_generation() {
  uint32_t generation;
  do {
    generation = generation_counter_.fetch_add(1) + 1;
  } while (generation == 0);
  return generation;
}

ChannelView base_view(const ChannelOptions& options, int world, int blocks) {
  // Cells round up, so that every payload within a limit fits them at any grid.
  const size_t unit = static_cast<size_t>(blocks) * kPackBytes;
  const auto cell_bytes = [&](size_t bytes) { return (bytes + unit - 1) / unit * kPackBytes; };
  ChannelView view{};
  view.capacity_bytes = options.capacity_bytes;
  view.layout = StagingLayout{cell_bytes(options.capacity_bytes), world, blocks, kStagingSlots};
  // The Lamport window never exceeds the capacity: decided here, for the
  // kernels and for the Python layer alike (payload_limits).
  view.lamport_window = std::min(options.lamport_bytes, options.capacity_bytes);
  view.lamport_layout = StagingLayout{cell_bytes(view.lamport_window), world, blocks, kLamportBuffers};
  view.world = world;
  view.loopback = options.loopback && world == 1 ? 1 : 0;
  view.timeout_ns = static_cast<uint64_t>(options.timeout_s * 1e9);
  view.first_timeout_ns = static_cast<uint64_t>(std::max(options.timeout_s, options.setup_timeout_s) * 1e9);
  return view;
}

namespace {

// "all_reduce of 256 bytes (float32, lamport, grid 1) at site 0x2a (model.py:12
// in layer)": a call tag for a reader.
std::string describe(const CallTag& tag) {
  static const char* const ops[] = {"no call", "all_reduce", "all_reduce_residual_rmsnorm", "dcp_a2a"};
  static const char* const algorithms[] = {"one_shot", "two_shot", "one_shot_pull", "lamport"};
  static const char* const dtypes[] = {"float32", "bfloat16", "float16"};
  const uint32_t op_code = tag_op(tag);
  const std::string op = op_code < 4 ? ops[op_code] : "op " + std::to_string(op_code);
  const std::string dtype = tag_dtype(tag) < 3 ? dtypes[tag_dtype(tag)] : "dtype " + std::to_string(tag_dtype(tag));
  std::string how;
  if (op_code == static_cast<uint32_t>(Op::kDcpA2a)) {
    how = std::to_string(dcp_tag_heads(tag.algorithm)) + " heads of " +
          std::to_string(dcp_tag_row_packs(tag.algorithm) * kPackBytes) + " bytes, lse base " +
          (tag_flags(tag) & kDcpTagBase2 ? "2, " : "e, ") + (dcp_tag_lamport(tag.algorithm) ? "lamport, " : "");
  } else if (op_code == static_cast<uint32_t>(Op::kResidualRmsnorm)) {
    how = "rows of " + std::to_string((tag.algorithm >> 2) * kPackBytes) + " bytes, ";
  } else {
    how = tag.algorithm < 4 ? std::string(algorithms[tag.algorithm]) + ", " : "algorithm " + std::to_string(tag.algorithm) + ", ";
  }
  char site[16];
  std::snprintf(site, sizeof(site), "0x%08x", tag.site);
  const std::string where = site_name(tag.site);
  return op + " of " + std::to_string(static_cast<uint64_t>(tag.packs) * kPackBytes) + " bytes (" + dtype + ", " + how +
         "grid " + std::to_string(tag_grid(tag)) + ") at site " + site + (where.empty() ? "" : " (" + where + ")");
}

std::mutex site_mutex;
std::unordered_map<uint32_t, std::string>& site_names() {
  static auto* names = new std::unordered_map<uint32_t, std::string>();  // never destroyed: handlers may run at exit
  return *names;
}

}  // namespace

void name_site(uint32_t site, std::string name) {
  std::lock_guard lock(site_mutex);
  site_names().emplace(site & kSiteMask, std::move(name));
}

std::string site_name(uint32_t site) {
  std::lock_guard lock(site_mutex);
  const auto it = site_names().find(site);
  return it == site_names().end() ? std::string() : it->second;
}

namespace {
std::mutex device_id_mutex;
std::unordered_map<int64_t, int>& device_ids() {
  static auto* ids = new std::unordered_map<int64_t, int>();  // never destroyed: handlers may run at exit
  return *ids;
}
int64_t device_key(Platform platform, int ordinal) { return static_cast<int64_t>(platform) << 32 | static_cast<uint32_t>(ordinal); }
}  // namespace

void set_device_id(Platform platform, int ordinal, int id) {
  std::lock_guard lock(device_id_mutex);
  device_ids()[device_key(platform, ordinal)] = id;
}

int device_id(Platform platform, int ordinal) {
  std::lock_guard lock(device_id_mutex);
  const auto it = device_ids().find(device_key(platform, ordinal));
  return it == device_ids().end() ? -1 : it->second;
}

std::string timeout_message(const ChannelGroup& group, int rank) {
  const ErrorRecord& record = group.error_record(rank);
  char text[2048];
  if (record.kind == kFailureStale) {
    std::snprintf(text, sizeof(text),
                  "b12x_jax: channel '%s' rank %d: an executable lowered for an earlier preparation of the channel "
                  "(generation %u) ran on its memory (generation %u%s). Its outputs are NaN and the channel is "
                  "poisoned: release it (Communicator.release), prepare it again, and compile the function again "
                  "after the preparation (a jitted function is traced again by itself; an AOT-compiled one is not).",
                  group.channel().c_str(), record.rank, record.epoch, record.channel_generation,
                  record.channel_generation == 0 ? ": released" : "");
  } else if (record.kind == kFailureMismatch && (tag_misplaced(record.expected) || tag_misplaced(record.seen))) {
    const int misplaced = tag_misplaced(record.expected) ? record.rank : record.peer;
    std::snprintf(text, sizeof(text),
                  "b12x_jax: channel '%s' rank %d stopped at epoch %u: rank %d runs %s on another device "
                  "assignment than its module was lowered for (a jax.export module called with its devices at "
                  "other mesh positions), so its group attribute names other peers than its mesh axis has. No data "
                  "was mixed; the channel is poisoned: call the module with the devices "
                  "in the mesh order of its export, or export it again for these devices, then release the "
                  "channel (Communicator.release) and prepare it again.",
                  group.channel().c_str(), record.rank, record.epoch, misplaced,
                  describe(tag_misplaced(record.expected) ? record.expected : record.seen).c_str());
  } else if (record.kind == kFailureMismatch) {
    std::snprintf(text, sizeof(text),
                  "b12x_jax: channel '%s' rank %d expected %s at epoch %u but rank %d was at %s: the ranks run "
                  "different calls on one channel (their programs differ, or two threads dispatched calls in "
                  "different orders: keep one dispatching thread per device group). No data was mixed; the channel is poisoned: release it "
                  "(Communicator.release) and prepare it again.",
                  group.channel().c_str(), record.rank, describe(record.expected).c_str(), record.epoch, record.peer,
                  describe(record.seen).c_str());
  } else if (record.peer_gave_up) {
    std::snprintf(text, sizeof(text),
                  "b12x_jax: channel '%s' rank %d stopped at epoch %u: rank %d gave up on the channel (its own "
                  "wait failed; its error names the rank that did not arrive or ran another call). The channel is poisoned: "
                  "release it (Communicator.release) and prepare it again.",
                  group.channel().c_str(), record.rank, record.epoch, record.peer);
  } else {
    // The first call's bound is setup_timeout_s only where the group spans
    // processes (start-up skew); within one process it is timeout_s.
    bool one_process = true;
    for (int r = 0; r < group.world(); ++r) one_process = one_process && group.is_local(r);
    // XLA:CPU runs the executions of one process's devices on a few threads:
    // with several queued, a peer's can wait behind a blocked one (README, Limits).
    bool cpu_devices = group.platform() == Platform::kHost && one_process;
    // The bound the wait had (base_view's first_timeout_ns for a first call),
    // and the setting that raises it: setup_timeout_s only where it is the larger.
    const ChannelOptions& options = group.options();
    const bool setup_bound = record.first_call && !one_process && options.setup_timeout_s > options.timeout_s;
    std::snprintf(text, sizeof(text),
                  "b12x_jax: channel '%s' rank %d timed out after %.3g s at epoch %u waiting for "
                  "rank %d, which did not arrive%s. The channel is poisoned: release it "
                  "(Communicator.release) and prepare it again; raise %s if the peer is only slow%s.",
                  group.channel().c_str(), record.rank,
                  setup_bound ? options.setup_timeout_s : options.timeout_s, record.epoch,
                  record.peer, record.first_call ? " at the channel's first call" : "",
                  setup_bound ? "setup_timeout_s" : "timeout_s",
                  cpu_devices ? ", and on CPU devices block on each execution's results before the next "
                                "(XLA:CPU's few threads can leave a peer's execution queued behind this one)"
                              : "");
  }
  return text;
}

std::string busy_message(const ChannelGroup& group) {
  return "b12x_jax: channel '" + group.channel() + "' still has calls queued that stopped finishing after it "
         "was taken out of use. Block on the results of its calls before releasing it.";
}

std::string pending_error(const ChannelGroup& group, int rank) {
  // Acquire: the record's fields, written before its state (release, by a
  // kernel or the progress thread), are complete once the state says so.
  if (__atomic_load_n(&group.error_record(rank).state, __ATOMIC_ACQUIRE) != kErrorComplete) return {};
  return timeout_message(group, rank);
}

std::string unprepared_message(std::string_view op, std::string_view channel, int ordinal) {
  return "b12x_jax." + std::string(op) + ": channel '" + std::string(channel) +
         "' is not prepared on device " + std::to_string(ordinal) +
         "; prepare it before running (b12x_jax.get_communicator().prepare(mesh, axis_name, "
         "channels=['" + std::string(channel) + "']))";
}

}  // namespace b12x
