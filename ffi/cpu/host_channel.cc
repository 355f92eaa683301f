#include "host_channel.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

#include "../lamport.h"
#include "../protocol.h"
#include "host_memory.h"
#include "progress.h"

namespace b12x {
namespace {

class HostGroup final : public ChannelGroup {
 public:
  HostGroup(const std::string& channel, std::vector<int> ordinals, const ChannelOptions& options)
      : ChannelGroup(channel, Platform::kHost, std::move(ordinals), options) {
    const int world = this->world();
    ChannelView view = host_base_view(options, world);
    for (int r = 0; r < world; ++r) {
      view.signals[r] = static_cast<Signal*>(filled(sizeof(Signal), 0));
      view.staging[r] = static_cast<char*>(filled(view.layout.total_bytes(), 0));
      if (view.lamport_layout.lamport_region_bytes() > 0) {
        view.lamport[r] = static_cast<char*>(filled(view.lamport_layout.lamport_region_bytes(), kLamportEmptyByte));
      }
      host_errors_.push_back(static_cast<ErrorRecord*>(filled(sizeof(ErrorRecord), 0)));
    }
    for (int r = 0; r < world; ++r) {
      view.rank = r;
      view.error = host_errors_[r];
      views_.push_back(view);
    }
  }

  ~HostGroup() override {
    for (const Allocation& a : allocations_) std::free(a.p);
  }

  bool reset() override {
    for (const Allocation& a : allocations_) std::memset(a.p, a.fill, a.bytes);
    return true;
  }

  uint32_t read_calls(int rank) const override { return read_host_calls(views_[rank]); }
  bool read_poisoned(int rank) const override { return read_host_poisoned(views_[rank]); }
  bool wait_idle() const override { return wait_host_calls(this, host_idle_bound_s(options_)); }
  void start_counters(uint32_t calls) const override { start_host_counters(*this, calls); }

 private:
  struct Allocation {
    void* p;
    size_t bytes;
    int fill;  // the byte it was allocated with (and is reset to)
  };

  void* filled(size_t bytes, int fill) {
    const size_t rounded = (bytes + 127) / 128 * 128;
    void* p = std::aligned_alloc(128, rounded);
    if (p == nullptr) throw std::bad_alloc();
    allocations_.push_back({p, rounded, fill});
    std::memset(p, fill, rounded);
    return p;
  }

  std::vector<Allocation> allocations_;
};

}  // namespace

ChannelView host_base_view(const ChannelOptions& options, int world) { return base_view(options, world, 1); }

uint32_t read_host_calls(const ChannelView& v) {
  const Signal* own = v.signals[v.rank];
  return HostMem::load_relaxed(&own->counter[0][epoch_peer(v.rank, v.world)]) + HostMem::load_relaxed(&own->lamport_calls[0]);
}

void start_host_counters(const ChannelGroup& group, uint32_t calls) {
  if (!wait_host_calls(&group, host_idle_bound_s(group.options()))) {
    throw std::runtime_error("b12x_jax: start_counters on channel '" + group.channel() + "' with calls still queued");
  }
  for (int r = 0; r < group.world(); ++r) {
    if (group.is_local(r)) start_signal_counters(*group.view(r).signals[r], calls);
  }
}

bool read_host_poisoned(const ChannelView& v) { return HostMem::load_relaxed(&v.signals[v.rank]->poisoned) != 0; }

std::unique_ptr<ChannelGroup> make_host_group(const std::string& channel, std::vector<int> ordinals,
                                              const ChannelOptions& options) {
  return std::make_unique<HostGroup>(channel, std::move(ordinals), options);
}

}  // namespace b12x
