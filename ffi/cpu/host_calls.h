// The two shapes of a host collective on the progress thread (progress.h),
// on the shared protocol code with one block per call: a call of barrier
// phases (protocol.h), and a Lamport exchange (lamport.h). Ops derive from
// them and supply the pushes and the reduction.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "../lamport.h"
#include "../protocol.h"
#include "host_memory.h"
#include "progress.h"

namespace b12x {

// The thread mapping of the shared steps (all_reduce.h) on the host: the
// progress thread takes every pack.
struct AllPacks {
  template <class Fn>
  void operator()(size_t n, Fn fn) const {
    for (size_t i = 0; i < n; ++i) fn(i);
  }
};

// A call of `phases` barriers: phase p pushes (stage), then meets every peer
// at epoch e + p of call `tag`, e being one past the block's counter.
class BarrierCall : public HostCall {
 public:
  BarrierCall(RankHandle handle, xla::ffi::Promise promise, const CallTag& tag, int phases)
      : HostCall(handle, std::move(promise)), tag_(tag), phases_(phases) {}

  int phases() const override { return phases_; }

  void start(const ChannelView& v, int phase) override {
    if (phase == 0) epoch_ = next_epoch<HostMem>(v, 0);
    stage(v, epoch_, phase);
    for (int peer = 0; peer < v.world; ++peer) {
      if (exchanges_with(v, peer)) arrive<HostMem>(v, 0, peer, epoch_ + phase, tag_);
    }
  }

  PeerState poll(const ChannelView& v, int phase, const Deadline& deadline) override {
    const uint32_t epoch = epoch_ + phase;
    for (int peer = 0; peer < v.world; ++peer) {
      if (!exchanges_with(v, peer)) continue;
      const auto probe = [&] { return check_arrival<HostMem>(v, 0, peer, epoch, tag_); };
      const PeerState state = poll_peer<HostMem>(v, peer, epoch, deadline, probe);
      if (state != PeerState::kArrived) return state;
    }
    return PeerState::kArrived;
  }

  void finish(const ChannelView& v) override { done(v, epoch_); }

 protected:
  // Phase `phase`'s pushes of the call at `epoch` (its first barrier's),
  // after the barrier of phase - 1.
  virtual void stage(const ChannelView& v, uint32_t epoch, int phase) = 0;
  // The reads after the last barrier.
  virtual void done(const ChannelView& v, uint32_t epoch) = 0;

 private:
  CallTag tag_;
  int phases_;
  uint32_t epoch_ = 0;
};

// One Lamport exchange of `n` packs per source (lamport.h): start pushes the
// header and the data (`part`: every peer gets `in`, unless an op sends
// each peer its own); poll checks every source's header, then its packs from
// where the last poll stopped (no word still empty); finish hands each
// pack's sources in rank order to `reduce`, refills the previous buffer and
// advances.
class LamportHostCall : public HostCall {
 public:
  LamportHostCall(RankHandle handle, xla::ffi::Promise promise, const CallTag& tag, const Pack* in, size_t n)
      : HostCall(handle, std::move(promise)), tag_(tag), in_(in), n_(n) {}

  void start(const ChannelView& v, int /*phase*/) override {
    call_ = lamport_begin<HostMem>(v, 0, tag_);
    lamport_push_header<HostMem>(v, call_);
    for (size_t i = 0; i < n_; ++i) {
      for (int p = 0; p < v.world; ++p) {
        if (exchanges_with(v, p)) lamport_push_to<HostMem>(v, call_, p, i, part(v, p, i));
      }
    }
  }

  PeerState poll(const ChannelView& v, int /*phase*/, const Deadline& deadline) override {
    for (int q = 0; q < v.world; ++q) {
      if (!exchanges_with(v, q)) continue;
      const auto probe = [&] {
        if (!header_ok_[q]) {
          const PeerState header = lamport_header_state<HostMem>(v, call_, q);
          if (header != PeerState::kArrived) return header;
          header_ok_[q] = true;
        }
        Pack x;
        while (landed_[q] < n_ && lamport_load<HostMem>(v, call_, q, landed_[q], x)) ++landed_[q];
        return landed_[q] == n_ ? PeerState::kArrived : PeerState::kPending;
      };
      const PeerState state = poll_peer<HostMem>(v, q, call_.call + 1u, deadline, probe);
      if (state != PeerState::kArrived) return state;
    }
    return PeerState::kArrived;
  }

  void finish(const ChannelView& v) override {
    for (size_t i = 0; i < n_; ++i) {
      Pack staged[kMaxRanks];
      for (int q = 0; q < v.world; ++q) {
        if (from_own_input(v, q)) {
          staged[q] = part(v, q, i);
        } else {
          lamport_load<HostMem>(v, call_, q, i, staged[q]);  // arrived: poll saw every word
        }
      }
      reduce(v, i, staged);
    }
    for (size_t i = 0; i < lamport_refill_packs(call_); ++i) lamport_refill<HostMem>(v, call_, i);
    lamport_advance<HostMem>(v, call_, static_cast<uint32_t>(n_));
  }

 protected:
  // Pack i of what this rank sends rank `dest` (its own part where dest is
  // this rank): `in[i]` for every dest, unless the op overrides it.
  virtual Pack part(const ChannelView& /*v*/, int /*dest*/, size_t i) const { return in_[i]; }
  // Pack i of the result from `staged[q]`, source q's pack i, q < world.
  virtual void reduce(const ChannelView& v, size_t i, const Pack* staged) = 0;
  // This call's buffers and counts (lamport.h), from start on: its cells
  // stay as they are until the next call of the channel.
  const LamportCall& call() const { return call_; }

 private:
  CallTag tag_;
  const Pack* in_;
  size_t n_;
  LamportCall call_{};
  std::array<size_t, kMaxRanks> landed_{};   // per source: packs seen arrived, from the start
  std::array<bool, kMaxRanks> header_ok_{};  // per source: its tag matched
};

}  // namespace b12x
