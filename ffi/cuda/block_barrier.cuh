// The barrier step of protocol.h for one CUDA block (DESIGN C6), for kernels
// that stage, meet and read in one launch.
#pragma once

#include "../numeric.h"
#include "../protocol.h"
#include "cuda_memory.cuh"

namespace b12x {

// Whether the block must leave NaN at once (protocol.h view_halted), decided
// by thread 0 for every thread: threads that read the poison word apart may
// see it before and after another block sets it, and a block that went on
// in part would announce a call whose staging its departed threads never
// wrote, so a peer would sum stale cells. Every thread of the block must
// call it.
__device__ __forceinline__ bool block_halted(const ChannelView& v) {
  __shared__ int halted;
  if (threadIdx.x == 0) halted = view_halted<CudaMem>(v) ? 1 : 0;
  __syncthreads();
  return halted != 0;
}

// Block `block` of this rank meets block `block` of every peer at `epoch` of
// call `tag`: thread t serves peer t, announcing after every push of the
// block was issued, then waiting (bounded, C8) for the peer's announcement
// of the same call. False when a wait failed (timeout, or the peer at
// another call): the channel is then poisoned, the error recorded, and the
// whole block must return without reading staging. Every thread of the
// block must call it.
__device__ __forceinline__ bool block_barrier(const ChannelView& v, int block, uint32_t epoch, const CallTag& tag) {
  __shared__ int timed_out;
  if (threadIdx.x == 0) timed_out = 0;
  const Deadline deadline = wait_deadline<CudaMem>(v, block);  // before any thread of the block is served
  __syncthreads();  // all pushes of this block are issued before any flag
  const int peer = threadIdx.x;
  if (exchanges_with(v, peer)) {
    arrive<CudaMem>(v, block, peer, epoch, tag);
    if (!wait<CudaMem>(v, block, peer, epoch, tag, deadline)) timed_out = 1;
  }
  __syncthreads();
  return timed_out == 0;
}

// What a block leaves in its `n` output packs when its call cannot finish
// (poisoned channel, failed wait): NaN, so a lost result is never silent.
__device__ __forceinline__ void fill_nan(Pack* out, size_t n) {
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = nan_pack();
}

// The thread mapping of the shared steps (all_reduce.h): thread t of the
// block takes packs t, t + blockDim.x, ...
struct BlockThreads {
  template <class Fn>
  __device__ __forceinline__ void operator()(size_t n, Fn fn) const {
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) fn(i);
  }
};

}  // namespace b12x
