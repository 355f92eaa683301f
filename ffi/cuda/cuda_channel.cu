#include "cuda_channel.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../protocol.h"
#include "cuda_memory.cuh"
#include "../lamport.h"

namespace b12x {
namespace {

constexpr int kProbeWords = 256;

// Runs on device `self`: checks the words the peer wrote into its own buffer,
// then writes its own pattern into the peer's buffer.
__global__ void probe_kernel(const uint32_t* peer_words, uint32_t* peer_out, uint32_t expected,
                             uint32_t written, uint32_t* mismatches) {
  const int i = threadIdx.x;
  if (peer_words[i] != expected + i) atomicAdd(mismatches, 1u);
  peer_out[i] = written + i;
}

__global__ void fill_kernel(uint32_t* words, uint32_t base) { words[threadIdx.x] = base + threadIdx.x; }

std::string probe_pair(int a, int b) {
  int can = 0;
  const cudaError_t query = cudaDeviceCanAccessPeer(&can, a, b);
  if (query != cudaSuccess) {
    cudaGetLastError();  // not sticky: keep it from surfacing in a later launch check
    return "cudaDeviceCanAccessPeer(" + std::to_string(a) + ", " + std::to_string(b) + ") failed: " +
           cudaGetErrorString(query);
  }
  if (!can) return "cudaDeviceCanAccessPeer(" + std::to_string(a) + ", " + std::to_string(b) + ") is 0";
  cudaSetDevice(a);
  cudaError_t err = cudaDeviceEnablePeerAccess(b, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
  } else if (err != cudaSuccess) {
    return "cudaDeviceEnablePeerAccess(" + std::to_string(b) + ") on device " + std::to_string(a) +
           ": " + cudaGetErrorString(err);
  }
  // b holds [pattern written by b | pattern a writes]; a reads the first
  // half through the peer mapping and writes the second.
  uint32_t *words_b = nullptr, *mismatches = nullptr;
  const uint32_t from_b = 0x5eed0000u + 7u * b, from_a = 0xa11c0000u + 13u * a;
  std::string problem;
  cudaSetDevice(b);
  if (cudaMalloc(&words_b, 2 * kProbeWords * sizeof(uint32_t)) != cudaSuccess) return "cudaMalloc failed";
  fill_kernel<<<1, kProbeWords>>>(words_b, from_b);
  cudaDeviceSynchronize();
  cudaSetDevice(a);
  cudaMalloc(&mismatches, sizeof(uint32_t));
  cudaMemset(mismatches, 0, sizeof(uint32_t));
  probe_kernel<<<1, kProbeWords>>>(words_b, words_b + kProbeWords, from_b, from_a, mismatches);
  err = cudaDeviceSynchronize();
  uint32_t bad = 0;
  cudaMemcpy(&bad, mismatches, sizeof(bad), cudaMemcpyDeviceToHost);
  uint32_t back[kProbeWords];
  cudaSetDevice(b);
  cudaMemcpy(back, words_b + kProbeWords, sizeof(back), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    problem = std::string("peer probe kernel failed: ") + cudaGetErrorString(err);
  } else if (bad != 0) {
    problem = "device " + std::to_string(a) + " read wrong values from device " + std::to_string(b);
  } else {
    for (int i = 0; i < kProbeWords && problem.empty(); ++i) {
      if (back[i] != from_a + i) {
        problem = "device " + std::to_string(b) + " did not see device " + std::to_string(a) + "'s writes";
      }
    }
  }
  cudaFree(words_b);
  cudaSetDevice(a);
  cudaFree(mismatches);
  return problem;
}

class CudaGroup final : public ChannelGroup {
 public:
  CudaGroup(const std::string& channel, std::vector<int> ordinals, const ChannelOptions& options)
      : ChannelGroup(channel, Platform::kCuda, std::move(ordinals), options) {
    DeviceGuard guard;
    const int world = this->world();
    ChannelView view = base_view(options, world, options.max_blocks);
    const StagingLayout& layout = view.layout;
    const StagingLayout& lamport_layout = view.lamport_layout;
    try {
      for (int r = 0; r < world; ++r) {
        B12X_CUDA_CHECK(cudaSetDevice(ordinals_[r]));
        view.signals[r] = static_cast<Signal*>(device_alloc(r, sizeof(Signal), 0));
        view.staging[r] = static_cast<char*>(device_alloc(r, layout.total_bytes(), 0));
        if (lamport_layout.lamport_region_bytes() > 0) {
          view.lamport[r] =
              static_cast<char*>(device_alloc(r, lamport_layout.lamport_region_bytes(), kLamportEmptyByte));
        }
        ErrorRecord* record = nullptr;
        B12X_CUDA_CHECK(cudaHostAlloc(&record, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
        *record = ErrorRecord{};
        host_errors_.push_back(record);
        B12X_CUDA_CHECK(cudaDeviceSynchronize());
      }
    } catch (...) {
      free_all();
      throw;
    }
    for (int r = 0; r < world; ++r) {
      view.rank = r;
      view.error = host_errors_[r];  // unified addressing: the host pointer is valid on the device
      views_.push_back(view);
    }
  }

  ~CudaGroup() override {
    // Pending calls may still touch this memory on any rank: wait for them.
    DeviceGuard guard;
    for (int d : ordinals_) {
      cudaSetDevice(d);
      cudaDeviceSynchronize();
    }
    free_all();
  }

  // After the devices finished every call (a replayed graph included) and
  // before any new one: the memory as it was allocated.
  bool reset() override {
    DeviceGuard guard;
    const auto synchronize_all = [&] {
      for (int d : ordinals_) {
        B12X_CUDA_CHECK(cudaSetDevice(d));
        B12X_CUDA_CHECK(cudaDeviceSynchronize());
      }
    };
    synchronize_all();
    for (const Allocation& a : device_memory_) {
      B12X_CUDA_CHECK(cudaSetDevice(a.device));
      B12X_CUDA_CHECK(cudaMemset(a.p, a.fill, a.bytes));
    }
    synchronize_all();
    for (ErrorRecord* record : host_errors_) *record = ErrorRecord{};
    return true;
  }

  uint32_t read_calls(int rank) const override {
    return read_device_calls(ordinals_[rank], views_[rank].signals[rank], rank, world());
  }
  bool read_poisoned(int rank) const override {
    return read_device_poisoned(ordinals_[rank], views_[rank].signals[rank]);
  }
  void start_counters(uint32_t calls) const override {
    for (int r = 0; r < world(); ++r) start_device_counters(ordinals_[r], views_[r].signals[r], calls);
  }
  void store_generation(uint32_t generation) override {
    for (int r = 0; r < world(); ++r) write_device_generation(ordinals_[r], views_[r].signals[r], generation);
  }

 private:
  // cudaMalloc + cudaMemset on rank `rank`'s device (current), owned by the group.
  void* device_alloc(int rank, size_t bytes, int fill) {
    void* p = nullptr;
    B12X_CUDA_CHECK(cudaMalloc(&p, bytes));
    device_memory_.push_back({ordinals_[rank], p, bytes, fill});
    B12X_CUDA_CHECK(cudaMemset(p, fill, bytes));
    return p;
  }

  // Frees whatever the constructor got to.
  void free_all() {
    for (const Allocation& a : device_memory_) {
      cudaSetDevice(a.device);
      cudaFree(a.p);
    }
    for (ErrorRecord* record : host_errors_) cudaFreeHost(record);
    device_memory_.clear();
    host_errors_.clear();
  }

  struct Allocation {
    int device;
    void* p;
    size_t bytes;
    int fill;  // the byte it was allocated with (and is reset to)
  };
  std::vector<Allocation> device_memory_;

};

}  // namespace

std::string probe_peer_access(const std::vector<int>& ordinals) {
  DeviceGuard guard;
  for (int a : ordinals) {
    for (int b : ordinals) {
      if (a == b) continue;
      std::string problem = probe_pair(a, b);
      if (!problem.empty()) return problem;
    }
  }
  return {};
}

int resolve_max_blocks(const ChannelOptions& options, const std::vector<int>& ordinals) {
  int max_blocks = options.max_blocks;
  if (max_blocks == 0) {  // default: as many as fit, up to kMaxBlocks
    int sms = kMaxBlocks;
    for (int d : ordinals) {
      int n = 0;
      B12X_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, d));
      sms = n < sms ? n : sms;
    }
    max_blocks = sms;
  }
  if (max_blocks < 1 || max_blocks > kMaxBlocks) {
    throw std::invalid_argument("b12x_jax: max_blocks must be in [1, " + std::to_string(kMaxBlocks) +
                                "], got " + std::to_string(max_blocks));
  }
  for (int d : ordinals) {
    int sms = 0;
    B12X_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d));
    if (max_blocks > sms) {  // C10: every waiting block must be resident at once
      throw std::invalid_argument("b12x_jax: max_blocks=" + std::to_string(max_blocks) + " exceeds the " +
                                  std::to_string(sms) + " SMs of device " + std::to_string(d) +
                                  "; lower Communicator(max_blocks=...)");
    }
  }
  return max_blocks;
}

uint32_t read_device_calls(int ordinal, const Signal* signal, int rank, int world) {
  DeviceGuard guard;
  cudaSetDevice(ordinal);
  uint32_t barrier = 0, lamport = 0;
  cudaMemcpy(&barrier, &signal->counter[0][epoch_peer(rank, world)], sizeof(barrier), cudaMemcpyDeviceToHost);
  cudaMemcpy(&lamport, &signal->lamport_calls[0], sizeof(lamport), cudaMemcpyDeviceToHost);
  return barrier + lamport;
}

void start_device_counters(int ordinal, Signal* signal, uint32_t calls) {
  DeviceGuard guard;
  B12X_CUDA_CHECK(cudaSetDevice(ordinal));
  B12X_CUDA_CHECK(cudaDeviceSynchronize());  // no call of this channel may be running
  Signal host;
  B12X_CUDA_CHECK(cudaMemcpy(&host, signal, sizeof(Signal), cudaMemcpyDeviceToHost));
  start_signal_counters(host, calls);
  B12X_CUDA_CHECK(cudaMemcpy(signal, &host, sizeof(Signal), cudaMemcpyHostToDevice));
}

void write_device_generation(int ordinal, Signal* signal, uint32_t generation) {
  DeviceGuard guard;
  B12X_CUDA_CHECK(cudaSetDevice(ordinal));
  B12X_CUDA_CHECK(cudaDeviceSynchronize());  // no call of this channel may be running
  B12X_CUDA_CHECK(cudaMemcpy(&signal->generation, &generation, sizeof(generation), cudaMemcpyHostToDevice));
}

bool read_device_poisoned(int ordinal, const Signal* signal) {
  DeviceGuard guard;
  cudaSetDevice(ordinal);
  uint32_t poisoned = 0;
  cudaMemcpy(&poisoned, &signal->poisoned, sizeof(poisoned), cudaMemcpyDeviceToHost);
  return poisoned != 0;
}

std::unique_ptr<ChannelGroup> make_cuda_group(const std::string& channel, std::vector<int> ordinals,
                                              ChannelOptions options) {
  options.max_blocks = resolve_max_blocks(options, ordinals);
  return std::make_unique<CudaGroup>(channel, std::move(ordinals), options);
}

}  // namespace b12x
