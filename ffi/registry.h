// Process-wide table of prepared channels.
//
// Preparation (Python, before any execution) adds a group: the ranks of one
// channel over one set of devices. Handlers look up their rank's view by
// (platform, channel name, device ordinal); they never allocate (DESIGN C4).
#pragma once

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <vector>

#include "channel.h"

namespace b12x {

enum class Platform : int { kHost = 0, kCuda = 1 };

// The memory of one channel on every rank of one group in this process.
// Subclasses own the memory and free it in their destructor, which runs only
// on an explicit release (DESIGN C11: nothing is freed behind a peer's back).
class ChannelGroup {
 public:
  ChannelGroup(std::string channel, Platform platform, std::vector<int> ordinals, double timeout_s)
      : channel_(std::move(channel)), platform_(platform), ordinals_(std::move(ordinals)),
        timeout_s_(timeout_s) {}
  virtual ~ChannelGroup() = default;

  const std::string& channel() const { return channel_; }
  Platform platform() const { return platform_; }
  const std::vector<int>& ordinals() const { return ordinals_; }
  double timeout_s() const { return timeout_s_; }
  const ChannelView& view(int rank) const { return views_[rank]; }
  int world() const { return static_cast<int>(ordinals_.size()); }

  // Host-readable copies of rank `rank`'s state, for stats and errors.
  virtual uint32_t read_epoch(int rank) const = 0;
  virtual bool read_poisoned(int rank) const = 0;
  const ErrorRecord& error_record(int rank) const { return *host_errors_[rank]; }

 protected:
  std::string channel_;
  Platform platform_;
  std::vector<int> ordinals_;
  double timeout_s_;
  std::vector<ChannelView> views_;
  std::vector<ErrorRecord*> host_errors_;
};

struct RankHandle {
  const ChannelGroup* group = nullptr;
  int rank = -1;
  explicit operator bool() const { return group != nullptr; }
  const ChannelView& view() const { return group->view(rank); }
};

class Registry {
 public:
  static Registry& get();

  // Takes ownership; fails (returns a message) if a device of the group
  // already serves this channel in another group.
  std::string add(std::unique_ptr<ChannelGroup> group);
  RankHandle find(Platform platform, std::string_view channel, int ordinal) const;
  // Removes and returns every group of `channel` on `platform`.
  std::vector<std::unique_ptr<ChannelGroup>> take(Platform platform, std::string_view channel);
  std::vector<const ChannelGroup*> groups() const;

 private:
  mutable std::shared_mutex mutex_;
  std::vector<std::unique_ptr<ChannelGroup>> groups_;
};

// "b12x_jax: channel 'x' rank r timed out ..." for a complete record.
std::string timeout_message(const ChannelGroup& group, int rank);
// Set when `rank`'s record is complete: the message for it.
std::string pending_error(const ChannelGroup& group, int rank);
std::string unprepared_message(std::string_view op, std::string_view channel, int ordinal);

}  // namespace b12x
