// Process-wide table of prepared channels.
//
// Preparation (Python, before any execution) adds a group: the ranks of one
// channel over one set of devices. Handlers look up their rank's view by
// (platform, channel name, device ordinal); they never allocate (DESIGN C4).
// A group may span processes (one process per GPU, jax.distributed): this
// process then holds some of its ranks and has opened the others' memory.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "channel.h"

namespace b12x {

enum class Platform : int { kHost = 0, kCuda = 1 };

// What the Python Communicator asks of a channel when it prepares it.
struct ChannelOptions {
  size_t capacity_bytes = 0;  // largest payload of one call (barrier staging, per slot)
  size_t lamport_bytes = 0;   // payloads up to this take the Lamport exchange (0: never)
  double timeout_s = 10.0;    // bound on every wait for a peer (DESIGN C8)
  double setup_timeout_s = 60.0;  // bound on the waits of a channel's first call (start-up skew)
  int max_blocks = 0;         // largest CUDA grid; 0: min(kMaxBlocks, SM count)
  bool poison_outputs = false;  // debug: fill outputs with NaN before a kernel writes them
  bool loopback = false;      // a group of one device runs the protocol with itself (docs/DESIGN.md, "Loopback")

  bool operator==(const ChannelOptions& o) const {
    return capacity_bytes == o.capacity_bytes && lamport_bytes == o.lamport_bytes && timeout_s == o.timeout_s &&
           setup_timeout_s == o.setup_timeout_s && max_blocks == o.max_blocks && poison_outputs == o.poison_outputs &&
           loopback == o.loopback;
  }
};

// The view every rank of a group starts from, before any pointer is set:
// staging and Lamport layouts with `blocks` cells per source (the largest
// CUDA grid, or 1 on the host backend), and the timeout. Every transport
// derives its layout here, so equal options give equal layouts everywhere.
ChannelView base_view(const ChannelOptions& options, int world, int blocks);

// Ordinal of a rank that another process holds.
inline constexpr int kRemoteRank = -1;

// The memory of one channel on every rank of one group, as this process
// sees it. `ordinals[r]` is rank r's device in this process, or kRemoteRank
// for a rank another process holds; views and error records exist for local
// ranks only, and a local rank's view points at every rank's memory (local
// allocations and imports). Subclasses own the memory and free it in their
// destructor, which runs only for a group that never served a handler (a
// rolled-back preparation): an installed group's memory lives as long as the
// process, since executables and CUDA graphs keep its pointers (DESIGN C16).
class ChannelGroup {
 public:
  // Throws std::invalid_argument, before a transport allocates anything,
  // for a group its per-rank arrays (kMaxRanks) or sizes cannot hold.
  ChannelGroup(std::string channel, Platform platform, std::vector<int> ordinals, ChannelOptions options)
      : channel_(std::move(channel)), platform_(platform), ordinals_(std::move(ordinals)),
        options_(options) {
    if (ordinals_.empty() || ordinals_.size() > static_cast<size_t>(kMaxRanks)) {
      throw std::invalid_argument("a channel group has 1 to " + std::to_string(kMaxRanks) + " ranks, got " +
                                  std::to_string(ordinals_.size()));
    }
    if (options_.capacity_bytes > kMaxCapacityBytes) {
      throw std::invalid_argument("capacity_bytes is at most " + std::to_string(kMaxCapacityBytes) + ", got " +
                                  std::to_string(options_.capacity_bytes));
    }
  }
  virtual ~ChannelGroup() = default;

  const std::string& channel() const { return channel_; }
  // The partition of devices along a mesh axis this group is one group of
  // (the global device ids of every group, "0,1;2,3"): a channel name serves
  // any number of partitions, each device in at most one group of each
  // (DESIGN C18). The custom call names it in its `group` attribute.
  const std::string& partition() const { return partition_; }
  void set_partition(std::string partition) { partition_ = std::move(partition); }
  // Which preparation allocated this memory: the name every process of a
  // shared group gives it (rendezvous.py), or one of this process. A
  // released group is reused under it (Registry::revive), also renamed.
  const std::string& preparation() const { return preparation_; }
  void set_preparation(std::string preparation) { preparation_ = std::move(preparation); }
  void set_channel(std::string channel) { channel_ = std::move(channel); }
  Platform platform() const { return platform_; }
  const std::vector<int>& ordinals() const { return ordinals_; }
  const ChannelOptions& options() const { return options_; }
  const ChannelView& view(int rank) const { return views_[rank]; }
  int world() const { return static_cast<int>(ordinals_.size()); }
  bool is_local(int rank) const { return ordinals_[rank] != kRemoteRank; }

  // Unmaps the memory opened from other processes, after waiting for this
  // process's work on the channel. Peers free their exports only once every
  // rank did this (communicator.py runs it between two collective
  // barriers). Nothing to do for a group held by one process.
  virtual void close_imports() {}

  // Puts a released group back into its freshly prepared state (zero
  // counters, empty buffers, no error) for a new preparation on the same
  // devices and options; false for a transport that cannot. Only called
  // once wait_idle() said no work of this process can touch the memory; in
  // a group shared with other processes, each resets its own ranks before
  // a collective verdict (rendezvous.py), so no peer writes into it before.
  virtual bool reset() { return false; }

  // Waits, bounded, until no work of this process queued before the group
  // was taken out of use can still touch its memory; false if some still
  // can (the caller must then keep the memory). Host groups wait for the
  // progress thread (cpu/progress.h); CUDA groups synchronise their devices
  // when they close or free instead.
  virtual bool wait_idle() const { return true; }

  // Host-readable copies of rank `rank`'s state, for stats and errors.
  // read_calls: collectives block 0 of the rank completed (every call has a
  // block 0), barrier and Lamport calls together.
  virtual uint32_t read_calls(int rank) const = 0;
  virtual bool read_poisoned(int rank) const = 0;
  // Test hook (docs/DESIGN.md, "Wrap"): sets every local rank's counters,
  // flags and Lamport state as if `calls` calls had run (protocol.h
  // start_signal_counters). Only right before any call on the channel, on
  // every process of the group.
  virtual void start_counters(uint32_t calls) const = 0;
  const ErrorRecord& error_record(int rank) const { return *host_errors_[rank]; }
  // Writes `generation` into every local rank's Signal::generation and
  // view (the Registry's, at preparation and release; docs/DESIGN.md,
  // "Lifetime"): a kernel compares the two. Only while no call of the
  // channel runs.
  void write_generation(uint32_t generation) {
    store_generation(generation);
    for (int r = 0; r < world(); ++r) {
      if (is_local(r)) views_[r].generation = generation;
    }
    generation_ = generation;
  }
  uint32_t generation() const { return generation_; }

 protected:
  // The Signal words of write_generation: host memory by default.
  virtual void store_generation(uint32_t generation) {
    for (int r = 0; r < world(); ++r) {
      if (is_local(r)) __atomic_store_n(&views_[r].signals[r]->generation, generation, __ATOMIC_RELEASE);
    }
  }

  std::string channel_;
  std::string partition_;
  std::string preparation_;
  Platform platform_;
  std::vector<int> ordinals_;
  ChannelOptions options_;
  std::vector<ChannelView> views_;
  std::vector<ErrorRecord*> host_errors_;
  uint32_t generation_ = 0;
};

struct RankHandle {
  const ChannelGroup* group = nullptr;
  int rank = -1;
  explicit operator bool() const { return group != nullptr; }
  const ChannelView& view() const { return group->view(rank); }
};

// A rank found for one handler call, holding the registry's shared lock
// until the handler has launched or queued its work: a release (which takes
// the lock exclusively, then waits for queued work) cannot free the group
// between the lookup and the launch.
struct RankLease : RankHandle {
  std::shared_lock<std::shared_mutex> lock;
};

class Registry {
 public:
  static Registry& get();

  // Takes ownership; fails (returns a message) if a device of the group
  // already serves this channel in another group.
  std::string add(std::unique_ptr<ChannelGroup> group);
  // The preparation of a released group that a new preparation of `channel`
  // on exactly this partition, ordinals and options can reuse: one of
  // `channel` first, else one of another name (renamed when revived), the
  // smallest preparation name among them (every process of a shared group
  // holds the same ones, so all pick the same). Empty if none.
  std::string reusable(Platform platform, std::string_view channel, std::string_view partition,
                       const std::vector<int>& ordinals, const ChannelOptions& options) const;
  // Puts the released group of `preparation` back into use as `channel`,
  // reset (ChannelGroup::reset), under a fresh generation; false if it is
  // gone, busy, cannot reset or would serve devices a live group of the
  // channel serves.
  bool revive(Platform platform, std::string_view preparation, std::string_view channel);
  // Takes the group of `preparation` out of use again (a collective
  // preparation that failed after this process revived it).
  void retire(Platform platform, std::string_view preparation);
  // A preparation name of this process, for a group no other process holds.
  std::string local_preparation();
  // The rank of device `ordinal` in the group of `channel` over `partition`
  // (empty: the first group of the channel with that device).
  RankHandle find(Platform platform, std::string_view channel, std::string_view partition, int ordinal) const;
  // find, for a handler: see RankLease. A host call that finds no group is
  // counted as refused on its device (refusals).
  RankLease lease(Platform platform, std::string_view channel, std::string_view partition, int ordinal) const;
  // find, holding the shared lock as lease does, counting nothing: for a
  // caller that reads more than one thing of the group (kernel_view).
  RankLease hold(Platform platform, std::string_view channel, std::string_view partition, int ordinal) const;
  // How many host calls of `channel` over `partition` were refused as not
  // prepared on each of `ordinals` since a group of them last went into use
  // (0 for a remote rank), and whether they are even. XLA:CPU runs every
  // execution on every device of a group, so counts that differ mean that
  // an execution refused on some devices is still on its way to the others:
  // a group put into use before it gets there would serve it, beside its
  // peers' next call (docs/DESIGN.md, "Lifetime"). add and revive put a
  // host group into use only where they are even, and forget them. Even
  // also where they are as uneven as forgive_refusals found them.
  std::pair<bool, std::vector<uint64_t>> refusals(Platform platform, std::string_view channel,
                                                  std::string_view partition, const std::vector<int>& ordinals) const;
  // Counts the devices behind as even at their present counts (a
  // preparation reported them uneven for longer than its timeout): the
  // execution they wait for may have failed before its call on them.
  void forgive_refusals(Platform platform, std::string_view channel, std::string_view partition,
                        const std::vector<int>& ordinals) const;
  // Takes the groups of `channel` on `platform` over `groups` (partition,
  // ordinals: a Communicator's own; another may hold the channel on other
  // devices) out of use (handlers no longer find them) and waits until no
  // queued work can touch them. Their memory stays, for the life of the
  // process (DESIGN C16): a cached executable or CUDA graph may still point
  // at it, and a later preparation of the same group reuses it. Returns how
  // many groups it released; throws std::runtime_error naming the groups
  // whose work is still queued.
  size_t release(Platform platform, std::string_view channel,
                 const std::vector<std::pair<std::string, std::vector<int>>>& groups);
  // Calls `visit(group, released)` for every installed group, then every
  // released one (only a stale executable, one lowered before the release,
  // can still record an error in those), under the shared lock: a group's
  // name and generation change only while it is in neither list (revive).
  template <class Visit>
  void for_each_group(Visit visit) const {
    std::shared_lock lock(mutex_);
    for (const auto& group : groups_) visit(*group, false);
    for (const auto& group : released_) visit(*group, true);
  }

 private:
  // A fresh Signal::generation, never 0 (0: released).
  uint32_t next_generation();
  std::atomic<uint32_t> generation_counter_{0};
  // Whether `group` may go into use as `channel` (under the lock): no live
  // group serves the channel on its devices and their refusals are even.
  bool usable_locked(Platform platform, std::string_view channel, const ChannelGroup& group) const;
  // Parks the groups it holds (those still held when it goes: a revived
  // group that went into use is not) in released_, however the work done
  // on them outside the lock ends, a throw included: a group a handler may
  // have seen is never freed (DESIGN C16).
  class Parking {
   public:
    Parking(Registry& registry, std::unique_ptr<ChannelGroup>& group) : registry_(registry), groups_{&group} {}
    Parking(Registry& registry, std::vector<std::unique_ptr<ChannelGroup>>& groups) : registry_(registry) {
      for (auto& group : groups) groups_.push_back(&group);
    }
    Parking(const Parking&) = delete;
    Parking& operator=(const Parking&) = delete;
    ~Parking();

   private:
    Registry& registry_;
    std::vector<std::unique_ptr<ChannelGroup>*> groups_;
  };
  uint64_t local_preparations_ = 0;
  RankHandle find_locked(Platform platform, std::string_view channel, std::string_view partition, int ordinal) const;
  // Why a group of `channel` over `partition` on `ordinals` cannot go into
  // use (a device of it serves the channel in a live group), or empty.
  std::string conflict_locked(Platform platform, std::string_view channel, std::string_view partition,
                              const std::vector<int>& ordinals) const;

  // Why a host group on `ordinals` cannot go into use yet (refusals not
  // even), or empty; forget_refusals once it goes.
  std::string uneven_refusals(Platform platform, std::string_view channel, std::string_view partition,
                              const std::vector<int>& ordinals) const;
  void forget_refusals(Platform platform, std::string_view channel, std::string_view partition,
                       const std::vector<int>& ordinals) const;

  // The lock: shared by handlers (lease) and lookups, exclusive while the
  // lists change. Nothing that synchronises a device or waits for queued
  // work runs under it (write_generation, reset, wait_idle): with several
  // GPUs in one process, a handler of another channel's call, whose peer
  // kernel already waits on another GPU, would wait behind it, and that
  // peer could time out.
  mutable std::shared_mutex mutex_;
  // Per (platform, channel, partition), per device: refused calls, and how
  // many fewer forgive_refusals found than the most. Taken after mutex_,
  // never before.
  struct Refused {
    uint64_t calls = 0;
    uint64_t forgiven = 0;
  };
  mutable std::mutex refusals_mutex_;
  mutable std::map<std::tuple<Platform, std::string, std::string>, std::map<int, Refused>> refused_;
  std::vector<std::unique_ptr<ChannelGroup>> groups_;
  std::vector<std::unique_ptr<ChannelGroup>> released_;
};

// Where the calls of a site (channel.h CallTag::site) stand in their
// program, as the Python layer traced them ("model.py:12 in layer"): error
// messages name a call by it. A site this process never traced has none.
void name_site(uint32_t site, std::string name);
std::string site_name(uint32_t site);

// The global id (jax's Device.id) of this process's device `ordinal` of
// `platform`, as the Python layer registered it with the FFI targets; -1
// for one it did not. A call of an exported module compares it with the
// device its module expects there (channel.h Placement).
void set_device_id(Platform platform, int ordinal, int id);
int device_id(Platform platform, int ordinal);

// "b12x_jax: channel 'x' rank r timed out ..." for a complete record.
std::string timeout_message(const ChannelGroup& group, int rank);
// Set when `rank`'s record is complete: the message for it.
std::string pending_error(const ChannelGroup& group, int rank);
// Why a group that is not idle (ChannelGroup::wait_idle) keeps its memory.
std::string busy_message(const ChannelGroup& group);
std::string unprepared_message(std::string_view op, std::string_view channel, int ordinal);

}  // namespace b12x
