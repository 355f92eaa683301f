// The barrier protocol, written once for every backend (docs/DESIGN.md,
// "The barrier"); the Lamport exchange is lamport.h, the all-reduce
// algorithms on top of both all_reduce.h.
//
// A backend supplies a memory policy `Mem` with:
//   load_acquire(p), load_relaxed(p), store_release(p, v),
//   store_relaxed(p, v) (a counter the host may read meanwhile), fence(),
//   claim(p) (atomically 0 -> 1, true for the one caller that did it),
//   now_ns(), pause(), and for packs: load_staged(p) (a staged pack, after
//   the barrier), load_volatile(p) (a pack a peer may be writing, each
//   32-bit word read once), store_pack(p, x).
// CUDA runs `arrive`/`wait` with thread t of block b serving peer t; the CPU
// backend's progress thread runs `arrive`/`check_arrival` for every peer in
// turn (cpu/progress.h says why it cannot block XLA's threads).
//
// Wrap (docs/DESIGN.md, "Wrap"): epochs are uint32 and wrap. Every use is
// right across it: the next epoch is counter + 1 (mod 2^32), the parity
// epoch & 1 alternates across the wrap (2^32 is even), a flag is compared
// for equality only, never ordered, and the flag a wait looks at last held
// epoch - 2, never epoch (so a word still 0 is an arrival only of an epoch
// 0 that nobody could have announced yet: epoch 0 follows 0xFFFFFFFF, after
// whose wait the slot of parity 0 holds 0xFFFFFFFE).
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
// counters of all peers together, so any one will do (in a loopback group,
// the rank itself).
B12X_HD int epoch_peer(int rank, int world) { return rank == 0 && world > 1 ? 1 : 0; }

// The epoch block `block` is about to run: one past the calls it has done
// (mod 2^32). Every rank's block b has done the same calls (a call's grid is
// a function of its static shape, equal on every rank), so this agrees
// across ranks.
template <class Mem>
B12X_HD uint32_t next_epoch(const ChannelView& v, int block) {
  return Mem::load_relaxed(&v.signals[v.rank]->counter[block][epoch_peer(v.rank, v.world)]) + 1u;
}

template <class Mem>
B12X_HD bool channel_poisoned(const ChannelView& v) {
  return Mem::load_relaxed(&v.signals[v.rank]->poisoned) != 0;
}

// Tell `peer` that this rank's block `block` reached `epoch` of call `tag`,
// after all of this rank's stores to the peer's staging (the fence orders
// them, and the tag, before the flag, at system scope).
template <class Mem>
B12X_HD void arrive(const ChannelView& v, int block, int peer, uint32_t epoch, const CallTag& tag) {
  Mem::store_relaxed(&v.signals[v.rank]->counter[block][peer], epoch);  // read_host_calls reads it meanwhile
  v.signals[peer]->tag[epoch & 1][block][v.rank] = tag;
  Mem::fence();
  Mem::store_release(&v.signals[peer]->flag[epoch & 1][block][v.rank], epoch);
}

// Record the first failure of this rank and poison the channel: the claim
// on the device-local `poisoned` word makes exactly one waiter write the
// record. The fence orders this thread's earlier announcements before the
// poison; a peer that sees the poison looks for its announcement once more
// (poll_peer) before it gives up.
template <class Mem>
B12X_HD void record_failure(const ChannelView& v, uint32_t kind, int peer, uint32_t epoch, bool peer_gave_up,
                            const CallTag& expected = CallTag{}, const CallTag& seen = CallTag{},
                            bool first_call = false) {
  Mem::fence();
  if (!Mem::claim(&v.signals[v.rank]->poisoned)) return;
  v.error->kind = kind;
  v.error->rank = v.rank;
  v.error->peer = peer;
  v.error->epoch = epoch;
  v.error->peer_gave_up = peer_gave_up ? 1u : 0u;
  v.error->first_call = first_call ? 1u : 0u;
  v.error->expected = expected;
  v.error->seen = seen;
  Mem::fence();
  Mem::store_release(&v.error->state, kErrorComplete);
}

// Whether the channel's memory now serves another preparation than `v`
// (docs/DESIGN.md, "Lifetime"), where `now` is the generation word a call
// read next to `poisoned`: a kernel replayed from a CUDA graph captured
// before a release, without its handler. It then records a failure of kind
// kFailureStale, once, naming both generations, poisons the channel and
// must leave NaN before it touches the memory (but for a Triton split row's
// meeting words, which every program of the row adds to once, so that its
// siblings fail with it: docs/DESIGN.md, "Triton kernels").
template <class Mem>
B12X_HD bool stale_generation(const ChannelView& v, uint32_t now) {
  if (now == v.generation) return false;
  if (Mem::claim(&v.signals[v.rank]->poisoned)) {
    v.error->kind = kFailureStale;
    v.error->rank = v.rank;
    v.error->peer = -1;
    v.error->epoch = v.generation;
    v.error->channel_generation = now;
    Mem::fence();
    Mem::store_release(&v.error->state, kErrorComplete);
  }
  return true;
}

// Whether a call must leave NaN at once (C8): the channel is poisoned, or
// stale (stale_generation). Both words are loaded before either is looked
// at: one round trip, not two.
template <class Mem>
B12X_HD bool view_halted(const ChannelView& v) {
  const uint32_t poisoned = Mem::load_relaxed(&v.signals[v.rank]->poisoned);
  const uint32_t generation = Mem::load_relaxed(&v.signals[v.rank]->generation);
  return poisoned != 0 || stale_generation<Mem>(v, generation);
}

template <class Mem>
B12X_HD CallTag load_tag(const CallTag* p) {
  const uint32_t* w = &p->call;
  return CallTag{Mem::load_relaxed(w), Mem::load_relaxed(w + 1), Mem::load_relaxed(w + 2), Mem::load_relaxed(w + 3)};
}

enum class PeerState { kArrived, kPending, kFailed };

// What a waiter knows of one peer once it read the peer's tag `seen` for
// its call `tag`: kArrived when they are the same call; else the mismatch
// is recorded (channel poisoned, error naming both calls) and kFailed.
template <class Mem>
B12X_HD PeerState check_tag(const ChannelView& v, int peer, uint32_t epoch, const CallTag& tag, const CallTag& seen) {
  if (seen == tag) return PeerState::kArrived;
  record_failure<Mem>(v, kFailureMismatch, peer, epoch, false, tag, seen);
  return PeerState::kFailed;
}

// `peer`'s announcement of `epoch` to `block` of this rank: kPending until
// the flag holds it, then the tag check.
template <class Mem>
B12X_HD PeerState check_arrival(const ChannelView& v, int block, int peer, uint32_t epoch, const CallTag& tag) {
  const Signal* own = v.signals[v.rank];
  if (Mem::load_acquire(&own->flag[epoch & 1][block][peer]) != epoch) return PeerState::kPending;
  return check_tag<Mem>(v, peer, epoch, tag, load_tag<Mem>(&own->tag[epoch & 1][block][peer]));
}

// How long a waiter waits before it looks at its peer's poison word: that
// is a load from the peer's memory, a round trip over the link, which a
// call that completes in microseconds must not pay.
inline constexpr uint64_t kPeerPoisonGraceNs = 20000;

// The bound of the waits of one call of one block, in 64-bit nanoseconds
// (they do not wrap). It counts from the waiter's first look at the clock,
// in poll_peer, not from the start of the call: a GPU call whose data lands
// within its first polls never reads %globaltimer, a read that the pushes
// after it would otherwise wait for. The first look comes after at most 64
// polls on CUDA (each one memory round trip) and at the first pending poll
// on the host: a wait ends at most those polls later than its bound.
struct Deadline {
  uint64_t start_ns;  // 0 until poll_peer first looks at the clock
  uint64_t bound_ns;
  bool first_call;
};

// The deadline of a call (DESIGN C8): the channel's timeout, or, for a
// `first_call` (its block has not met its peers once on a freshly prepared
// channel: Signal::served), the setup timeout. Processes reach their first
// call seconds to minutes apart (compilation, autotuning, weight loading),
// and that is no fault (docs/DESIGN.md, "Start-up skew").
B12X_HD Deadline call_deadline(const ChannelView& v, bool first_call) {
  return Deadline{0, first_call ? v.first_timeout_ns : v.timeout_ns, first_call};
}

// The same for `block`, from its served word.
template <class Mem>
B12X_HD Deadline wait_deadline(const ChannelView& v, int block) {
  return call_deadline(v, Mem::load_relaxed(&v.signals[v.rank]->served[block]) == 0);
}

// `block` of this rank met a peer: later calls are bounded by the timeout.
template <class Mem>
B12X_HD void mark_served(const ChannelView& v, int block) {
  v.signals[v.rank]->served[block] = 1u;  // read by this rank's later calls only (stream/queue order)
}

// One bounded look at `peer`, for a waiter that polls `probe()` (a flag, or
// Lamport data) for a PeerState. kFailed, with the channel poisoned and the
// error recorded, once the deadline passed or the peer poisoned the channel
// itself: a peer whose own wait failed announces nothing more, so its
// partners stop at once instead of serving out a timeout each, one after
// the other.
template <class Mem, class Probe>
B12X_HD PeerState poll_peer(const ChannelView& v, int peer, uint32_t epoch, Deadline& deadline, Probe probe) {
  PeerState state = probe();
  if (state != PeerState::kPending) return state;
  const uint64_t now = Mem::now_ns();
  if (deadline.start_ns == 0) deadline.start_ns = now;
  const bool in_grace = now < deadline.start_ns + kPeerPoisonGraceNs;
  const bool gave_up = !in_grace && Mem::load_acquire(&v.signals[peer]->poisoned) != 0;
  if (!gave_up && now - deadline.start_ns <= deadline.bound_ns) return PeerState::kPending;
  state = probe();  // it announced before giving up
  if (state != PeerState::kPending) return state;
  record_failure<Mem>(v, kFailureTimeout, peer, epoch, gave_up, CallTag{}, CallTag{}, deadline.first_call);
  return PeerState::kFailed;
}

// Wait, at most until `deadline`, for `peer` to announce `epoch` of call
// `tag` to `block`. Never spins forever (DESIGN C8): false, with the channel
// poisoned and the error naming rank, peer and epoch (and both calls on a
// tag mismatch), on expiry, on another call, or when the peer gave up.
template <class Mem>
B12X_HD bool wait(const ChannelView& v, int block, int peer, uint32_t epoch, const CallTag& tag, Deadline deadline) {
  const auto probe = [&] { return check_arrival<Mem>(v, block, peer, epoch, tag); };
  for (uint32_t spins = 1;; ++spins) {
    // The clock and the peer's poison word cost more than a poll: look at
    // them now and then.
    const PeerState state = (spins & 63) == 0 ? poll_peer<Mem>(v, peer, epoch, deadline, probe) : probe();
    if (state == PeerState::kPending) {
      Mem::pause();
      continue;
    }
    if (state == PeerState::kArrived && deadline.first_call) mark_served<Mem>(v, block);
    return state == PeerState::kArrived;
  }
}

// A rank's Signal as if `calls` calls of every block had run, the last two
// announced by every peer (epochs calls - 1 and calls, so each parity slot
// holds the epoch two before the one that waits on it next), and as many
// Lamport calls and meetings of split rows, with every Lamport buffer empty
// (nothing was exchanged).
// The test hook of DESIGN.md "Wrap" (ChannelGroup::start_counters): written
// into every rank's Signal before any call on the channel.
B12X_HD void start_signal_counters(Signal& s, uint32_t calls) {
  for (int b = 0; b < kMaxBlocks; ++b) {
    for (int p = 0; p < kMaxRanks; ++p) {
      s.counter[b][p] = calls;
      s.flag[calls & 1][b][p] = calls;
      s.flag[(calls - 1u) & 1][b][p] = calls - 1u;
    }
    s.lamport_calls[b] = calls;
    s.lamport_buffer[b] = calls % kLamportBuffers;  // any start agreed on by every rank
    s.lamport_packs[b] = 0;
    s.row_arrivals[b] = calls << 16;  // the split rows' meeting word crosses the wrap with the calls
    for (uint64_t& slot : s.row_shares[b]) slot = 0;  // no call's tag (docs/DESIGN.md, "Triton kernels")
  }
}

}  // namespace b12x
