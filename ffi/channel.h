// Channel memory layout, shared by the CPU and CUDA backends.
//
// A channel is one totally ordered sequence of collectives. Every rank of a
// channel owns one `Signal` and one staging region in its own memory; peers
// write into both (push), the owner reads them. All ranks of a channel
// allocate the same layout, so an offset computed on one rank is valid on
// every rank.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define B12X_HD __host__ __device__ __forceinline__
#define B12X_UNROLL _Pragma("unroll")
#else
#define B12X_HD inline
#define B12X_UNROLL
#endif

namespace b12x {

// Largest group one channel serves (one host: 8 GPUs).
inline constexpr int kMaxRanks = 8;
// Largest grid a collective may launch. Every block of a call waits on peers,
// so the whole grid must be resident at once (DESIGN C10): checked against
// the SM count when a CUDA channel is prepared.
inline constexpr int kMaxBlocks = 64;
// Staging and payload granularity: one 16-byte vector per thread per step.
inline constexpr size_t kPackBytes = 16;
// Largest capacity_bytes of a channel: a rank's staging is kStagingSlots x
// world x this (16 GiB at 8 ranks), and no size computed from it nears
// size_t's wrap.
inline constexpr size_t kMaxCapacityBytes = size_t{1} << 30;
// Slots of the barrier protocol's staging (protocol.h) and buffers of the
// Lamport exchange (lamport.h): each argues its own reuse.
inline constexpr int kStagingSlots = 2;
inline constexpr int kLamportBuffers = 3;
// Most blocks one row of the Triton fused op spans (its meeting's slots per
// row, Signal::row_shares; docs/DESIGN.md, "Triton kernels").
inline constexpr int kMaxRowSplit = 4;
// Two builds meet on a channel only if they speak the same protocol
// (b12x_jax/rendezvous.py, Frame): the layouts of this file and the
// constants of the exchanges are compared without help (bindings.cc,
// protocol_fingerprint), but a change of meaning with the same layout (what
// a word holds, the order of a call's steps, an encoding), here or in the
// Triton kernels (b12x_jax/kernels), must bump this.
inline constexpr uint32_t kProtocolRevision = 2;

// What one call is, announced with it and checked by every peer (DESIGN.md,
// "The call tag"): two ranks that reach different calls on one channel stop
// with an error naming both instead of mixing their data. Every word is
// below 2^31 (never the Lamport empty word 0xFFFFFFFF, lamport.h), and the
// op is never 0, so a tag nobody wrote never matches.
struct alignas(16) CallTag {
  uint32_t call;       // op, dtype, grid and the op's flags (make_tag)
  uint32_t algorithm;  // the protocol and the op's shape class (all_reduce.h, rmsnorm.h, dcp.h)
  uint32_t packs;      // payload of the whole call, in 16-byte packs
  uint32_t site;       // where the call stands in its program: the `site` attribute (b12x_jax/ops/_common.py)
};
static_assert(sizeof(CallTag) == kPackBytes);

B12X_HD bool operator==(const CallTag& a, const CallTag& b) {
  return a.call == b.call && a.algorithm == b.algorithm && a.packs == b.packs && a.site == b.site;
}

enum class Op : uint32_t { kAllReduce = 1, kResidualRmsnorm = 2, kDcpA2a = 3 };

// A call's sites are 31-bit hashes; flags are the op's (dcp.h: the lse base,
// bit 0) and the placement's (kMisplacedFlag and the rank, bits 3-6).
inline constexpr uint32_t kSiteMask = 0x7FFFFFFF;
inline constexpr uint32_t kMaxTagFlags = 0x7F;

// The tag of a call of `op` on elements of `dtype` (numeric.h DType) over
// `grid` blocks (at most kMaxBlocks), the op's `algorithm` word, `packs`
// in all and its `site`.
B12X_HD CallTag make_tag(Op op, uint32_t dtype, int grid, uint32_t algorithm, size_t packs, uint32_t site,
                         uint32_t flags = 0) {
  const uint32_t call = static_cast<uint32_t>(op) | (dtype & 0xFF) << 8 | (static_cast<uint32_t>(grid) & 0xFF) << 16 |
                        (flags & kMaxTagFlags) << 24;
  return CallTag{call, algorithm & 0x7FFFFFFF, static_cast<uint32_t>(packs), site & kSiteMask};
}
B12X_HD uint32_t tag_op(const CallTag& t) { return t.call & 0xFF; }
B12X_HD uint32_t tag_dtype(const CallTag& t) { return t.call >> 8 & 0xFF; }
B12X_HD uint32_t tag_grid(const CallTag& t) { return t.call >> 16 & 0xFF; }
B12X_HD uint32_t tag_flags(const CallTag& t) { return t.call >> 24 & kMaxTagFlags; }

// Where a call of an exported module runs (docs/DESIGN.md, "Placement"):
// the id of the device that its lowering put at this device's mesh position
// (an int32 operand of exported calls, read when the call runs; null in a
// module lowered for the devices it runs on), and this device's id. A call
// whose two differ is misplaced: its group attribute names the peers of
// another device, and no exchange with them may count.
struct Placement {
  const int32_t* expected_device;
  int32_t device;
};

// A misplaced call's tag carries this flag and its rank, so that it equals
// no peer's tag: every rank of the group stops with a mismatch naming it,
// whichever of them are misplaced.
inline constexpr uint32_t kMisplacedFlag = 0x40;
B12X_HD bool tag_misplaced(const CallTag& t) { return (t.call >> 24 & kMisplacedFlag) != 0; }
static_assert(kMaxRanks <= 8, "a misplaced tag carries its rank in 3 bits");
B12X_HD CallTag placed_tag(CallTag tag, const Placement& p, int rank) {
  if (p.expected_device != nullptr && *p.expected_device != p.device) {
    tag.call |= (kMisplacedFlag | (static_cast<uint32_t>(rank) & 7u) << 3) << 24;
  }
  return tag;
}

// Signal region of one rank. Block b of a call synchronises with block b of
// every peer through these words only, so blocks never wait on each other
// inside a rank.
struct alignas(128) Signal {
  // counter[b][p]: barriers at which block b of this rank met peer p (one
  // per call, two for a two-shot all-reduce). It is the channel's epoch as
  // seen by that block and selects the staging slot (counter % 2). Written
  // only by this rank.
  uint32_t counter[kMaxBlocks][kMaxRanks];
  // flag[parity][b][p]: the last counter value peer p announced to block b of
  // this rank. Two parity words let a peer that is one call ahead announce
  // call k+1 while this rank is still waiting for the announcement of call k.
  uint32_t flag[2][kMaxBlocks][kMaxRanks];
  // tag[parity][b][p]: the call peer p announced with that flag, written
  // before it (the flag's release orders it).
  CallTag tag[2][kMaxBlocks][kMaxRanks];
  // lamport_calls[b]: small-payload calls block b of this rank ran (for
  // stats and errors only: it wraps); lamport_buffer[b]: the Lamport buffer
  // its next call uses, cycling 0, 1, 2 by itself (a count mod 3 would not
  // cycle across the uint32 wrap: 2^32 = 1 mod 3, DESIGN.md "Wrap");
  // lamport_packs[b]: packs it exchanged in the last one (what the next call
  // refills). Written only by this rank.
  uint32_t lamport_calls[kMaxBlocks];
  uint32_t lamport_buffer[kMaxBlocks];
  uint32_t lamport_packs[kMaxBlocks];
  // served[b]: non-zero once block b of this rank met its peers in a call
  // on this channel; until then its waits are bounded by the setup timeout
  // (protocol.h, wait_deadline). Written only by this rank.
  uint32_t served[kMaxBlocks];
  // The Triton fused op's rows that span several blocks (docs/DESIGN.md,
  // "Triton kernels"). row_arrivals[b], for a row's first block b, grows by
  // 65536 per call (65536 / S from each of the row's S blocks): its high
  // half names the call. row_shares[b][t], one 64-bit word read and written
  // whole: the share of the row's sum of squares of the row's t-th block
  // (float bits, low half) and the call it belongs to (the next multiple of
  // 65536 of row_arrivals[b], plus 1: never 0, the word as allocated and as
  // a call of fewer blocks resets it), for the last call whose row began at
  // block b. Written only by this rank's kernels.
  uint32_t row_arrivals[kMaxBlocks];
  uint64_t row_shares[kMaxBlocks][kMaxRowSplit];
  // Non-zero once a wait on this rank timed out: later calls on the channel
  // exit at once (DESIGN C8, the channel is poisoned until released).
  uint32_t poisoned;
  // Which preparation of the channel this memory serves now, written by the
  // host (Registry: a fresh number at every preparation, 0 once released).
  // A kernel whose addresses were baked into an executable checks it
  // against the one it was lowered for (docs/DESIGN.md, "Lifetime").
  uint32_t generation;
};
static_assert(sizeof(Signal) % 128 == 0, "Signal must keep its 128-byte alignment");
static_assert(sizeof(Signal::counter) == kMaxBlocks * kMaxRanks * sizeof(uint32_t));

// What a failed wait leaves for the host: filled once, by the first waiter
// that timed out, and read by the handler or by `check_errors()`. On CUDA it
// lives in mapped host memory so the host can read it without a sync, also
// when the call was replayed from a CUDA graph and no handler ran.
struct ErrorRecord {
  uint32_t state;   // 0: none, 1: being written, 2: complete
  uint32_t kind;    // kFailureTimeout, kFailureMismatch or kFailureStale
  int32_t rank;     // the rank that waited
  int32_t peer;     // the rank that did not arrive, or arrived at another call
  uint32_t epoch;   // the counter value it waited for
  uint32_t peer_gave_up;  // 1: the peer stopped first (its own wait failed)
  uint32_t first_call;    // 1: the block's first call, bounded by the setup timeout
  CallTag expected;  // kFailureMismatch: this rank's call
  CallTag seen;      // kFailureMismatch: the call the peer announced
  uint32_t channel_generation;  // kFailureStale: Signal::generation when it ran (epoch: the one it was lowered for)
};
inline constexpr uint32_t kErrorNone = 0;
inline constexpr uint32_t kErrorWriting = 1;
inline constexpr uint32_t kErrorComplete = 2;
inline constexpr uint32_t kFailureTimeout = 0;
inline constexpr uint32_t kFailureMismatch = 1;
inline constexpr uint32_t kFailureStale = 2;  // an executable of an earlier preparation ran (Signal::generation)

// Staging layout of one rank: [slot][source rank][block][block_bytes], with
// two slots for the barrier protocol (protocol.h) and three buffers for the
// Lamport exchange (lamport.h). Block b of source q only ever writes its own
// cell, and block b of the owner only reads the cells of block b, so the
// reuse arguments hold block by block whatever grid a call uses. The Lamport
// buffers also hold one header pack per cell (the call's tag), after all the
// cells: `header_offset`, counted in `lamport_region_bytes()`.
struct StagingLayout {
  size_t block_bytes;  // capacity of one (slot, source, block) cell
  int world;
  int max_blocks;
  int slots;

  B12X_HD size_t cell_offset(int slot, int source, int block) const {
    return ((static_cast<size_t>(slot) * world + source) * max_blocks + block) * block_bytes;
  }
  B12X_HD size_t total_bytes() const { return cell_offset(slots, 0, 0); }
  B12X_HD size_t header_offset(int slot, int source, int block) const {
    return total_bytes() + ((static_cast<size_t>(slot) * world + source) * max_blocks + block) * kPackBytes;
  }
  // Bytes of a Lamport region: the cells, then the headers (0 where there
  // are no cells).
  B12X_HD size_t lamport_region_bytes() const { return block_bytes == 0 ? 0 : header_offset(slots, 0, 0); }
};

// Everything one rank needs to run a collective, as plain values so it can
// be passed to a kernel by value. Pointers are valid on this rank's device.
struct ChannelView {
  Signal* signals[kMaxRanks];    // signals[r]: rank r's signal region
  char* staging[kMaxRanks];      // staging[r]: rank r's staging region
  char* lamport[kMaxRanks];      // lamport[r]: rank r's Lamport buffers and headers
  ErrorRecord* error;            // this rank's error record
  // The one capacity rule (registry.cc base_view), at trace time and in
  // every handler: a call stages at most capacity_bytes, and takes the
  // Lamport exchange where it is at most lamport_window (0: never). The
  // layouts' cells hold at least that much at any grid.
  size_t capacity_bytes;
  size_t lamport_window;
  StagingLayout layout;
  StagingLayout lamport_layout;  // block_bytes 0 where there are no Lamport buffers
  uint64_t timeout_ns;
  uint64_t first_timeout_ns;     // the bound of a block's waits until it was served (Signal::served)
  int rank;
  int world;
  int loopback;  // 1: a group of one whose peer is itself (docs/DESIGN.md, "Loopback")
  // The preparation this view serves (ChannelGroup::write_generation): a
  // kernel replayed from a CUDA graph captured before a release carries an
  // older one than its memory's Signal::generation (protocol.h stale_generation).
  uint32_t generation;
};

// Whether rank `p` is one this rank exchanges with: every other rank of the
// group; in a loopback group (one rank) the rank itself, so its payload
// takes the same way through channel memory that a peer's would.
B12X_HD bool exchanges_with(const ChannelView& v, int p) { return p < v.world && (p != v.rank || v.loopback != 0); }

// Whether source `q`'s part of a sum is read from this rank's own input
// rather than from channel memory: this rank's, except under loopback.
B12X_HD bool from_own_input(const ChannelView& v, int q) { return q == v.rank && v.loopback == 0; }

}  // namespace b12x
