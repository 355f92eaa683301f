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
      : HostCall(handle, std::move(promise), tag), phases_(phases) {}

  int phases() const override { return phases_; }

  void start(const ChannelView& v, int phase) override {
    if (phase == 0) epoch_ = next_epoch<HostMem>(v, 0);
    stage(v, epoch_, phase);
    for (int peer = 0; peer < v.world; ++peer) {
      if (exchanges_with(v, peer)) arrive<HostMem>(v, 0, peer, epoch_ + phase, tag);
    }
  }

  PeerState poll(const ChannelView& v, int phase, Deadline& deadline) override {
    const uint32_t epoch = epoch_ + phase;
    for (int peer = 0; peer < v.world; ++peer) {
      if (!exchanges_with(v, peer)) continue;
      const auto probe = [&] { return check_arrival<HostMem>(v, 0, peer, epoch, tag); };
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
  int phases_;
  uint32_t epoch_ = 0;
};

// One Lamport exchange of `n` packs per source (lamport.h): start pushes the
// header and the op's packs (`push`); poll checks every source's header,
// then its packs from where the last poll stopped (no word still empty);
// the op's `finish` reads the arrived cells and calls `complete`, which
// refills the previous buffer and advances.
class LamportHostCall : public HostCall {
 public:
  LamportHostCall(RankHandle handle, xla::ffi::Promise promise, const CallTag& tag, size_t n)
      : HostCall(handle, std::move(promise), tag), n_(n) {}

  void start(const ChannelView& v, int /*phase*/) override {
    call_ = lamport_begin(0, tag, lamport_start<HostMem>(v, 0));
    lamport_push_header<HostMem>(v, call_);
    push(v);
  }

  PeerState poll(const ChannelView& v, int /*phase*/, Deadline& deadline) override {
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

 protected:
  // Pushes this rank's n packs into its cell of every peer's buffer.
  virtual void push(const ChannelView& v) = 0;
  // Refills the previous buffer and advances; the cells of this call's
  // buffer stay as they are until the next call of the channel.
  // The fence makes the refill visible before this rank's next pushes (and
  // this call's polls before its next pushes, the peer's side of the same
  // fence pairing): the reuse argument of lamport.h asks "written after" of
  // stores, which relaxed atomics on a weakly ordered host do not keep.
  void complete(const ChannelView& v) {
    for (size_t i = 0; i < lamport_refill_packs(call_); ++i) lamport_refill<HostMem>(v, call_, i);
    lamport_advance<HostMem>(v, call_, static_cast<uint32_t>(n_));
    HostMem::fence();
  }
  // This call's buffers and counts (lamport.h), from start on.
  const LamportCall& call() const { return call_; }
  size_t packs() const { return n_; }

 private:
  size_t n_;
  LamportCall call_{};
  std::array<size_t, kMaxRanks> landed_{};   // per source: packs seen arrived, from the start
  std::array<bool, kMaxRanks> header_ok_{};  // per source: its tag matched
};

// A Lamport sum: every peer gets `in` (encoded once per pack); finish hands
// each pack's sources in rank order to `reduce` (this rank's own from `in`).
class LamportSumCall : public LamportHostCall {
 public:
  LamportSumCall(RankHandle handle, xla::ffi::Promise promise, const CallTag& tag, const Pack* in, size_t n)
      : LamportHostCall(handle, std::move(promise), tag, n), in_(in) {}

  void finish(const ChannelView& v) override {
    for (size_t i = 0; i < packs(); ++i) {
      Pack staged[kMaxRanks];
      for (int q = 0; q < v.world; ++q) {
        if (from_own_input(v, q)) {
          staged[q] = lamport_encode(in_[i]);  // as its peers sum it: the same bits everywhere (C9)
        } else {
          lamport_load<HostMem>(v, call(), q, i, staged[q]);  // arrived: poll saw every word
        }
      }
      reduce(v, i, staged);
    }
    complete(v);
  }

 protected:
  // Pack i of the result from `staged[q]`, source q's pack i, q < world.
  virtual void reduce(const ChannelView& v, size_t i, const Pack* staged) = 0;

 private:
  void push(const ChannelView& v) override {
    for (size_t i = 0; i < packs(); ++i) lamport_push<HostMem>(v, call(), i, in_[i]);
  }

  const Pack* in_;
};

}  // namespace b12x
