// The one-shot protocol, written once for every backend (DESIGN §2).
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
template <class Mem>
B12X_HD void record_timeout(const ChannelView& v, int peer, uint32_t epoch) {
  if (!Mem::claim(&v.signals[v.rank]->poisoned)) return;
  v.error->rank = v.rank;
  v.error->peer = peer;
  v.error->epoch = epoch;
  Mem::fence();
  Mem::store_release(&v.error->state, kErrorComplete);
}

// True once `peer` announced `epoch` to `block` of this rank.
template <class Mem>
B12X_HD bool peer_arrived(const ChannelView& v, int block, int peer, uint32_t epoch) {
  return Mem::load_acquire(&v.signals[v.rank]->flag[epoch & 1][block][peer]) == epoch;
}

// Wait, at most until `deadline_ns`, for `peer` to announce `epoch` to
// `block`. Never spins forever (DESIGN C8): on expiry the channel is
// poisoned, the error record names rank, peer and epoch, and false is
// returned.
template <class Mem>
B12X_HD bool wait(const ChannelView& v, int block, int peer, uint32_t epoch, uint64_t deadline_ns) {
  for (uint32_t spins = 1; !peer_arrived<Mem>(v, block, peer, epoch); ++spins) {
    // Reading the clock costs more than a poll: look at it now and then.
    if ((spins & 63) == 0 && Mem::now_ns() > deadline_ns) {
      record_timeout<Mem>(v, peer, epoch);
      return false;
    }
    Mem::pause();
  }
  return true;
}

}  // namespace b12x
