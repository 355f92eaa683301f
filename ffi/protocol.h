// The barrier protocol, written once for every backend (DESIGN §2).
//
// A backend supplies a memory policy `Mem` with:
//   load_acquire(p), load_relaxed(p), store_release(p, v), fence(),
//   claim(p) (atomically 0 -> 1, true for the one caller that did it),
//   now_ns(), pause().
// CUDA runs `arrive`/`wait` with thread t of block b serving peer t; the CPU
// backend's progress thread runs `arrive`/`peer_arrived` for every peer in
// turn (cpu/progress.h says why it cannot block XLA's threads).
//
// A call on a channel, per block b:
//   1. stage: push this rank's part into every peer's staging cell
//      (slot = epoch % 2, source = this rank, block = b);
//   2. arrive: announce epoch to every peer, then wait for every peer's
//      announcement of the same epoch;
//   3. reduce: read the cells of every source from the local staging region.
//
// Why one barrier per call is enough (DESIGN C7): calls on one channel are
// ordered on each rank's stream. Rank r writes slot s of peer p in call k and
// next in call k+2. It only starts call k+2 after passing the barrier of call
// k+1, which p joins only after its reads of call k are done. So no write
// lands in a cell a peer is still reading, and the two parity flags keep an
// announcement of call k+1 from overwriting the one of call k before it was
// seen.
//
// The argument is per barrier, so a kernel may run several: two-shot
// all-reduce is two barrier calls (epochs e and e + 1, one per phase), and
// a kernel may read a cell on the writer's side instead (pull one-shot: each
// rank writes its own cell in call k and peers read it before joining the
// barrier of call k + 1). Every rank runs the same sequence of barriers on a
// channel, since every rank runs the same program.
#pragma once

#include "channel.h"

namespace b12x {

// The peer whose counter holds a rank's epoch: arrive() advances the
// counters of all peers together, so any one will do.
B12X_HD int epoch_peer(int rank) { return rank == 0 ? 1 : 0; }

// The epoch block `block` is about to run: one past the calls it has done.
// Every rank's block b has done the same calls (a call's grid is a function
// of its static shape, equal on every rank), so this agrees across ranks.
template <class Mem>
B12X_HD uint32_t next_epoch(const ChannelView& v, int block) {
  return Mem::load_relaxed(&v.signals[v.rank]->counter[block][epoch_peer(v.rank)]) + 1;
}

template <class Mem>
B12X_HD bool channel_poisoned(const ChannelView& v) {
  return Mem::load_relaxed(&v.signals[v.rank]->poisoned) != 0;
}

// Tell `peer` that this rank's block `block` reached `epoch`, after all of
// this rank's stores to the peer's staging (the fence orders them before the
// flag, at system scope).
template <class Mem>
B12X_HD void arrive(const ChannelView& v, int block, int peer, uint32_t epoch) {
  v.signals[v.rank]->counter[block][peer] = epoch;
  Mem::fence();
  Mem::store_release(&v.signals[peer]->flag[epoch & 1][block][v.rank], epoch);
}

// Record the first timeout of this rank and poison the channel: the claim on
// the device-local `poisoned` word makes exactly one waiter write the record.
// The fence orders this thread's earlier announcements before the poison; a
// peer that sees the poison looks for its announcement once more (poll_peer)
// before it gives up.
template <class Mem>
B12X_HD void record_timeout(const ChannelView& v, int peer, uint32_t epoch, bool peer_gave_up) {
  Mem::fence();
  if (!Mem::claim(&v.signals[v.rank]->poisoned)) return;
  v.error->rank = v.rank;
  v.error->peer = peer;
  v.error->epoch = epoch;
  v.error->peer_gave_up = peer_gave_up ? 1u : 0u;
  Mem::fence();
  Mem::store_release(&v.error->state, kErrorComplete);
}

// True once `peer` announced `epoch` to `block` of this rank.
template <class Mem>
B12X_HD bool peer_arrived(const ChannelView& v, int block, int peer, uint32_t epoch) {
  return Mem::load_acquire(&v.signals[v.rank]->flag[epoch & 1][block][peer]) == epoch;
}

enum class PeerState { kArrived, kPending, kFailed };

// How long a waiter waits before it looks at its peer's poison word: that
// is a load from the peer's memory, a round trip over the link, which a
// call that completes in microseconds must not pay.
inline constexpr uint64_t kPeerPoisonGraceNs = 20000;

// One bounded look at `peer`, for a waiter that polls `arrived()` (a flag, or
// Lamport data). kFailed, with the channel poisoned and the error recorded,
// once the deadline passed or the peer poisoned the channel itself: a peer
// whose own wait timed out announces nothing more, so its partners stop at
// once instead of serving out a timeout each, one after the other.
template <class Mem, class Arrived>
B12X_HD PeerState poll_peer(const ChannelView& v, int peer, uint32_t epoch, uint64_t deadline_ns,
                            Arrived arrived) {
  if (arrived()) return PeerState::kArrived;
  const uint64_t now = Mem::now_ns();
  const bool in_grace = now + v.timeout_ns < deadline_ns + kPeerPoisonGraceNs;  // waited < grace so far
  const bool gave_up = !in_grace && Mem::load_acquire(&v.signals[peer]->poisoned) != 0;
  if (!gave_up && now <= deadline_ns) return PeerState::kPending;
  if (arrived()) return PeerState::kArrived;  // it announced before giving up
  record_timeout<Mem>(v, peer, epoch, gave_up);
  return PeerState::kFailed;
}

// Wait, at most until `deadline_ns`, for `peer` to announce `epoch` to
// `block`. Never spins forever (DESIGN C8): false, with the channel poisoned
// and the error naming rank, peer and epoch, on expiry or when the peer gave
// up on the channel.
template <class Mem>
B12X_HD bool wait(const ChannelView& v, int block, int peer, uint32_t epoch, uint64_t deadline_ns) {
  const auto arrived = [&] { return peer_arrived<Mem>(v, block, peer, epoch); };
  for (uint32_t spins = 1; !arrived(); ++spins) {
    // The clock and the peer's poison word cost more than a poll: look at
    // them now and then.
    if ((spins & 63) == 0) {
      const PeerState state = poll_peer<Mem>(v, peer, epoch, deadline_ns, arrived);
      if (state != PeerState::kPending) return state == PeerState::kArrived;
    }
    Mem::pause();
  }
  return true;
}

}  // namespace b12x
