#include "host_channel.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <utility>

#include "../protocol.h"
#include "host_memory.h"
#include "progress.h"

namespace b12x {
namespace {

size_t rounded(size_t bytes) { return (bytes + 127) / 128 * 128; }

class HostGroup final : public ChannelGroup {
 public:
  HostGroup(const std::string& channel, std::vector<int> ordinals, const ChannelOptions& options)
      : ChannelGroup(channel, Platform::kHost, std::move(ordinals), options) {
    const int world = this->world();
    ChannelView view = host_base_view(options, world);
    for (int r = 0; r < world; ++r) {
      view.signals[r] = static_cast<Signal*>(zeroed(sizeof(Signal)));
      view.staging[r] = static_cast<char*>(zeroed(view.layout.total_bytes()));
      host_errors_.push_back(static_cast<ErrorRecord*>(zeroed(sizeof(ErrorRecord))));
    }
    for (int r = 0; r < world; ++r) {
      view.rank = r;
      view.error = host_errors_[r];
      views_.push_back(view);
    }
  }

  ~HostGroup() override {
    for (const auto& [p, bytes] : allocations_) std::free(p);
  }

  bool reset() override {
    for (const auto& [p, bytes] : allocations_) std::memset(p, 0, bytes);
    return true;
  }

  uint32_t read_calls(int rank) const override { return read_host_calls(views_[rank]); }
  bool read_poisoned(int rank) const override { return read_host_poisoned(views_[rank]); }
  bool wait_idle() const override { return wait_host_calls(this, host_idle_bound_s(options_)); }

 private:
  void* zeroed(size_t bytes) {
    void* p = std::aligned_alloc(128, rounded(bytes));
    if (p == nullptr) throw std::bad_alloc();
    allocations_.emplace_back(p, rounded(bytes));
    std::memset(p, 0, rounded(bytes));
    return p;
  }

  std::vector<std::pair<void*, size_t>> allocations_;  // every allocation, with its size
};

}  // namespace

ChannelView host_base_view(ChannelOptions options, int world) {
  options.lamport_bytes = 0;
  return base_view(options, world, 1);
}

uint32_t read_host_calls(const ChannelView& v) {
  return HostMem::load_relaxed(&v.signals[v.rank]->counter[0][epoch_peer(v.rank)]);
}

bool read_host_poisoned(const ChannelView& v) { return HostMem::load_relaxed(&v.signals[v.rank]->poisoned) != 0; }

std::unique_ptr<ChannelGroup> make_host_group(const std::string& channel, std::vector<int> ordinals,
                                              const ChannelOptions& options) {
  return std::make_unique<HostGroup>(channel, std::move(ordinals), options);
}

}  // namespace b12x
