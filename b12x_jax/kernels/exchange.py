"""The Lamport exchange the Pallas Triton kernels share (ffi/lamport.h,
word for word, on the channel's own memory): the plan of a call from the
channel's kernel view, the address table row of a device, the inline PTX of
every access to channel memory, and ``lamport_exchange``, one call's
pushes, refill, bounded polls, tag checks, failure record and advance. The
op modules (all_reduce.py, residual_rmsnorm.py, dcp_a2a.py) build their
kernels on it.

Every memory access to channel memory is inline PTX on a raw address. Pallas
marks inline assembly pure, so the compiler may merge, move or drop it
wherever data dependencies allow: every access therefore takes a value it
must wait for (``dep``: the loop counter in a poll, the results of the
accesses before it), and every store's result reaches the output, so none
is dropped, none leaves its loop, and the polls start only after the pushes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from b12x_jax import _native

# Every word is an int32 in the kernel (Pallas Triton mixes signed and
# unsigned 32-bit tensor types in comparisons): the bits are what counts.
U32 = jnp.int32
# Layout of one device's row of the address table (32-bit words).
ROW_WORDS = 64
_RANK, _OWN_SIGNAL, _ERROR, _OWN_LAMPORT, _GENERATION = 0, 1, 3, 5, 7
_PEER_LAMPORT, _PEER_SIGNAL = 8, 24  # + 2 * peer: (low, high) words
# The wait bounds of this device's process (clock units): in the row, not
# the plan, as processes may set setup_timeout_s apart and must still lower
# one program.
_TIMEOUT, _FIRST_TIMEOUT = 40, 41
ALGORITHM_LAMPORT = _native.ALGORITHMS["lamport"]
# The largest block one program takes (it holds every source's words of it).
MAX_TILE_WORDS = 8192
# The kernel's clock: globaltimer >> 10, about microseconds, in 32 bits
# (wraps after 73 minutes; waits are bounded below half of that).
_CLOCK_SHIFT = 10
_MAX_WAIT_UNITS = (1 << 31) - 1
# A second bound, on polls, in case the clock does not advance: a poll is
# at least one load from memory (over 64 ns), so a wait stops after at most
# this many times its bound, never before it.
_SPINS_PER_UNIT = 16
# The clock, the bounds and the pending peers' poison words are looked at
# on every CHECK_EVERY-th poll that still waits (a power of two), not on
# each: their reductions are paid only then.
CHECK_EVERY = 8

# One 32-bit word at (lo, hi) + off; $4, the dependency, is not read.
_LOAD = ("{ .reg .b64 a; .reg .b64 o; mov.b64 a, {$1, $2}; cvt.u64.u32 o, $3; add.u64 a, a, o; "
         "ld.volatile.global.u32 $0, [a]; }")
# The same load, of a word this program saw arrived (it stays until this
# rank refills it), so in any shape: after the polls (lamport_exchange).
_LOAD_ARRIVED = _LOAD.replace("ld.volatile.global.u32", "ld.relaxed.sys.global.u32")
# The same load, of a word only this block's earlier calls wrote (its
# Signal words OWN_WORDS), so in any shape: one element that every thread
# holds, read without a reduction.
_LOAD_OWN = _LOAD.replace("ld.volatile.global.u32", "ld.relaxed.gpu.global.u32")
OWN_WORDS = ("lamport_buffer", "lamport_calls", "lamport_packs", "served")
# The same where $4 is non-zero, else 0 without touching memory ($5: the dependency).
_LOAD_IF = ("{ .reg .b64 a; .reg .b64 o; .reg .pred p; setp.ne.u32 p, $4, 0; mov.b64 a, {$1, $2}; "
            "cvt.u64.u32 o, $3; add.u64 a, a, o; mov.u32 $0, 0; @p ld.volatile.global.u32 $0, [a]; }")
# A split row's share slot (Signal::row_shares), one 64-bit word: a share
# and the call it belongs to travel in one access, so a reader that sees the
# call's tag sees its share, and no fence orders one before the other.
# _STORE_SLOT stores ($4 low, $5 high) at (lo, hi) + off where $6 is
# non-zero, returns 0 ($7: the dependency). _LOAD_SLOT reads the slot at
# (lo, hi) + off where $4 is non-zero and returns its share where its tag
# is $5, else NOT_MET ($6: the dependency).
_STORE_SLOT = ("{ .reg .b64 a; .reg .b64 o; .reg .b64 v; .reg .pred p; setp.ne.u32 p, $6, 0; mov.b64 a, {$1, $2}; "
               "cvt.u64.u32 o, $3; add.u64 a, a, o; mov.b64 v, {$4, $5}; @p st.relaxed.gpu.global.u64 [a], v; "
               "mov.u32 $0, 0; }")
NOT_MET = 0x7FFFFFFF  # a NaN no share is: a share's NaN is stored as CANONICAL_NAN
CANONICAL_NAN = 0x7FC00000
_LOAD_SLOT = ("{ .reg .b64 a; .reg .b64 o; .reg .b64 v; .reg .b32 share; .reg .b32 tag; .reg .pred p; .reg .pred m; "
              "setp.ne.u32 p, $4, 0; mov.b64 a, {$1, $2}; cvt.u64.u32 o, $3; add.u64 a, a, o; mov.b64 v, 0; "
              "@p ld.relaxed.gpu.global.u64 v, [a]; mov.b64 {share, tag}, v; setp.eq.u32 m, tag, $5; "
              f"selp.b32 $0, share, {NOT_MET}, m; }}")
# Adds $5 to the word at (lo, hi) + off where $4 is non-zero, ordering
# nothing (a later call reads it, after this kernel ends); returns 0 at
# once, not the word before ($6: the dependency).
_ADD = ("{ .reg .b64 a; .reg .b64 o; .reg .pred p; setp.ne.u32 p, $4, 0; mov.b64 a, {$1, $2}; "
        "cvt.u64.u32 o, $3; add.u64 a, a, o; @p red.relaxed.gpu.global.add.u32 [a], $5; mov.u32 $0, 0; }")
# Stores $4 at (lo, hi) + off where $5 is non-zero; returns 0 ($6: the dependency).
_STORE = ("{ .reg .b64 a; .reg .b64 o; .reg .pred p; setp.ne.u32 p, $5, 0; mov.b64 a, {$1, $2}; "
          "cvt.u64.u32 o, $3; add.u64 a, a, o; @p st.volatile.global.u32 [a], $4; mov.u32 $0, 0; }")
_CLOCK = ("{ .reg .u64 t; mov.u64 t, %globaltimer; shr.u64 t, t, " + str(_CLOCK_SHIFT) +
          "; cvt.u32.u64 $0, t; }")  # $1: the dependency


@dataclasses.dataclass(frozen=True)
class Plan:
  """One call's kernel, from the channel's kernel view (ffi/bindings.cc)."""
  world: int
  loopback: bool
  grid: int
  block_words: int  # words each program owns: packs per block * 4, a power of two
  cell_bytes: int
  cells_bytes: int
  max_blocks: int
  tag: tuple[int, int, int, int]
  grace_units: int
  signal_offsets: tuple[tuple[str, int], ...]
  error_offsets: tuple[tuple[str, int], ...]
  empty_word: int
  nan_word: int
  failure_timeout: int
  failure_mismatch: int
  failure_stale: int
  error_complete: int
  split: int = 1  # the fused op: programs (and blocks) per row


# The dtypes the kernel sums, and the NaN each leaves in a 32-bit word where
# a call fails: float32's, and a pair of bfloat16's (the NaN _ROUND_PAIR
# rounds a NaN to, as __float2bfloat16_rn). The FFI kernels leave all ones:
# other bits, NaN in every dtype as well.
NAN_WORDS = {"float32": 0x7FC00000, "bfloat16": 0x7FFF7FFF}


@functools.cache
def backend_problem() -> str | None:
  """Why this jax cannot build the kernels, or None: JAX has deprecated
  the Pallas Triton backend (docs/DESIGN.md, "Triton kernels"), and the
  day a jax drops it, every call takes the FFI kernel with this reason
  (an error under policy "strict" with kernels="triton")."""
  try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt
  except ImportError as e:
    return f"jax {jax.__version__} has no Pallas Triton backend ({e})"
  missing = [name for module, name in ((pl, "pallas_call"), (pl, "BlockSpec"), (plt, "elementwise_inline_asm"),
                                       (plt, "CompilerParams")) if not hasattr(module, name)]
  return f"jax {jax.__version__}'s Pallas Triton backend lacks {', '.join(missing)}" if missing else None


def why_not(dtype, nbytes: int, window: int | None) -> str | None:
  """Why no Triton kernel takes this all_reduce or fused call (decided at
  trace time; dcp_a2a's: dcp_problem), or None; ``window``: the Lamport
  window the payload must fit (None: the op checked its own). What only the
  prepared channel knows (its plan) is checked by ``call_for`` when
  lowering."""
  if backend_problem() is not None:
    return backend_problem()
  if np.dtype(dtype).name not in NAN_WORDS:
    return f"no Triton kernel for dtype {np.dtype(dtype).name} (float32 and bfloat16 only)"
  if nbytes % 4:
    return f"the payload of {nbytes} bytes is not a whole number of 32-bit words (the Triton kernel's unit)"
  if window is not None and nbytes > window:
    return f"the payload of {nbytes} bytes is above the Lamport window of {window} bytes"
  return None


def plan_problem(view: dict) -> str | None:
  """Why the Triton kernel cannot run the call the kernel view plans, or None."""
  if view["algorithm"] != ALGORITHM_LAMPORT:
    return "the channel plans the call outside its Lamport window"
  words = view["per_block"] * 4
  if view["grid"] * view["per_block"] != view["packs"] or words & (words - 1):
    return (f"its {view['packs']} packs do not split into {view['grid']} blocks of a power-of-two words "
            "(the Triton kernel's tiles)")
  if words > MAX_TILE_WORDS:
    return (f"its {view['grid']} blocks of {words} words exceed the Triton kernel's tiles of {MAX_TILE_WORDS} "
            "(raise max_blocks)")
  return None


def region_problem(plan: Plan) -> str | None:
  """Why the Triton kernel cannot address the channel's Lamport region,
  or None: its offsets into the region are int32 (the headers end it)."""
  end = plan.cells_bytes + 3 * plan.world * plan.max_blocks * 16
  if end >= 2**31:
    return (f"the channel's Lamport region of {end} bytes is beyond the Triton kernel's 32-bit offsets "
            "(2 GiB; lower lamport_bytes)")
  return None


def signed_word(word: int) -> int:
  """A 32-bit word as the int32 the kernel holds it in."""
  return int(np.uint32(word).view(np.int32))


def _units(ns: int) -> int:
  """A wait bound of ``ns`` nanoseconds in the kernel's clock units."""
  return min(_MAX_WAIT_UNITS, max(1, ns >> _CLOCK_SHIFT))


def make_plan(view: dict) -> Plan:
  return Plan(world=view["world"], loopback=bool(view["loopback"]), grid=view["grid"],
              block_words=view["per_block"] * 4, cell_bytes=view["cell_bytes"], cells_bytes=view["cells_bytes"],
              max_blocks=view["max_blocks"],
              tag=tuple(view["tag"]),
              grace_units=_units(view["poison_grace_ns"]),
              signal_offsets=tuple(sorted(view["signal_offsets"].items())),
              error_offsets=tuple(sorted(view["error_offsets"].items())),
              empty_word=signed_word(view["empty_word"]), nan_word=signed_word(view["nan_word"]),
              failure_timeout=view["failure_timeout"],
              failure_mismatch=view["failure_mismatch"], failure_stale=view["failure_stale"],
              error_complete=view["error_complete"])


def table_row(view: dict) -> np.ndarray:
  """The row of the address table for the device of ``view`` (int32 words)."""
  row = np.zeros(ROW_WORDS, np.uint32)
  rank = view["rank"]

  def put(at: int, address: int) -> None:
    row[at], row[at + 1] = address & 0xFFFFFFFF, address >> 32

  row[_RANK] = rank
  row[_GENERATION] = view["generation"]  # of this device's group: checked by every call (DESIGN "Lifetime")
  row[_TIMEOUT], row[_FIRST_TIMEOUT] = _units(view["timeout_ns"]), _units(view["first_timeout_ns"])
  put(_OWN_SIGNAL, view["signals"][rank])
  put(_ERROR, view["error"])
  put(_OWN_LAMPORT, view["lamport"][rank])
  for p in range(view["world"]):
    put(_PEER_LAMPORT + 2 * p, view["lamport"][p])
    put(_PEER_SIGNAL + 2 * p, view["signals"][p])
  return row.view(np.int32)


def _record_asm(error_offsets: dict, poisoned_offset: int, complete: int) -> str:
  """Claims the channel's poison word and, for the one claimant, fills the
  error record, as protocol.h record_failure: $1,$2 own signal, $3,$4 error
  record, $5 the predicate, $6.. kind, rank, peer, epoch, peer_gave_up,
  first_call, expected[4], seen[4], channel_generation; $21 the dependency.
  The claim is at system scope, as CudaMem::claim: peers on other GPUs read
  the poison word. Returns 0."""
  e = error_offsets
  fields = [("kind", 6), ("rank", 7), ("peer", 8), ("epoch", 9), ("peer_gave_up", 10), ("first_call", 11)]
  stores = [f"@won st.volatile.global.u32 [e+{e[name]}], ${k};" for name, k in fields]
  stores += [f"@won st.volatile.global.u32 [e+{e['expected'] + 4 * i}], ${12 + i};" for i in range(4)]
  stores += [f"@won st.volatile.global.u32 [e+{e['seen'] + 4 * i}], ${16 + i};" for i in range(4)]
  stores += [f"@won st.volatile.global.u32 [e+{e['channel_generation']}], $20;"]
  return ("{ .reg .b64 s; .reg .b64 e; .reg .pred p; .reg .pred won; .reg .u32 old; "
          "setp.ne.u32 p, $5, 0; mov.b64 s, {$1, $2}; mov.b64 e, {$3, $4}; mov.u32 old, 1; "
          "@p fence.acq_rel.sys; "
          f"@p atom.relaxed.sys.global.cas.b32 old, [s+{poisoned_offset}], 0, 1; "
          "setp.eq.and.u32 won, old, 0, p; " + " ".join(stores) +
          f" @won fence.acq_rel.sys; @won st.release.sys.global.u32 [e+{e['state']}], {complete}; "
          "mov.u32 $0, 0; }")  # 0, as every store's result: it joins the advance's chain


# Two float32 (low half $1, high half $2) rounded to one word of two
# bfloat16 by the instruction CUDA's __float2bfloat16_rn is on sm_80 and
# later (numeric.h f32_to_bf16): to nearest, ties to even, a NaN to 0x7FFF;
# the same bits as the FFI kernels by construction.
_ROUND_PAIR = "cvt.rn.bf16x2.f32 $0, $2, $1;"


def halves(words: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two bfloat16 values of each 32-bit word (low half first, as they
  sit in memory), exactly, as float32: a bfloat16 is a float32's high half."""
  to_f32 = lambda w: jax.lax.bitcast_convert_type(w, jnp.float32)  # noqa: E731
  return to_f32(jax.lax.shift_left(words, jnp.int32(16))), to_f32(words & jnp.int32(-65536))


def _flat_iota(shape: tuple[int, ...]) -> jax.Array:
  """Each element's row-major index in an array of ``shape``."""
  index, stride = jnp.zeros(shape, U32), 1
  for dim in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(U32, shape, dim) * stride
    stride *= shape[dim]
  return index


def lamport_exchange(plan: Plan, table_ref, parts, warps: int, row_share: Callable | None = None):
  """One Lamport call of this program's block (its program id) on the
  channel (lamport.h), in a program of ``warps`` warps. ``parts[p]``: the
  words this rank sends rank p (for every p < world; a sum sends every peer
  the same), a tuple of segments (int32 arrays, one shape per segment for
  every p) laid out one after the other in the cell, then 0 up to a whole
  pack (a reader polls packs). Pushes each peer's part into this rank's cell
  of its buffer B(k), refills B(k - 1), waits, bounded, until every
  source's cell of B(k) arrived, checks the tags, records a failure once
  per channel and advances. Returns (done, cells, rank, sink, row_total): whether the call
  finished (a split row: in every program of the row), every source's arrived segments (a source this rank does not
  exchange with holds zeros), this rank, ``sink`` (0, the OR of every
  store's result, which the caller must fold into its output: the module
  docstring) and, where ``row_share(cells, rank)`` gives this program's
  float32 share of its row's sum (the fused op), the row's sum over its
  plan.split programs (else None). A block reads only its own cells: each block cycles its
  buffers by the calls it took part in, so another block's B(k) may be a
  buffer that still holds an older call's words (docs/DESIGN.md, "Triton
  kernels")."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt

  shapes = [segment.shape for segment in parts[0]]
  starts = np.cumsum([0] + [int(np.prod(shape)) for shape in shapes]).tolist()
  words_total = starts[-1]
  packs = -(-words_total // 4)
  cell_words = 4 * packs  # the segments, then the pad words
  # Every value the kernel reads from memory that others write while it
  # runs (cells, headers, poison words, the clock) is read in `control`, a
  # 1-D shape at least as wide as the program's threads, so that each
  # element lives in one thread. Triton gives a narrower tensor copies in
  # several threads; each copy's load would see the memory at its own time
  # while reductions read one copy, so threads would disagree on when a
  # poll ended, and the program's barriers would pair up across iterations
  # (docs/DESIGN.md, "Triton kernels").
  width = max(32 * warps, 1 << (cell_words - 1).bit_length())
  control = (width,)
  # The polls' words are the outputs' words (one segment of the same shape):
  # the kernel takes them as polled, without a read after the loop.
  as_polled = shapes == [control] and cell_words == width
  sig_off, err_off = dict(plan.signal_offsets), dict(plan.error_offsets)

  def asm(code: str, *args, shape: tuple[int, ...] = control) -> jax.Array:
    args = [jnp.broadcast_to(jnp.asarray(a, U32), shape) for a in args]
    (out,) = plt.elementwise_inline_asm(code, args=args, constraints="=r," + ",".join(["r"] * len(args)), pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, U32)])
    return out

  # Every table word is read here, once: a ref read inside a loop body
  # would make the ref a loop constant, which Pallas Triton mislowers.
  table = {k: table_ref[k] for k in (*range(_PEER_SIGNAL + 2 * plan.world), _TIMEOUT, _FIRST_TIMEOUT)}

  def address(at: int):
    return table[at], table[at + 1]

  def load(base, offset, dep):
    return asm(_LOAD, *base, offset, dep)

  def load_if(base, offset, enabled, dep):
    return asm(_LOAD_IF, *base, offset, enabled.astype(U32), dep)

  def store(base, offset, value, enabled, dep):
    return asm(_STORE, *base, offset, value, enabled.astype(U32), dep, shape=jnp.shape(dep))

  def store_slot(base, offset, low, high, enabled, dep):  # a split row's share slot
    return asm(_STORE_SLOT, *base, offset, low, high, enabled.astype(U32), dep, shape=jnp.shape(dep))

  def clock(dep):  # this thread's reading of each element (the checks reduce it)
    return asm(_CLOCK, dep)

  def any_(mask) -> jax.Array:
    return jnp.max(mask.astype(jnp.int32)) > 0

  block = pl.program_id(0).astype(U32)
  lanes = jax.lax.iota(U32, width)
  in_cell, in_header = lanes < cell_words, lanes < 4
  # Each segment's words: their index in the cell.
  segment_words = [starts[k] + _flat_iota(shape) for k, shape in enumerate(shapes)]
  # Each word is pushed once (docs/DESIGN.md, "Lamport"): a segment narrower
  # than the threads has copies in several, each of which would store it, and
  # a late copy could land after the owner's refill. Such a segment is pushed
  # from a carrier, its values along one more axis wide enough to give every
  # element one thread, by the threads of the carrier's first column only.
  carriers = [carrier_shape(shape, warps) for shape in shapes]

  def carried(k: int, x) -> jax.Array:
    shape = jnp.shape(x)
    return x if carriers[k] == shape else jax.lax.broadcast_in_dim(x, carriers[k], tuple(range(len(shape))))

  first_copy = [jnp.full(carrier, True) if carrier == shape else
                jax.lax.broadcasted_iota(U32, carrier, len(carrier) - 1) == 0
                for shape, carrier in zip(shapes, carriers)]
  rank = table[_RANK]
  own_signal, error, own_lamport = address(_OWN_SIGNAL), address(_ERROR), address(_OWN_LAMPORT)
  zero = jnp.zeros(control, U32)

  # The block's Signal words, as its previous call left them (lamport.h
  # lamport_begin): one element every thread holds, so scalars without a
  # reduction. Independent loads (no dependency between them: issued
  # together, not one round trip after the other); their addresses differ,
  # so none is merged.
  def own_word(name: str):
    return jnp.max(asm(_LOAD_OWN, *own_signal, sig_off[name] + 4 * block, 0, shape=(1,)))

  buffer, calls, previous_packs, served = (own_word(name) for name in OWN_WORDS)
  split = plan.split if row_share is not None else 1
  first = block - block % split  # the row's first block: its meeting word (4b)
  # Words others write (another block's failure, the host, a split row's
  # siblings): at full width.
  if split > 1:
    # The meeting this call's row waits for: the next multiple of 65536, read
    # with the start words, not from the arrival's return a round trip later.
    # Between calls the word is a multiple of 65536, and this call's siblings
    # add less than that before this program does: every reading made before
    # this program's own add has the same high half.
    met_target = jnp.max(load(own_signal, sig_off["row_arrivals"] + 4 * first, zero) & jnp.int32(-65536)) + 65536
  poisoned = load(own_signal, sig_off["poisoned"], zero)
  generation = load(own_signal, sig_off["generation"], zero)
  previous = jnp.where(buffer == 0, jnp.int32(2), buffer - 1)  # B(k - 1), cycling 0, 1, 2
  lowered_for = table[_GENERATION]
  # One reduction: 2 where the channel is not the one this program was
  # lowered for (stale), else 1 where it is poisoned, else 0.
  halted = jnp.max(jnp.where(generation != lowered_for, jnp.int32(2),
                             jnp.where(poisoned != 0, jnp.int32(1), jnp.int32(0))))
  stale, go = halted == 2, halted == 0

  def exchanges_with(p: int):  # channel.h exchanges_with (traced: Pallas Triton lowers no Python bools)
    return rank == p if plan.loopback else rank != p

  def cell_offset(buf, source):
    return ((buf * plan.world + source) * plan.max_blocks + block) * plan.cell_bytes

  def header_base(buf, source):  # the header's first word
    return plan.cells_bytes + ((buf * plan.world + source) * plan.max_blocks + block) * 16

  def header_offset(buf, source):  # word k at lanes k, k + 4, ...
    return header_base(buf, source) + 4 * (lanes & 3)

  def tag_of(words):  # word k of the tag at lanes k, k + 4, ...
    out = jnp.full(words.shape, plan.tag[3], U32)
    for k in (2, 1, 0):
      out = jnp.where((words & 3) == k, jnp.full(words.shape, plan.tag[k], U32), out)
    return out

  tag_words = tag_of(lanes)
  empty = plan.empty_word

  def arrived_not(words, tag):  # header words that arrived and are not `tag` (lamport_header_state)
    return jnp.logical_and(words != empty, words != tag)

  # 1. Push each peer's part, the pad words and the header into this rank's
  #    cell of the peer's buffer B(k). Each segment's stores form one chain
  #    (`sinks`: every store's result ORed, what keeps them, in order: the
  #    module docstring); the pad words' and the header's form the last.
  sinks = [jnp.zeros(shape, U32) for shape in (*carriers, control)]
  for p in range(plan.world):
    enabled = jnp.logical_and(exchanges_with(p), go)
    peer = address(_PEER_LAMPORT + 2 * p)
    cell = cell_offset(buffer, rank)
    for k, segment in enumerate(parts[p]):
      sinks[k] = sinks[k] | store(peer, cell + 4 * carried(k, segment_words[k]), carried(k, on_the_wire(plan, segment)),
                                  jnp.logical_and(enabled, first_copy[k]), sinks[k])
    if cell_words > words_total:
      sinks[-1] = sinks[-1] | store(peer, cell + 4 * lanes, zero,
                                    jnp.logical_and(enabled, jnp.logical_and(lanes >= words_total, in_cell)),
                                    sinks[-1])
    sinks[-1] = sinks[-1] | store(peer, header_offset(buffer, rank), tag_words, jnp.logical_and(enabled, in_header),
                                  sinks[-1])
  by_shape: dict[tuple[int, ...], jax.Array] = {}
  for chain in sinks:  # one reduction per shape
    by_shape[chain.shape] = by_shape[chain.shape] | chain if chain.shape in by_shape else chain
  sink = functools.reduce(jnp.bitwise_or, [jnp.max(chain) for chain in by_shape.values()])

  # 2. Refill the cells and headers of B(k - 1) this block read in its
  #    previous call (lamport.h lamport_refill): its stores overlap the
  #    polls (any time in call k is before call k + 1's pushes, which is all
  #    the reuse argument asks). Not in a halted call: it touches nothing.
  sources = list(range(plan.world))
  previous_words = previous_packs * 4

  def refill_cond(carry):
    return carry[0] * width < previous_words

  def refill_body(carry):
    chunk, acc = carry
    words = chunk * width + lanes
    for q in sources:
      enabled = jnp.logical_and(jnp.logical_and(exchanges_with(q), go), words < previous_words)
      acc = acc | store(own_lamport, cell_offset(previous, q) + 4 * words, jnp.full(control, empty, U32), enabled, acc)
    return chunk + 1, acc

  _, refilled = jax.lax.while_loop(refill_cond, refill_body, (jnp.int32(0), jnp.broadcast_to(sink, control)))
  for q in sources:
    enabled = jnp.logical_and(jnp.logical_and(exchanges_with(q), go), in_header)
    refilled = refilled | store(own_lamport, header_offset(previous, q), jnp.full(control, empty, U32), enabled,
                                refilled)

  # 3. Poll every source's cell (the pad words too: every word refilled
  #    later must have arrived, none lands after the refill) and header of
  #    B(k) until no word is empty, bounded (protocol.h poll_peer): the
  #    deadline, or the peer's poison after the grace. Each poll ends on one
  #    reduction over every source and word: 3 where a header word arrived
  #    that differs from this call's tag (the peer is at another call:
  #    stop, as lamport.h lamport_header_state, before its cells arrive,
  #    which they may never do), else 2 while a word is empty, else 0.
  #    Every CHECK_EVERY-th poll that still waits checks the bounds and the
  #    pending peers' poison (`checked`).
  first_call = served == 0  # until the block met its peers once
  bound = jnp.where(first_call, table[_FIRST_TIMEOUT], table[_TIMEOUT])
  spin_bound = jnp.minimum(bound, _MAX_WAIT_UNITS // _SPINS_PER_UNIT) * _SPINS_PER_UNIT

  def poll(it):
    dep = jnp.broadcast_to(it, control)
    cells = [load_if(own_lamport, cell_offset(buffer, q) + 4 * lanes, in_cell, dep) for q in sources]
    headers = [load_if(own_lamport, header_offset(buffer, q), in_header, dep) for q in sources]
    return cells, headers

  def empty_in(cell, header):
    return jnp.logical_or(jnp.logical_and(in_cell, cell == empty), jnp.logical_and(in_header, header == empty))

  def other_call(header):  # on the header's lanes: words of another call
    return jnp.logical_and(in_header, arrived_not(header, tag_words))

  def state(cells, headers):
    codes = [jnp.where(exchanges_with(q), jnp.where(other_call(h), jnp.int32(3), jnp.where(
        empty_in(c, h), jnp.int32(2), jnp.int32(0))), jnp.int32(0)) for q, c, h in zip(sources, cells, headers)]
    return jnp.max(functools.reduce(jnp.maximum, codes))

  def first_of(flags) -> jax.Array:  # the lowest rank whose flag is set, else world
    out = jnp.int32(plan.world)
    for q in reversed(sources):
      out = jnp.where(flags[q], jnp.int32(q), out)
    return out

  def checked(it, cells, headers, start):
    """(the peer the wait failed on, else -1; whether it gave up; the clock
    the bound counts from): past a bound, the first pending peer; a pending
    peer whose poison word is set (looked at after the grace), that one.
    The bound counts from the first check, as protocol.h poll_peer's from
    its first look at the clock: a call whose data lands in its first polls
    never reads the clock."""
    now = clock(jnp.broadcast_to(it, control) | cells[0])
    start = jnp.where(it == CHECK_EVERY - 1, now, start)
    elapsed = now - start
    late = jnp.logical_or(any_(elapsed > bound), it - (CHECK_EVERY - 1) > spin_bound)  # both from the first check
    pending = [jnp.logical_and(exchanges_with(q), any_(empty_in(c, h))) for q, c, h in zip(sources, cells, headers)]
    look = elapsed > plan.grace_units
    gave = [jnp.logical_and(pending[q], any_(load_if(address(_PEER_SIGNAL + 2 * q), sig_off["poisoned"],
                                                     jnp.logical_and(look, pending[q]),
                                                     jnp.broadcast_to(it, control)) != 0))
            for q in sources]
    gave_up = functools.reduce(jnp.logical_or, gave)
    failed_peer = jnp.where(jnp.logical_or(late, gave_up), jnp.where(gave_up, first_of(gave), first_of(pending)), -1)
    return failed_peer.astype(jnp.int32), gave_up.astype(jnp.int32), start

  # Carries are int32, flags too: Pallas Triton mistypes bool loop values.
  def cond(carry):
    _, waiting, failed_peer = carry[:3]
    return jnp.logical_and(waiting > 0, failed_peer < 0)

  def landing(headers):  # 1 where a header of another call has words still empty (it may land in parts)
    return functools.reduce(jnp.logical_or, [jnp.logical_and(
        exchanges_with(q), jnp.logical_and(any_(other_call(h)), any_(jnp.logical_and(in_header, h == empty))))
        for q, h in zip(sources, headers)]).astype(jnp.int32)

  def body(carry):
    it, start = carry[0], carry[5]
    cells, headers = poll(it)
    code = state(cells, headers)
    # Another call's header is recorded whole: wait for its last words (bounded as any wait).
    partial = jax.lax.cond(code == 3, lambda: landing(headers), lambda: _scalars(it, 0)[0])
    waiting = jnp.logical_or(code == 2, partial > 0)
    check = jnp.logical_and(waiting, (it & (CHECK_EVERY - 1)) == CHECK_EVERY - 1)
    failed_peer, gave_up, start = jax.lax.cond(check, lambda: checked(it, cells, headers, start),
                                               lambda: (*_scalars(it, -1, 0), start))
    return (it + 1, waiting.astype(jnp.int32), failed_peer, gave_up, code, start, *(cells if as_polled else ()))

  init = (sink, go.astype(jnp.int32), jnp.int32(-1), jnp.int32(0), jnp.int32(0), zero,
          *([zero] * plan.world if as_polled else ()))
  it, _, failed_peer, gave_up, code, _, *polled = jax.lax.while_loop(cond, body, init)
  gave_up = gave_up > 0
  timed_out = failed_peer >= 0
  if as_polled:
    cells = [(c,) for c in polled]
  else:  # every word arrived, and stays until this rank refills it: any thread's load now reads it
    cells = [tuple(asm(_LOAD_ARRIVED, *own_lamport, cell_offset(buffer, q) + 4 * segment_words[k],
                       jnp.broadcast_to(it, shape), shape=shape) for k, shape in enumerate(shapes))
             for q in sources]

  # 4. A peer at another call.
  mismatch = jnp.logical_and(jnp.logical_and(go, jnp.logical_not(timed_out)), code == 3)
  exchanged = jnp.logical_and(go, jnp.logical_not(jnp.logical_or(timed_out, mismatch)))
  cells = [tuple(jnp.where(exchanges_with(q), c, jnp.zeros(c.shape, U32)) for c in cell)
           for q, cell in enumerate(cells)]

  # 4b. A row over several programs (the fused op, plan.split > 1): they
  #     meet on this rank's Signal and each sums the row's shares in program
  #     order (docs/DESIGN.md, "Triton kernels"). Every program meets, also
  #     one that failed: it sets its share's sign bit (a sum of squares never
  #     has it), and every program of the row then fails with it.
  row_total, met_late, row_failed = None, None, None
  if row_share is not None:
    row_total = row_share(cells, rank)
  if split > 1:
    head = lanes == 0
    share_bits = jax.lax.bitcast_convert_type(row_total, U32)
    # A NaN by its bits, not x != x, which a fast-math compile may fold away: NOT_MET is the NaN a GPU makes.
    share_bits = jnp.where((share_bits & jnp.int32(0x7FFFFFFF)) > jnp.int32(0x7F800000), jnp.int32(CANONICAL_NAN),
                           share_bits)
    share_bits = jnp.broadcast_to(jnp.where(exchanged, share_bits, share_bits | jnp.int32(-2**31)), control)

    def slot(t):  # the row's t-th share slot: the row's first block's
      return sig_off["row_shares"] + 8 * (first * _native.MAX_ROW_SPLIT + t)

    # This program's share, tagged with the call (never 0: the target's low half is 0), then the row's slots
    # this call's split leaves unused, reset to 0, so that no later call of more programs finds an older
    # call's share there: every slot then holds 0 or this row's last call's tag.
    tag = met_target + 1
    put = store_slot(own_signal, slot(block - first), share_bits, tag, head, share_bits)
    for k in range(1, _native.MAX_ROW_SPLIT // split):
      put = put | store_slot(own_signal, slot(block - first + k * split), zero, zero, head, put)
    # After the start's reading of the word (the dependency): else it could read this program's own add.
    arrived = asm(_ADD, *own_signal, sig_off["row_arrivals"] + 4 * first, head.astype(U32), 65536 // split,
                  put | met_target)
    met_start = clock(arrived)
    # Above every exchange bound a sibling may have, its first call's too
    # (its block may not have served where this one has): a sibling still
    # waiting for a peer records that peer's timeout before this wait ends.
    longest = jnp.maximum(table[_FIRST_TIMEOUT], table[_TIMEOUT])
    met_bound = jnp.minimum(longest, _MAX_WAIT_UNITS - table[_TIMEOUT]) + table[_TIMEOUT]
    met_spins = jnp.minimum(met_bound, _MAX_WAIT_UNITS // _SPINS_PER_UNIT) * _SPINS_PER_UNIT
    share_lane = lanes < split

    def met_cond(carry):
      return jnp.logical_and(carry[1] == 0, carry[2] == 0)

    def met_body(carry):
      step = jnp.broadcast_to(carry[0], control)
      # Lane t reads slot t whole: where its tag is this call's, its share is this call's.
      shares = asm(_LOAD_SLOT, *own_signal, slot(jnp.where(share_lane, lanes, 0)), share_lane.astype(U32), tag, step)
      met = jnp.min(jnp.logical_or(jnp.logical_not(share_lane), shares != NOT_MET).astype(jnp.int32)) > 0
      waited = clock(step | shares) - met_start
      late = jnp.logical_and(jnp.logical_not(met), jnp.logical_or(any_(waited > met_bound), carry[0] > met_spins))
      return carry[0] + 1, met.astype(jnp.int32), late.astype(jnp.int32), shares

    _, _, late, shares = jax.lax.while_loop(met_cond, met_body, (jnp.max(arrived), jnp.int32(0), jnp.int32(0), zero))
    row_late = late > 0
    met_late = jnp.logical_and(row_late, exchanged)
    # A program of a failed row that exchanged well still refills and advances its block: every failure
    # poisons the channel (the record below), so no later call reads that block's buffers.
    row_failed = jnp.logical_or(row_late, jnp.min(jnp.where(share_lane, shares, 0)) < 0)
    row_total = functools.reduce(jnp.add, [jax.lax.bitcast_convert_type(
        jnp.max(jnp.where(lanes == t, shares & jnp.int32(0x7FFFFFFF), 0)), jnp.float32) for t in range(split)])
    sink = sink | put

  # 5. A failure is recorded once per channel (the poison word's claim); a
  #    row whose programs did not all meet, where this program's own waits
  #    ended well, names this rank. Only a failing call reads what the
  #    record needs (the headers a peer wrote).
  # int32 constants, not Python ints: jnp.where(b, 1, 0) lowers to a 1-bit value in Pallas Triton.
  kinds = [jnp.int32(k) for k in (plan.failure_stale, plan.failure_mismatch, plan.failure_timeout)]
  if met_late is not None:
    timed_out = jnp.logical_or(timed_out, met_late)
    failed_peer = jnp.where(met_late, rank, failed_peer)
    first_call = jnp.logical_and(first_call, jnp.logical_not(met_late))  # not the first call's skew: a sibling stuck
  record = jnp.logical_or(stale, jnp.logical_or(timed_out, mismatch))

  def record_failure():
    # Lane 0 writes the record from its own readings, without a reduction,
    # and every load is off unless the call records: where the compiler
    # hoists this pure code out of the branch, a call that does not fail
    # pays no load and no barrier for it.
    dep = jnp.broadcast_to(it, control)
    reads = jnp.logical_and(record, lanes == 0)
    header_words = [[load_if(own_lamport, header_base(buffer, q) + 4 * k, reads, dep)
                     for k in range(4)] for q in sources]
    other = [functools.reduce(jnp.logical_or, [arrived_not(w, jnp.full(control, plan.tag[k], U32))
                                               for k, w in enumerate(words)]) for words in header_words]
    mismatch_peer = first_of([jnp.logical_and(exchanges_with(q), other[q]) for q in sources])
    seen = [zero] * 4  # the header the mismatching peer wrote
    for q, words in zip(sources, header_words):
      seen = [jnp.where(jnp.logical_and(mismatch, mismatch_peer == q), w, s) for w, s in zip(words, seen)]
    kind = jnp.where(stale, kinds[0], jnp.where(mismatch, kinds[1], kinds[2]))
    peer = jnp.where(stale, -1, jnp.where(mismatch, mismatch_peer, failed_peer))
    epoch = jnp.where(stale, lowered_for, calls + 1)
    # `record` in the predicate too: the asm is pure to the compiler, which may hoist it out of this branch.
    return asm(_record_asm(err_off, sig_off["poisoned"], plan.error_complete), *own_signal, *error,
               reads.astype(U32), kind, rank, peer.astype(U32), epoch,
               jnp.logical_and(gave_up, timed_out).astype(U32), first_call.astype(U32),
               *[jnp.int32(t) for t in plan.tag], *seen, generation, dep)

  recorded = jax.lax.cond(record, record_failure, lambda: jnp.broadcast_to(_scalars(it, 0)[0], control))
  done = jnp.logical_and(go, jnp.logical_not(jnp.logical_or(timed_out, mismatch)))

  # 6. Advance (lamport.h lamport_advance), after the failure record: the
  #    refill's chain started before the polls, so the record and the
  #    row's share (in `sink`) join it here, or nothing would keep them.
  refilled = refilled | recorded | jnp.broadcast_to(sink, control)
  following = jnp.where(buffer == 2, jnp.int32(0), buffer + 1)
  head = jnp.logical_and(done, lanes == 0)
  for name, value in (("served", 1), ("lamport_calls", calls + 1), ("lamport_buffer", following),
                      ("lamport_packs", packs)):
    refilled = refilled | store(own_signal, sig_off[name] + 4 * block,
                                jnp.broadcast_to(jnp.asarray(value, U32), control), head, refilled)
  if row_failed is not None:
    done = jnp.logical_and(done, jnp.logical_not(row_failed))
  return done, cells, rank, jnp.max(refilled), row_total


def _scalars(like: jax.Array, *values: int) -> tuple[jax.Array, ...]:
  """int32 scalars computed from the traced ``like``: a branch of lax.cond
  may not return a literal in Pallas Triton."""
  return tuple(like * 0 + jnp.int32(v) for v in values)


def carrier_shape(shape: tuple[int, ...], warps: int) -> tuple[int, ...]:
  """``shape``, or where it has fewer elements than a program of ``warps``
  warps has threads, ``shape`` and one more axis that makes up the number
  (every size a power of two, as Triton's)."""
  size = int(np.prod(shape))
  threads = 32 * warps
  return tuple(shape) if size >= threads else (*shape, -(-threads // size))


def wide_warps(words: int) -> int:
  """Warps for a program that holds ``words`` words (every source's block)
  at once while it polls: more warps for more words, 4 to 16."""
  return min(16, 1 << max(2, (words // 2048).bit_length() - 1))


def warps_for(block_words: int, wanted: int) -> int:
  """``wanted`` warps, or fewer where the block has fewer words than their
  threads: lamport_exchange then takes its polls' words as the block's."""
  return max(1, min(wanted, block_words // 32))


def sum_in_rank_order(parts, dtype: str) -> tuple[jax.Array, ...]:
  """The sum of the sources' words ``parts`` in rank order 0..N-1, fp32
  from 0 (numeric.h sum_in_rank_order), not yet rounded: one float32
  per element, (low halves, high halves) for bfloat16."""
  if dtype == "float32":
    total = jnp.zeros(parts[0].shape, jnp.float32)
    for part in parts:
      total = total + jax.lax.bitcast_convert_type(part, jnp.float32)
    return (total,)
  low, high = jnp.zeros(parts[0].shape, jnp.float32), jnp.zeros(parts[0].shape, jnp.float32)
  for part in parts:
    part_low, part_high = halves(part)
    low, high = low + part_low, high + part_high
  return low, high


def to_elements(words: jax.Array, dtype: str) -> tuple[jax.Array, ...]:
  """The float32 values of ``words``, as sum_in_rank_order lays them out."""
  return (jax.lax.bitcast_convert_type(words, jnp.float32),) if dtype == "float32" else halves(words)


def to_words(values: tuple[jax.Array, ...], dtype: str) -> jax.Array:
  """float32 ``values`` rounded once to ``dtype``, as 32-bit words."""
  if dtype == "float32":
    return jax.lax.bitcast_convert_type(values[0], U32)
  from jax.experimental.pallas import triton as plt
  low, high = (jax.lax.bitcast_convert_type(v, U32) for v in values)
  (words,) = plt.elementwise_inline_asm(_ROUND_PAIR, args=[low, high], constraints="=r,r,r", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(low.shape, U32)])
  return words


def with_own(plan: Plan, rank: jax.Array, mine: list, cells: list) -> list:
  """Every source's words of a block: the cells, but this rank's own words
  from ``mine`` as the wire carries them (its peers sum those: the same bits
  on every rank, C9), except under loopback, where its own cell holds them
  (channel.h from_own_input)."""
  return [c if plan.loopback else jnp.where(rank == q, on_the_wire(plan, m), c)
          for q, (m, c) in enumerate(zip(mine, cells))]


def on_the_wire(plan: Plan, words: jax.Array) -> jax.Array:
  """``words`` as they go on the wire: the empty word (a NaN) rewritten
  to another NaN (lamport.h lamport_encode)."""
  return jnp.where(words == plan.empty_word, jnp.full(words.shape, plan.nan_word, U32), words)


def failed_outputs(done: jax.Array, sink: jax.Array) -> jax.Array:
  """Where the outputs take NaN: the call could not finish (C8). ``sink``
  (always 0) keeps every store (the module docstring)."""
  return jnp.logical_or(jnp.logical_not(done), sink != 0)


def launch(kernel: Callable, plan: Plan, op: str, *, channel: str, warps: int, operands: list, in_specs: list,
            out_shapes: list, out_specs: list, poison_word: int | None) -> list[jax.Array]:
  """The pallas_call of ``kernel(table_ref, *input refs, *output refs)``
  over plan.grid programs of ``warps`` warps, named for ``op`` and the
  channel (visible in the emitted call); ``operands[0]`` is this device's
  table row. With ``poison_word`` (poison_outputs), each output starts as
  that word everywhere (an aliased input the kernel never reads), so an
  element the kernel does not write reads as NaN."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt

  inputs, aliases = len(operands) - 1, {}
  if poison_word is not None:
    aliases = {len(operands) + k: k for k in range(len(out_shapes))}
    operands = [*operands, *[jnp.full(shape.shape, poison_word, shape.dtype) for shape in out_shapes]]
    in_specs = [*in_specs, *out_specs]

  def body(table_ref, *refs):  # refs: the inputs, (the poisoned outputs,) the outputs
    kernel(table_ref, *refs[:inputs], *refs[len(refs) - len(out_shapes):])
  return pl.pallas_call(body, out_shape=out_shapes, grid=(plan.grid,), in_specs=in_specs, out_specs=out_specs,
                        input_output_aliases=aliases,
                        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1),
                        name=f"b12x_{op}_lamport_{channel}", metadata={"b12x_channel": channel})(*operands)


def table_spec():
  from jax.experimental import pallas as pl
  return pl.BlockSpec((ROW_WORDS,), lambda i: (0,))


def as_words(a: jax.Array) -> jax.Array:
  """``a`` (float32 or bfloat16) as the 32-bit words the wire carries."""
  return jax.lax.bitcast_convert_type(a.reshape(-1) if a.dtype == jnp.float32 else a.reshape(-1, 2), U32)
