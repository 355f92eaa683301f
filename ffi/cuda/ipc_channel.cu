#include "ipc_channel.h"

#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda_channel.h"
#include "cuda_memory.cuh"
#include "../lamport.h"

namespace b12x {
namespace {

// The regions of one rank, in the order of an export: signals, staging,
// Lamport buffers (a zero handle where the Lamport path is off).
enum Region : int { kSignals = 0, kStaging = 1, kLamport = 2, kRegions = 3 };

class IpcGroup final : public SharedGroup {
 public:
  IpcGroup(const std::string& channel, std::vector<int> ordinals, const ChannelOptions& options, int local)
      : SharedGroup(channel, Platform::kCuda, std::move(ordinals), options), local_(local) {
    DeviceGuard guard;
    const int world = this->world();
    // The same layouts as a one-process CudaGroup (the rendezvous frame
    // checks that every rank derived the same).
    ChannelView view = base_view(options, world, options.max_blocks);
    view.rank = local;
    views_.assign(world, view);
    host_errors_.assign(world, nullptr);
    B12X_CUDA_CHECK(cudaSetDevice(ordinals_[local]));
    try {
      const size_t bytes[kRegions] = {sizeof(Signal), view.layout.total_bytes(), view.lamport_layout.lamport_region_bytes()};
      const int fill[kRegions] = {0, 0, kLamportEmptyByte};
      for (int region = 0; region < kRegions; ++region) {
        if (bytes[region] == 0) continue;
        void* p = nullptr;
        B12X_CUDA_CHECK(cudaMalloc(&p, bytes[region]));
        exports_[region] = p;
        B12X_CUDA_CHECK(cudaMemset(p, fill[region], bytes[region]));
        B12X_CUDA_CHECK(cudaIpcGetMemHandle(&handles_[region], p));
      }
      // Filled before any peer can see the handles: peers write only after
      // the collective verdict that follows this constructor.
      B12X_CUDA_CHECK(cudaDeviceSynchronize());
      ErrorRecord* record = nullptr;
      B12X_CUDA_CHECK(cudaHostAlloc(&record, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
      *record = ErrorRecord{};
      host_errors_[local] = record;
    } catch (...) {
      free_all();
      throw;
    }
    place(local, exports_);
    views_[local].error = host_errors_[local];  // unified addressing: valid on the device
  }

  ~IpcGroup() override { free_all(); }

  std::string exported(int rank) const override {
    if (rank != local_) throw std::invalid_argument("b12x_jax: rank " + std::to_string(rank) + " is not local");
    return std::string(reinterpret_cast<const char*>(handles_), sizeof(handles_));
  }

  void open(int rank, const std::string& exported) override {
    if (exported.size() != sizeof(handles_)) {
      throw std::runtime_error("the export of rank " + std::to_string(rank) + " has " +
                               std::to_string(exported.size()) + " bytes, expected " + std::to_string(sizeof(handles_)));
    }
    cudaIpcMemHandle_t handles[kRegions];
    std::memcpy(handles, exported.data(), sizeof(handles));
    DeviceGuard guard;
    B12X_CUDA_CHECK(cudaSetDevice(ordinals_[local_]));
    void* mapped[kRegions] = {};
    for (int region = 0; region < kRegions; ++region) {
      if (exports_[region] == nullptr) continue;  // the same options leave the same regions out everywhere
      const cudaError_t err = cudaIpcOpenMemHandle(&mapped[region], handles[region], cudaIpcMemLazyEnablePeerAccess);
      if (err != cudaSuccess) {
        cudaGetLastError();
        throw std::runtime_error("cudaIpcOpenMemHandle of rank " + std::to_string(rank) + " on device " +
                                 std::to_string(ordinals_[local_]) + " failed: " + cudaGetErrorString(err));
      }
      imports_.push_back(mapped[region]);
    }
    place(rank, mapped);
  }

  void close_imports() override {
    if (imports_.empty()) return;
    DeviceGuard guard;
    cudaSetDevice(ordinals_[local_]);
    cudaDeviceSynchronize();  // kernels of this rank may still read or write peer memory
    for (void* p : imports_) cudaIpcCloseMemHandle(p);
    imports_.clear();
  }

  // This process's rank as allocated (its device idle first); the peers
  // reset theirs.
  bool reset() override {
    static const int fill[kRegions] = {0, 0, kLamportEmptyByte};
    const size_t bytes[kRegions] = {sizeof(Signal), views_[local_].layout.total_bytes(),
                                    views_[local_].lamport_layout.lamport_region_bytes()};
    DeviceGuard guard;
    B12X_CUDA_CHECK(cudaSetDevice(ordinals_[local_]));
    B12X_CUDA_CHECK(cudaDeviceSynchronize());
    for (int region = 0; region < kRegions; ++region) {
      if (exports_[region] != nullptr) B12X_CUDA_CHECK(cudaMemset(exports_[region], fill[region], bytes[region]));
    }
    B12X_CUDA_CHECK(cudaDeviceSynchronize());
    *host_errors_[local_] = ErrorRecord{};
    return true;
  }

  uint32_t read_calls(int rank) const override {
    return read_device_calls(ordinals_[rank], static_cast<const Signal*>(exports_[kSignals]), rank, world());
  }
  bool read_poisoned(int rank) const override {
    return read_device_poisoned(ordinals_[rank], static_cast<const Signal*>(exports_[kSignals]));
  }
  void start_counters(uint32_t calls) const override {
    start_device_counters(ordinals_[local_], static_cast<Signal*>(exports_[kSignals]), calls);
  }
  void store_generation(uint32_t generation) override {
    write_device_generation(ordinals_[local_], static_cast<Signal*>(exports_[kSignals]), generation);
  }

 private:
  void place(int rank, void* const regions[kRegions]) {
    ChannelView& v = views_[local_];
    v.signals[rank] = static_cast<Signal*>(regions[kSignals]);
    v.staging[rank] = static_cast<char*>(regions[kStaging]);
    v.lamport[rank] = static_cast<char*>(regions[kLamport]);
  }

  void free_all() {
    close_imports();
    DeviceGuard guard;
    cudaSetDevice(ordinals_[local_]);
    cudaDeviceSynchronize();
    for (void*& p : exports_) {
      if (p != nullptr) cudaFree(p);
      p = nullptr;
    }
    if (host_errors_[local_] != nullptr) cudaFreeHost(host_errors_[local_]);
    host_errors_[local_] = nullptr;
  }

  int local_;
  void* exports_[kRegions] = {};
  cudaIpcMemHandle_t handles_[kRegions] = {};
  std::vector<void*> imports_;
};

}  // namespace

std::unique_ptr<SharedGroup> make_ipc_group(const std::string& channel, std::vector<int> ordinals,
                                            ChannelOptions options) {
  int local = kRemoteRank;
  std::vector<int> local_devices;
  for (size_t r = 0; r < ordinals.size(); ++r) {
    if (ordinals[r] == kRemoteRank) continue;
    local = static_cast<int>(r);
    local_devices.push_back(ordinals[r]);
  }
  if (local_devices.size() != 1) {
    throw std::invalid_argument("b12x_jax: a CUDA channel shared between processes needs exactly one of its GPUs "
                                "in each process (one process per GPU), this process holds " +
                                std::to_string(local_devices.size()));
  }
  options.max_blocks = resolve_max_blocks(options, local_devices);
  return std::make_unique<IpcGroup>(channel, std::move(ordinals), options, local);
}

}  // namespace b12x
