// The host backend's "stream": one progress thread per process runs every
// host collective, in the order each rank submitted them.
//
// XLA:CPU gives no guarantee that the devices of one process run their parts
// of an SPMD program on different threads at the same time: it was seen
// queueing rank 0 and rank 1 of one call on the same pool thread (jax 0.11.2,
// 2 cores), so a handler that blocks until its peers arrive deadlocks. The
// handlers therefore only submit the call and return a future; this thread
// stages, meets the peers and reduces, one call at a time per rank, which
// also gives each channel the in-order execution the protocol relies on
// (protocol.h: one barrier per call).
#pragma once

#include <cstddef>
#include <functional>

#include "../registry.h"
#include "xla/ffi/api/ffi.h"

namespace b12x {

// One submitted collective of one rank. `stage` runs once, when every earlier
// call of the same rank and channel finished; it pushes the payload and
// announces the epoch. `finish` runs once every peer announced it.
struct HostCall {
  RankHandle handle;
  uint32_t epoch = 0;
  std::function<void(const ChannelView&, uint32_t epoch)> stage;
  std::function<void(const ChannelView&, uint32_t epoch)> finish;
  xla::ffi::Promise promise;
};

// Queues `call` behind the earlier calls of its rank and channel.
void submit_host_call(HostCall call);

// True once no call of `group` is queued or running on the progress thread;
// false if none of them finished for `seconds`.
bool wait_host_calls(const ChannelGroup* group, double seconds);

// The bound host groups give wait_host_calls: a queued call ends within one
// timeout of its start, which comes at the latest when the call before it
// ended (a timeout poisons the channel and the rest fail at once), plus a
// second of slack.
inline double host_idle_bound_s(const ChannelOptions& options) { return 2 * options.timeout_s + 1; }

}  // namespace b12x
