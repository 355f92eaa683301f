#include "host_channel.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include <unistd.h>

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
    const size_t staging_bytes = view.layout.total_bytes();
    const size_t lamport_bytes = view.lamport_layout.lamport_region_bytes();
    refuse_beyond_memory(channel, world, staging_bytes,
                         world * (rounded(sizeof(Signal)) + rounded(staging_bytes) + rounded(lamport_bytes) +
                                  rounded(sizeof(ErrorRecord))));
    for (int r = 0; r < world; ++r) {
      view.signals[r] = static_cast<Signal*>(filled(sizeof(Signal), 0));
      view.staging[r] = static_cast<char*>(filled(staging_bytes, 0));
      if (lamport_bytes > 0) view.lamport[r] = static_cast<char*>(filled(lamport_bytes, kLamportEmptyByte));
      host_errors_.push_back(static_cast<ErrorRecord*>(filled(sizeof(ErrorRecord), 0)));
    }
    for (int r = 0; r < world; ++r) {
      view.rank = r;
      view.error = host_errors_[r];
      views_.push_back(view);
    }
  }

  bool reset() override {
    for (const Allocation& a : allocations_) std::memset(a.p.get(), a.fill, a.bytes);
    return true;
  }

  uint32_t read_calls(int rank) const override { return read_host_calls(views_[rank]); }
  bool read_poisoned(int rank) const override { return read_host_poisoned(views_[rank]); }
  bool wait_idle() const override { return wait_host_calls(this, host_idle_bound_s(options_)); }
  void start_counters(uint32_t calls) const override { start_host_counters(*this, calls); }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  // Owned, so that a constructor that throws part way frees what it took.
  struct Allocation {
    std::unique_ptr<void, Free> p;
    size_t bytes;
    int fill;  // the byte it was allocated with (and is reset to)
  };

  static size_t rounded(size_t bytes) { return (bytes + 127) / 128 * 128; }

  // Every rank's memory lives in this process and is filled at once: a
  // group beyond what the process can have would be ended by the OOM killer
  // part way through, so it is refused with the fix instead.
  static void refuse_beyond_memory(const std::string& channel, int world, size_t staging_bytes, size_t needed) {
    const size_t usable = usable_memory();
    if (needed <= usable) return;
    const auto gib = [](size_t bytes) {
      char text[32];
      std::snprintf(text, sizeof(text), "%.1f GiB", static_cast<double>(bytes) / (1u << 30));
      return std::string(text);
    };
    throw std::invalid_argument("channel '" + channel + "' on the CPU backend needs " + gib(needed) +
                                " of host memory for its " + std::to_string(world) + " ranks (" +
                                std::to_string(staging_bytes) + " bytes of staging each: capacity_bytes x " +
                                std::to_string(world) + " sources x 2 slots), more than the " + gib(usable) +
                                " this process can have now (the machine's available memory, within its cgroup's "
                                "limit): lower capacity_bytes");
  }

  // The least of: the machine's memory, what it has available now
  // (/proc/meminfo MemAvailable), and what is left of a cgroup v2 limit.
  // A source that cannot be read does not count.
  static size_t usable_memory() {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    size_t usable = pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : SIZE_MAX;
    const auto fewer = [&usable](unsigned long long bytes) { usable = bytes < usable ? bytes : usable; };
    if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
      char line[128];
      unsigned long long kib = 0;
      while (std::fgets(line, sizeof(line), f)) {
        if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) fewer(kib * 1024);
      }
      std::fclose(f);
    }
    unsigned long long limit = 0, current = 0;
    if (read_number("/sys/fs/cgroup/memory.max", limit) && read_number("/sys/fs/cgroup/memory.current", current)) {
      fewer(limit > current ? limit - current : 0);
    }
    return usable;
  }

  // The number a one-line file holds; false where it cannot be read or
  // holds none ("max": no limit).
  static bool read_number(const char* path, unsigned long long& value) {
    std::FILE* f = std::fopen(path, "r");
    if (f == nullptr) return false;
    const bool read = std::fscanf(f, "%llu", &value) == 1;
    std::fclose(f);
    return read;
  }

  void* filled(size_t bytes, int fill) {
    const size_t size = rounded(bytes);
    std::unique_ptr<void, Free> p(std::aligned_alloc(128, size));
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p.get(), fill, size);
    allocations_.push_back({std::move(p), size, fill});
    return allocations_.back().p.get();
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
