"""The FFI and the Triton kernel of the same Lamport protocol, side by side on
one GPU, through loopback (docs/DESIGN.md, "Loopback"): a group of one
whose peer is itself runs every step of the exchange (pushes to the "peer"
buffers, polls, sum, refill), so both kernel kinds are timed in one run.

Each measurement is one executable of `--ops` chained all_reduces (each
consumes the previous result) of float32 or bfloat16, the median per op
over `--iters` runs. Before timing, every size
and dtype is checked: the result of a loopback all_reduce is its input, bit
for bit, and the epoch advances once per call; then FFI and Triton calls
interleave on one channel (float32 takes the Triton kernel, float16 the
FFI one). Each kernel is timed beside its floor, one run of each in turn
(b12x_jax.calibration.paired_per_op_us: a drift of the GPU's clocks falls
on both, and the difference is the median of the rounds' differences):
the Triton kernel beside a protocol-free exchange of the same bytes
launched as it is (stores, bounded polls, reset; nothing else), the FFI
kernel beside an FFI call that launches one empty kernel. Then the fused
all_reduce + residual + RMSNorm, bfloat16, chained (each call's normed output and new residual feed the next), on each kernel
kind, against all_reduce on the same kind followed by the add and the norm
in jnp (the two timed in turn), at hidden 4096 and 8192 and 1, 8 and 64 rows (outputs checked
against float64 first). Last, dcp_a2a in the Lamport window, bfloat16,
chained (each merge's output is the next one's input), at decode shapes
B x H x D: through loopback the merge of one source gives back its input,
bit for bit (and 0, lse -inf, where its lse is -inf), checked first; the
Triton kernel timed in turn with the floor of its payload.

  python benchmarks/loopback_kernels.py [--json out.json] [--skip-all-reduce] [--skip-fused] [--skip-dcp]
    [--kernels triton]
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import add_and_norm, add_timing_arguments, paired_per_op_us, size_label
from jax.sharding import PartitionSpec as P

import b12x_jax

SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}


def random(rng, nbytes: int, dtype: str) -> np.ndarray:
  return rng.standard_normal(nbytes // np.dtype(DTYPES[dtype]).itemsize).astype(np.float32).astype(DTYPES[dtype])


def put(mesh, x):
  return jax.device_put(jnp.asarray(x), jax.sharding.NamedSharding(mesh, P("x")))


def chained(mesh, ops: int):
  def body(x):
    for _ in range(ops):
      x = b12x_jax.all_reduce(x, "x")
    return x
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def check(mesh, comm, kernels: str, rng) -> None:
  """Every size and dtype, three times (every Lamport buffer), against its
  input, bit for bit; the epoch counts every call."""
  one = chained(mesh, 1)
  device = mesh.devices.flat[0]
  comm.prepare(mesh, "x", channels=[f"check-{kernels}"])
  with b12x_jax.channel(f"check-{kernels}"):
    for dtype in DTYPES:
      for size in SIZES:
        for _ in range(3):
          x = random(rng, size, dtype)
          before = comm.stats(f"check-{kernels}", device)["epoch"]
          got = np.asarray(one(put(mesh, x)))
          assert got.view(np.uint8).tolist() == x.view(np.uint8).tolist(), (kernels, dtype, size)
          assert comm.decisions[-1].kernel == kernels, comm.decisions[-1]
          assert comm.stats(f"check-{kernels}", device)["epoch"] == before + 1, (kernels, dtype, size)
  comm.check_errors()


def interleave(mesh, comm, rng) -> None:
  """float32 (Triton) and float16 (FFI) calls in turn on one channel."""
  def body(x, y):
    for _ in range(8):
      x = b12x_jax.all_reduce(x, "x")
      y = b12x_jax.all_reduce(y, "x")
    return x, y
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
  with b12x_jax.channel("mixed"):
    for _ in range(3):
      x = rng.standard_normal(4096).astype(np.float32)
      y = rng.standard_normal(4096).astype(np.float16)
      gx, gy = fn(put(mesh, x), put(mesh, y))
      assert np.array_equal(np.asarray(gx).view(np.uint32), x.view(np.uint32))
      assert np.array_equal(np.asarray(gy).view(np.uint16), np.asarray(y).view(np.uint16))
    kinds = {d.kernel for d in comm.decisions[-16:]}
    assert kinds == {"ffi", "triton"}, kinds
    assert comm.stats("mixed", mesh.devices.flat[0])["epoch"] == 3 * 16
  comm.check_errors()


FUSED_SHAPES = [(rows, hidden) for hidden in (4096, 8192) for rows in (1, 8, 64)]


def chained_fused(mesh, ops: int, fused: bool):
  def body(x, residual, weight):
    for _ in range(ops):
      if fused:
        x, residual = b12x_jax.all_reduce_residual_rmsnorm(x, residual, weight, "x")
      else:
        x, residual = add_and_norm(b12x_jax.all_reduce(x, "x"), residual, weight)
    return x, residual
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=(P("x"), P())))


def time_fused(mesh, kernels: str, args, rng) -> dict[tuple[int, int], dict[str, float]]:
  """us per op of the fused op and of all_reduce + jnp on ``kernels``;
  each shape's one-op results checked against float64 first."""
  times = {}
  with b12x_jax.channel(f"fused-{kernels}"):
    for rows, hidden in FUSED_SHAPES:
      x, residual = (rng.standard_normal((rows, hidden)).astype(jnp.bfloat16) for _ in range(2))
      weight = (1 + 0.1 * rng.standard_normal(hidden)).astype(jnp.bfloat16)
      args_on = (put(mesh, x), jnp.asarray(residual), jnp.asarray(weight))
      normed, new_residual = (np.asarray(o) for o in chained_fused(mesh, 1, True)(*args_on))
      # bfloat16: within a few roundings of float64 (the tests bound it tighter).
      want = x.astype(np.float64) + residual.astype(np.float64)
      assert np.allclose(new_residual.astype(np.float64), want, rtol=1e-2, atol=1e-2), (kernels, rows, hidden)
      r = new_residual.astype(np.float64)
      want = r / np.sqrt(np.mean(r * r, -1, keepdims=True) + 1e-6) * weight.astype(np.float64)
      assert np.allclose(normed.astype(np.float64), want, rtol=2e-2, atol=2e-2), (kernels, rows, hidden)
      fused, unfused = chained_fused(mesh, args.ops, True), chained_fused(mesh, args.ops, False)
      paired = paired_per_op_us({"unfused": lambda: unfused(*args_on), "fused": lambda: fused(*args_on)}, args.ops,
                                args.iters)
      times[rows, hidden] = {f"{name} {kernels}": paired[name] for name in ("fused", "unfused")}
  return times


DCP_SHAPES = [(1, 8, 128), (1, 32, 128), (4, 16, 128), (8, 32, 128)]


def chained_dcp(mesh, ops: int):
  def body(out, lse):
    for _ in range(ops):
      out = b12x_jax.dcp_a2a(out, lse, "x")
    return out
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))


def time_dcp(mesh, comm, kernels: str, args, rng, floor_of=None) -> dict[tuple[int, int, int], dict[str, float]]:
  """us per dcp_a2a on ``kernels`` at each DCP_SHAPES shape, timed in turn
  with ``floor_of(nbytes)``'s run where given (its payload, in 4 KiB);
  one call's result checked first (three times: every Lamport buffer)."""
  times = {}
  one = chained_dcp(mesh, 1)
  with b12x_jax.channel(f"dcp-{kernels}"):
    for shape in DCP_SHAPES:
      for _ in range(3):
        out = rng.standard_normal(shape).astype(jnp.bfloat16)
        lse = rng.standard_normal(shape[:2]).astype(np.float32)
        lse[0, 0] = -np.inf  # an empty KV shard: weight 0, its payload never read
        got = np.asarray(one(put(mesh, out), put(mesh, lse)))
        want = out.copy()
        want[0, 0] = 0
        assert got.view(np.uint16).tolist() == want.view(np.uint16).tolist(), (kernels, shape)
        assert comm.decisions[-1].kernel == kernels, comm.decisions[-1]
      fn = chained_dcp(mesh, args.ops)
      ins = (put(mesh, out), put(mesh, lse))
      runs = {kernels: lambda: fn(*ins)}
      if floor_of is not None:
        runs = {"floor": floor_of(-(-int(np.prod(shape)) * 2 // 4096) * 4096), **runs}
      times[shape] = paired_per_op_us(runs, args.ops, args.iters)
  return times


# -- the floors: what a call costs with no protocol ---------------------------

# A word no random input holds (a NaN's bits): a floor cell not yet written.
_EMPTY = -1
_FLOOR_BOUND = 1 << 22  # polls: a floor never hangs
# Store $3 at ({$1, $2} + $4), or load from there; $5 / $4: a dependency, not read.
_FLOOR_STORE = ("{ .reg .b64 a; .reg .b64 o; mov.b64 a, {$1, $2}; cvt.u64.u32 o, $4; add.u64 a, a, o; "
                "st.volatile.global.u32 [a], $3; mov.u32 $0, 0; }")
_FLOOR_LOAD = ("{ .reg .b64 a; .reg .b64 o; mov.b64 a, {$1, $2}; cvt.u64.u32 o, $3; add.u64 a, a, o; "
               "ld.volatile.global.u32 $0, [a]; }")
_scratch: list = []  # the floor's cells, kept alive while executables point at them


def exchange_floor(words: int, ops: int):
  """``ops`` chained protocol-free exchanges of ``words`` int32 words, one
  pallas_call each, launched as the Triton kernel is (grid of 4 KiB blocks
  up to 64, as the Lamport plan takes): every program stores its words into
  cells in device memory, polls them (bounded) until none is empty, resets
  them and returns what it read, which is its input. No tag, header,
  generation, error record or counter: the exchange alone."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt

  if not _scratch:
    _scratch.append(jnp.full(((1 << 20) // 4 * 4,), _EMPTY, jnp.int32).block_until_ready())
  base = _scratch[0].unsafe_buffer_pointer()
  assert words <= _scratch[0].size, words
  grid = min(64, max(1, words // 1024))
  block = words // grid
  warps = max(1, min(4, block // 32))
  address = jnp.asarray(np.array([base & 0xFFFFFFFF, base >> 32], np.uint32).view(np.int32))

  def asm(code, *args):
    args = [jnp.broadcast_to(jnp.asarray(a, jnp.int32), (block,)) for a in args]
    (out,) = plt.elementwise_inline_asm(code, args=args, constraints="=r," + ",".join(["r"] * len(args)), pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct((block,), jnp.int32)])
    return out

  def kernel(address_ref, x_ref, y_ref):
    lo, hi = address_ref[0], address_ref[1]
    offsets = (pl.program_id(0) * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)) * 4
    stored = asm(_FLOOR_STORE, lo, hi, x_ref[...], offsets)

    def waiting(carry):
      bits, polls = carry
      return jnp.logical_and(jnp.max((bits == _EMPTY).astype(jnp.int32)) > 0, polls < _FLOOR_BOUND)

    def poll(carry):
      bits, polls = carry
      return asm(_FLOOR_LOAD, lo, hi, offsets, bits), polls + 1

    bits, _ = jax.lax.while_loop(waiting, poll, (jnp.full((block,), _EMPTY, jnp.int32) + stored, jnp.int32(0)))
    reset = asm(_FLOOR_STORE, lo, hi, jnp.full((block,), _EMPTY, jnp.int32), offsets + (bits - bits))
    y_ref[...] = bits + reset

  def one(x):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(grid,),
                          in_specs=[pl.BlockSpec((2,), lambda i: (0,)), pl.BlockSpec((block,), lambda i: (i,))],
                          out_specs=pl.BlockSpec((block,), lambda i: (i,)),
                          compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1),
                          name="floor_exchange")(address, x)

  def body(x):
    for _ in range(ops):
      x = one(x)
    return x
  return jax.jit(body)


def empty_ffi_call(ops: int):
  """``ops`` chained FFI calls that each launch one empty kernel, bound as
  the collectives are (no side effect; the output aliases the input): what
  XLA charges an FFI call here."""
  from b12x_jax import _native
  _native.ensure_registered()

  def body(x):
    for _ in range(ops):
      x = jax.ffi.ffi_call("b12x_dispatch_probe", jax.ShapeDtypeStruct(x.shape, x.dtype),
                           input_output_aliases={0: 0})(x)
    return x
  return jax.jit(body)


def checked_floor(nbytes: int, ops: int, rng):
  """``ops`` chained exchange floors of ``nbytes``, once checked (one floor
  returns its input, bit for bit, three times), and an input for them."""
  words = nbytes // 4
  x = jnp.asarray(rng.standard_normal(words).astype(np.float32).view(np.int32))
  one = exchange_floor(words, 1)
  for _ in range(3):
    assert np.array_equal(np.asarray(one(x)), np.asarray(x)), nbytes
  floor = exchange_floor(words, ops)
  return lambda: floor(x)


def us(times: dict[str, float], name: str, width: int) -> str:
  """``times[name]`` in a column of ``width``; nan where that kind was not timed."""
  return f"{times.get(name, float('nan')):{width}.2f}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add_timing_arguments(parser, devices=False)
  parser.add_argument("--skip-all-reduce", action="store_true", help="do not time all_reduce beside its floors")
  parser.add_argument("--skip-fused", action="store_true", help="do not time the fused op")
  parser.add_argument("--skip-dcp", action="store_true", help="do not time dcp_a2a")
  parser.add_argument("--kernels", default="ffi,triton", help="the kernel kinds to time, comma-separated")
  parser.set_defaults(ops=256, iters=30)
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    sys.exit(f"loopback_kernels.py needs a GPU (the Triton kernel has no {jax.default_backend()} path)")
  mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
  rng = np.random.default_rng(0)
  times: dict[tuple[str, int], dict[str, float]] = {(d, size): {} for d in DTYPES for size in SIZES}
  fused: dict[tuple[int, int], dict[str, float]] = {shape: {} for shape in FUSED_SHAPES}
  dcp: dict[tuple[int, int, int], dict[str, float]] = {shape: {} for shape in DCP_SHAPES}
  floors = {}  # size -> the checked floor's run

  def floor_of(nbytes: int):
    if nbytes not in floors:
      floors[nbytes] = checked_floor(nbytes, args.ops, rng)
    return floors[nbytes]

  empty = empty_ffi_call(args.ops)
  kinds = list(dict.fromkeys(args.kernels.split(",")))  # each kind once
  if not kinds or set(kinds) - {"ffi", "triton"}:
    sys.exit(f"--kernels takes ffi and triton, not {args.kernels!r}")
  for kernels in kinds:
    comm = b12x_jax.Communicator(loopback=True, kernels=kernels)
    b12x_jax.get_communicator().close()
    b12x_jax.set_communicator(comm)
    check(mesh, comm, kernels, rng)
    if kernels == "triton":
      interleave(mesh, comm, rng)
    fn = chained(mesh, args.ops)
    with b12x_jax.channel(f"time-{kernels}"):
      for dtype, size in () if args.skip_all_reduce else times:
        x = put(mesh, random(rng, size, dtype))
        floor_name, floor = ("empty ffi", lambda x=x: empty(x)) if kernels == "ffi" else ("floor", floor_of(size))
        times[dtype, size].update(paired_per_op_us({floor_name: floor, kernels: lambda x=x: fn(x)}, args.ops,
                                                   args.iters))
    if not args.skip_fused:
      for shape, row in time_fused(mesh, kernels, args, rng).items():
        fused[shape].update(row)
    if not args.skip_dcp:
      for shape, t in time_dcp(mesh, comm, kernels, args, rng, floor_of if kernels == "triton" else None).items():
        dcp[shape].update(t)
    comm.check_errors()
    comm.close()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, loopback, {args.ops} chained ops, "
        f"median of {args.iters}")
  if not args.skip_all_reduce:
    print("floor: a protocol-free exchange of the same bytes, launched as the Triton kernel, timed in turn with "
          "it; empty ffi: an FFI call that launches one empty kernel, timed in turn with the FFI kernel; "
          "the differences: medians of the rounds' differences")
    print(f"{'dtype':>9} {'size':>8} {'ffi us':>8} {'triton us':>10} {'floor us':>9} {'empty ffi':>10} "
          f"{'triton-floor':>13} {'ffi-empty':>10}")
    for (dtype, size), t in times.items():
      print(f"{dtype:>9} {size_label(size):>8} {us(t, 'ffi', 8)} {us(t, 'triton', 10)} {us(t, 'floor', 9)} "
            f"{us(t, 'empty ffi', 10)} {us(t, 'triton - floor', 13)} {us(t, 'ffi - empty ffi', 10)}")
  if not args.skip_fused:
    print("\nall_reduce + residual + RMSNorm, bfloat16, us per op (unfused: all_reduce on the same kernel kind, "
          "then jnp)")
    columns = ["fused ffi", "unfused ffi", "fused triton", "unfused triton"]
    print(f"{'rows x hidden':>14} " + " ".join(f"{c:>14}" for c in columns) + f" {'unfused/fused triton':>21}")
    for (rows, hidden), t in fused.items():
      ratio = t.get("unfused triton", float("nan")) / t.get("fused triton", float("nan"))
      print(f"{f'{rows} x {hidden}':>14} " + " ".join(us(t, c, 14) for c in columns) + f" {ratio:20.2f}x")
  if not args.skip_dcp:
    print("\ndcp_a2a in the Lamport window, bfloat16, us per op")
    print(f"{'B x H x D':>14} {'ffi us':>8} {'triton us':>10} {'ffi - triton':>13} {'floor us':>9} "
          f"{'triton-floor':>13}")
    for shape, t in dcp.items():
      gap = t.get("ffi", float("nan")) - t.get("triton", float("nan"))
      print(f"{' x '.join(map(str, shape)):>14} {us(t, 'ffi', 8)} {us(t, 'triton', 10)} {gap:13.2f} "
            f"{us(t, 'floor', 9)} {us(t, 'triton - floor', 13)}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({**{f"{d}/{k}": v for (d, k), v in times.items()},
                 **{f"fused/{r}x{h}": v for (r, h), v in fused.items()},
                 **{"dcp/" + "x".join(map(str, shape)): v for shape, v in dcp.items()}}, f, indent=1)


if __name__ == "__main__":
  main()
