#include "shm_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "../lamport.h"
#include "host_channel.h"
#include "progress.h"

namespace b12x {
namespace {

std::runtime_error posix_error(const std::string& what, const std::string& name) {
  return std::runtime_error(what + "('" + name + "') failed: " + std::strerror(errno));
}

// A segment's layout: the Signal first (its size keeps the 128-byte
// alignment), the staging region after it, then the Lamport region (cells
// are multiples of 16 bytes, so it stays 16-byte aligned).
size_t segment_bytes(const ChannelView& v) {
  return sizeof(Signal) + v.layout.total_bytes() + v.lamport_layout.lamport_region_bytes();
}

class ShmGroup final : public SharedGroup {
 public:
  ShmGroup(const std::string& channel, std::vector<int> ordinals, const ChannelOptions& options)
      : SharedGroup(channel, Platform::kHost, std::move(ordinals), options) {
    const int world = this->world();
    const ChannelView view = host_base_view(options, world);
    bytes_ = segment_bytes(view);
    lamport_offset_ = sizeof(Signal) + view.layout.total_bytes();
    has_lamport_ = view.lamport_layout.lamport_region_bytes() > 0;
    views_.assign(world, view);
    host_errors_.assign(world, nullptr);
    names_.assign(world, std::string());
    try {
      for (int r = 0; r < world; ++r) {
        if (!is_local(r)) continue;
        // O_EXCL: never attach to a stale segment (a name left by a process
        // that died, whose pid this one has: the next name); posix_fallocate
        // zero-fills it. The name is ours, to unlink, only once created.
        std::string name;
        int fd = -1;
        for (int attempt = 0; fd < 0 && attempt < kNameAttempts; ++attempt) {
          name = unique_name(r);
          fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
          if (fd < 0 && errno != EEXIST) break;
        }
        if (fd < 0) throw posix_error("shm_open", name);
        names_[r] = name;
        // Its pages reserved, not only its size set: in a /dev/shm too
        // small for it (Docker gives 64 MiB) the first touch of a page it
        // cannot back would raise SIGBUS, at this memset or mid-call.
        int reserved = EINTR;
        while (reserved == EINTR) reserved = posix_fallocate(fd, 0, static_cast<off_t>(bytes_));
        void* base = reserved == 0 ? map(fd) : MAP_FAILED;
        close(fd);
        if (reserved != 0) {
          shm_unlink(names_[r].c_str());
          if (reserved == ENOSPC || reserved == ENOMEM) throw no_room_error(channel, r, reserved);
          errno = reserved;  // posix_fallocate returns its error, leaving errno as it was
          throw posix_error("posix_fallocate", names_[r]);
        }
        if (base == MAP_FAILED) {
          shm_unlink(names_[r].c_str());
          throw posix_error("mmap", names_[r]);
        }
        exports_.push_back(base);
        // Every Lamport word starts empty, before any peer can open it.
        std::memset(static_cast<char*>(base) + lamport_offset_, kLamportEmptyByte, bytes_ - lamport_offset_);
        place(r, base);
        host_errors_[r] = new ErrorRecord{};
        views_[r].rank = r;
        views_[r].error = host_errors_[r];
      }
    } catch (...) {
      free_all();
      throw;
    }
  }

  ~ShmGroup() override { free_all(); }

  std::string exported(int rank) const override { return names_[rank]; }

  void open(int rank, const std::string& name) override {
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) throw posix_error("shm_open", name);
    struct stat st {};
    const bool fits = fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes_;
    void* base = fits ? map(fd) : MAP_FAILED;
    close(fd);
    if (!fits) {
      throw std::runtime_error("shared-memory segment '" + name + "' of rank " + std::to_string(rank) +
                               " has another size than this rank's (channel options differ between processes?)");
    }
    if (base == MAP_FAILED) throw posix_error("mmap", name);
    imports_.push_back(base);
    place(rank, base);
  }

  // The segments stay mapped; the names only served the exchange. Unlinked
  // now, nothing is left in /dev/shm if a process dies later.
  void drop_names() override { unlink_all(); }

  // This process's segments as they were created (the imports are peers'
  // to reset).
  bool reset() override {
    for (void* base : exports_) {
      std::memset(base, 0, lamport_offset_);
      std::memset(static_cast<char*>(base) + lamport_offset_, kLamportEmptyByte, bytes_ - lamport_offset_);
    }
    for (ErrorRecord* record : host_errors_) {
      if (record != nullptr) *record = ErrorRecord{};
    }
    return true;
  }

  void close_imports() override {
    for (void* p : imports_) munmap(p, bytes_);
    imports_.clear();
  }

  uint32_t read_calls(int rank) const override { return read_host_calls(views_[rank]); }
  bool read_poisoned(int rank) const override { return read_host_poisoned(views_[rank]); }
  bool wait_idle() const override { return wait_host_calls(this, host_idle_bound_s(options_)); }
  void start_counters(uint32_t calls) const override { start_host_counters(*this, calls); }

 private:
  // Names tried before a preparation gives up on stale ones.
  static constexpr int kNameAttempts = 64;

  // "/b12x.<pid>.<n>.r<rank>": unique on the host while this process lives.
  static std::string unique_name(int rank) {
    static std::atomic<unsigned> next{0};
    return "/b12x." + std::to_string(getpid()) + "." + std::to_string(next++) + ".r" + std::to_string(rank);
  }

  // Why rank `rank`'s segment could not be reserved, and the fix.
  std::runtime_error no_room_error(const std::string& channel, int rank, int error) const {
    const auto mib = [](unsigned long long bytes) { return std::to_string(bytes >> 20) + " MiB"; };
    struct statvfs fs {};
    const std::string room = statvfs("/dev/shm", &fs) == 0
                                 ? ", " + mib(static_cast<unsigned long long>(fs.f_bavail) * fs.f_frsize) + " free there"
                                 : "";
    return std::runtime_error("channel '" + channel + "': rank " + std::to_string(rank) + "'s shared-memory segment of " +
                              mib(bytes_) + " does not fit in /dev/shm (" + std::strerror(error) + room +
                              "): lower capacity_bytes (staging is capacity_bytes x ranks x 2 slots a rank) or give "
                              "/dev/shm more room (docker run --shm-size)");
  }

  void* map(int fd) const { return mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0); }

  // Points every local view at rank `rank`'s segment.
  void place(int rank, void* base) {
    for (ChannelView& v : views_) {
      v.signals[rank] = static_cast<Signal*>(base);
      v.staging[rank] = static_cast<char*>(base) + sizeof(Signal);
      v.lamport[rank] = has_lamport_ ? static_cast<char*>(base) + lamport_offset_ : nullptr;
    }
  }

  void unlink_all() {
    for (std::string& name : names_) {
      if (!name.empty()) shm_unlink(name.c_str());
      name.clear();
    }
  }

  void free_all() {
    close_imports();
    for (void* p : exports_) munmap(p, bytes_);
    exports_.clear();
    unlink_all();
    for (ErrorRecord*& record : host_errors_) {
      delete record;
      record = nullptr;
    }
  }

  size_t bytes_ = 0;           // of one segment, equal on every rank
  size_t lamport_offset_ = 0;  // where its Lamport region starts
  bool has_lamport_ = false;
  std::vector<std::string> names_;  // per rank: the local segments' names until opened everywhere
  std::vector<void*> exports_;      // local segments
  std::vector<void*> imports_;      // remote ranks' segments
};

}  // namespace

std::unique_ptr<SharedGroup> make_shm_group(const std::string& channel, std::vector<int> ordinals,
                                            const ChannelOptions& options) {
  return std::make_unique<ShmGroup>(channel, std::move(ordinals), options);
}

void unlink_shm_export(const std::string& exported) {
  if (exported.rfind("/b12x.", 0) == 0 && exported.find('/', 1) == std::string::npos) shm_unlink(exported.c_str());
}

}  // namespace b12x
