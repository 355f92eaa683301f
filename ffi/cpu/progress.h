// The host backend's "stream": one progress thread per process runs every
// host collective, in the order each rank submitted them.
//
// XLA:CPU gives no guarantee that the devices of one process run their parts
// of an SPMD program on different threads at the same time: it was seen
// queueing rank 0 and rank 1 of one call on the same pool thread (jax 0.11.2,
// 2 cores), so a handler that blocks until its peers arrive deadlocks. The
// handlers therefore only submit the call and return a future; this thread
// stages, polls the peers and reduces, one call at a time per rank, which
// also gives each channel the in-order execution the protocols rely on
// (protocol.h: one barrier per call; lamport.h: three buffers). It never
// blocks on a peer: every look at one is a bounded poll (protocol.h
// poll_peer), and while a call waits the thread moves on to other ranks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "../protocol.h"
#include "../registry.h"
#include "xla/ffi/api/ffi.h"

namespace b12x {

// One submitted collective of one rank, in phases (a barrier each, or one
// Lamport exchange: cpu/host_calls.h). Phase p starts once every earlier
// call of the same rank and channel finished and phase p - 1 passed; it is
// then polled until every peer is there; `finish` runs after the last.
class HostCall {
 public:
  HostCall(RankHandle handle, xla::ffi::Promise promise, const CallTag& tag)
      : handle(handle), promise(std::move(promise)), tag(tag) {}
  virtual ~HostCall() = default;

  virtual int phases() const { return 1; }
  // Pushes phase `phase`'s data and announces it.
  virtual void start(const ChannelView& v, int phase) = 0;
  // One look at every peer: kArrived once all are there; kFailed with the
  // error recorded and the channel poisoned (a timeout at `deadline`, or a
  // peer at another call).
  virtual PeerState poll(const ChannelView& v, int phase, Deadline& deadline) = 0;
  // Writes the outputs, after the last phase.
  virtual void finish(const ChannelView& v) = 0;

  RankHandle handle;
  xla::ffi::Promise promise;
  CallTag tag;  // what every phase announces and checks
};

// Queues `call` behind the earlier calls of its rank and channel, its tag
// placed (channel.h Placement: a misplaced call's tag matches no peer's).
void submit_host_call(std::unique_ptr<HostCall> call, const Placement& placement);

// True once no call of `group` is queued or running on the progress thread;
// false if none of them finished for `seconds`.
bool wait_host_calls(const ChannelGroup* group, double seconds);

// True once every call submitted before this one finished (its error, if
// any, recorded); false if none of them finished for `seconds`.
bool wait_submitted_host_calls(double seconds);

// At exit: waits, at most `seconds`, for every queued call and completion,
// then stops and joins the progress thread (see progress.cc). True if idle.
bool shutdown_host_progress(double seconds);

// The bound host groups give wait_host_calls: a queued call ends within one
// timeout of its start (a channel's first call within the setup timeout, if
// longer: channel.h first_timeout_ns), which comes at the latest when the
// call before it ended (a timeout poisons the channel and the rest fail at
// once), plus a second of slack.
inline double host_idle_bound_s(const ChannelOptions& options) {
  return 2 * std::max(options.timeout_s, options.setup_timeout_s) + 1;
}

}  // namespace b12x
