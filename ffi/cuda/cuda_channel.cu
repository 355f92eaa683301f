#include "cuda_channel.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda_memory.cuh"

namespace b12x {
namespace {

// Restores the calling thread's current device when setup is done.
class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&saved_); }
  ~DeviceGuard() { cudaSetDevice(saved_); }

 private:
  int saved_ = 0;
};

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
  cudaDeviceCanAccessPeer(&can, a, b);
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
  CudaGroup(const std::string& channel, std::vector<int> ordinals, size_t capacity_bytes, double timeout_s,
            int max_blocks)
      : ChannelGroup(channel, Platform::kCuda, std::move(ordinals), timeout_s) {
    DeviceGuard guard;
    const int world = this->world();
    const size_t block_bytes = capacity_bytes / max_blocks / kPackBytes * kPackBytes;
    const StagingLayout layout{block_bytes, world, max_blocks};
    ChannelView view{};
    view.layout = layout;
    view.world = world;
    view.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
    try {
      for (int r = 0; r < world; ++r) {
        B12X_CUDA_CHECK(cudaSetDevice(ordinals_[r]));
        B12X_CUDA_CHECK(cudaMalloc(&view.signals[r], sizeof(Signal)));
        devices_.push_back(ordinals_[r]);
        B12X_CUDA_CHECK(cudaMemset(view.signals[r], 0, sizeof(Signal)));
        B12X_CUDA_CHECK(cudaMalloc(&view.staging[r], layout.total_bytes()));
        B12X_CUDA_CHECK(cudaMemset(view.staging[r], 0, layout.total_bytes()));
        ErrorRecord* record = nullptr;
        B12X_CUDA_CHECK(cudaHostAlloc(&record, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
        *record = ErrorRecord{};
        host_errors_.push_back(record);
        signals_.push_back(view.signals[r]);
        staging_.push_back(view.staging[r]);
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
    for (int d : devices_) {
      cudaSetDevice(d);
      cudaDeviceSynchronize();
    }
    free_all();
  }

  uint32_t read_epoch(int rank) const override {
    DeviceGuard guard;
    cudaSetDevice(ordinals_[rank]);
    uint32_t epoch = 0;
    cudaMemcpy(&epoch, &signals_[rank]->counter[0][rank == 0 ? 1 : 0], sizeof(epoch), cudaMemcpyDeviceToHost);
    return epoch;
  }
  bool read_poisoned(int rank) const override {
    DeviceGuard guard;
    cudaSetDevice(ordinals_[rank]);
    uint32_t poisoned = 0;
    cudaMemcpy(&poisoned, &signals_[rank]->poisoned, sizeof(poisoned), cudaMemcpyDeviceToHost);
    return poisoned != 0;
  }

 private:
  void free_all() {
    for (size_t r = 0; r < signals_.size(); ++r) {
      cudaSetDevice(devices_[r]);
      cudaFree(signals_[r]);
      cudaFree(staging_[r]);
      cudaFreeHost(host_errors_[r]);
    }
    signals_.clear();
    staging_.clear();
    host_errors_.clear();
  }

  std::vector<int> devices_;
  std::vector<Signal*> signals_;
  std::vector<char*> staging_;
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

std::unique_ptr<ChannelGroup> make_cuda_group(const std::string& channel, std::vector<int> ordinals,
                                              size_t capacity_bytes, double timeout_s, int max_blocks) {
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
  if (capacity_bytes / max_blocks < kPackBytes) {
    throw std::invalid_argument("b12x_jax: capacity_bytes must be at least 16 * max_blocks");
  }
  return std::make_unique<CudaGroup>(channel, std::move(ordinals), capacity_bytes, timeout_s, max_blocks);
}

}  // namespace b12x
