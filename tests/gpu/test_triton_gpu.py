"""The Triton Lamport all_reduce on one GPU through loopback (docs/DESIGN.md,
"Loopback", "Triton kernels"; marked gpu, skipped without a GPU): a group
of one whose peer is itself runs the kernel's whole protocol. Its result is
its input, bit for bit, at every power-of-two size of the Lamport window,
float32 and bfloat16, with poisoned outputs; the kernels round to
bfloat16 as CUDA does; Triton and FFI calls interleave on one channel; the
kernel is right across the counter wrap; and an executable lowered before
a release never runs on the channel's memory afterwards: NaN outputs and an
error from check_errors, after the release and after the next preparation;
and in XLA's PTX each kernel waits for the kernel before it first and lets
none start early. Across ranks: tests/test_gpu_rig.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fresh_communicator
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax
from conftest import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")]
SIZES = [16, 32, 256, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]


def _mesh():
  return jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1])


def _put(mesh, x):
  return jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("x")))


def _sum(mesh):
  return jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def _same_bits(got, want) -> bool:
  return np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_every_size_comes_back_bit_for_bit_with_poisoned_outputs(dtype):
  mesh = _mesh()
  rng = np.random.default_rng(11)
  with fresh_communicator(loopback=True, kernels="triton", poison_outputs=True) as comm, b12x_jax.channel("sizes"):
    for size in SIZES:
      for call in range(3):  # three calls: every Lamport buffer
        x = rng.standard_normal(size // np.dtype(dtype).itemsize).astype(np.float32).astype(dtype)
        assert _same_bits(_sum(mesh)(_put(mesh, x)), x), (size, call)
    assert {d.kernel for d in comm.decisions} == {"triton"}, comm.decisions
    assert comm.stats("sizes", mesh.devices.flat[0])["epoch"] == 3 * len(SIZES)
    comm.check_errors()


def _cuda_bfloat16_bits(f: np.ndarray) -> np.ndarray:
  """__float2bfloat16_rn of float32 ``f`` on the host: to nearest, ties to even, every NaN 0x7FFF."""
  bits = f.view(np.uint32).astype(np.uint64)
  rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
  return np.where(np.isnan(f), 0x7FFF, rounded).astype(np.uint32)


def test_the_kernels_round_to_bfloat16_as_cuda_does():
  # Every bfloat16 output of the Triton kernels goes through to_words: ties
  # both ways, the largest finite value's carry into infinity, subnormals,
  # NaNs with any payload, and random words, in both halves of a word.
  from jax.experimental import pallas as pl

  from b12x_jax.kernels.exchange import to_words
  rng = np.random.default_rng(5)
  edge = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF, 0x7F7FFFFF, 0x7F7F8000, 0xFF7F8000, 0x7F800000,
                   0xFF800000, 0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0x00000001, 0x00018000, 0x80008000, 0x80000000,
                   0x00000000, 0x7F7F7FFF], np.uint32)
  low = np.concatenate([edge, rng.integers(0, 1 << 32, 4096 - edge.size, dtype=np.uint32)])
  high = np.concatenate([edge[::-1], rng.integers(0, 1 << 32, 4096 - edge.size, dtype=np.uint32)])
  low_f, high_f = low.view(np.float32), high.view(np.float32)

  def kernel(low_ref, high_ref, out_ref):
    out_ref[...] = to_words((low_ref[...], high_ref[...]), "bfloat16")
  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((low.size,), jnp.int32))(low_f, high_f)
  want = _cuda_bfloat16_bits(low_f) | (_cuda_bfloat16_bits(high_f) << 16)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want)


def test_triton_and_ffi_calls_interleave_on_one_channel():
  mesh = _mesh()

  def body(x, y):
    for _ in range(4):
      x, y = b12x_jax.all_reduce(x, "x"), b12x_jax.all_reduce(y, "x")
    return x, y

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
  rng = np.random.default_rng(12)
  with fresh_communicator(loopback=True, kernels="triton") as comm, b12x_jax.channel("mixed"):
    for _ in range(3):
      x = rng.standard_normal(2048).astype(np.float32)
      y = rng.standard_normal(4096).astype(np.float16)  # no Triton kernel: FFI
      gx, gy = fn(_put(mesh, x), _put(mesh, y))
      assert _same_bits(gx, x) and _same_bits(gy, y)
    assert [d.kernel for d in comm.decisions] == ["triton", "ffi"] * 4, comm.decisions
    assert comm.stats("mixed", mesh.devices.flat[0])["epoch"] == 3 * 8
    comm.check_errors()


def test_the_kernel_is_right_across_the_counter_wrap():
  mesh = _mesh()
  rng = np.random.default_rng(13)
  with fresh_communicator(loopback=True, kernels="triton", poison_outputs=True) as comm:
    comm.prepare(mesh, "x", channels=["wrap"])
    comm._start_counters("wrap", 2**32 - 5)
    with b12x_jax.channel("wrap"):
      for call in range(10):
        x = rng.standard_normal(1024 if call % 2 else 16384).astype(np.float32)
        assert _same_bits(_sum(mesh)(_put(mesh, x)), x), call
    assert comm.stats("wrap", mesh.devices.flat[0])["epoch"] == (2 * (2**32 - 5) + 10) % 2**32  # both counters wrapped
    comm.check_errors()


def test_an_executable_of_an_earlier_preparation_stops_with_nan_and_an_error():
  mesh = _mesh()
  rng = np.random.default_rng(14)
  x = rng.standard_normal(1024).astype(np.float32)
  with fresh_communicator(loopback=True, kernels="triton") as comm:
    with b12x_jax.channel("stale"):
      compiled = _sum(mesh).lower(_put(mesh, x)).compile()
    assert _same_bits(compiled(_put(mesh, x)), x)
    comm.release("stale")
    assert np.isnan(np.asarray(compiled(_put(mesh, x)))).all()  # released: generation 0
    with pytest.raises(b12x_jax.CollectiveTimeoutError, match=r"earlier preparation .* \(generation 0: released\)"):
      comm.check_errors()
    comm.prepare(mesh, "x", channels=["stale"])  # the same memory again, reset, a new generation
    comm.check_errors()
    assert np.isnan(np.asarray(compiled(_put(mesh, x)))).all()
    with pytest.raises(b12x_jax.CollectiveTimeoutError, match=r"channel 'stale' rank 0: an executable lowered for an "
                       r"earlier preparation of the channel \(generation \d+\) ran on its memory \(generation \d+\)"):
      comm.check_errors()
    comm.release("stale")
    with b12x_jax.channel("stale"):  # traced again after the release: prepares, and runs
      assert _same_bits(_sum(mesh)(_put(mesh, x)), x)
    comm.check_errors()


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_the_fused_kernel_matches_float64_and_rounds_the_residual_once(dtype_name):
  # Rows of 1 to 64, a row over 1 to 4 programs, 64 rows of 8192 bfloat16 a
  # program of 4096 words each (it reads residual and weight late); the FFI
  # kernel (float16 has no Triton one) runs the same shapes on the same channel
  # in between.
  from helpers import DTYPES, assert_residual_rmsnorm_matches, residual_rmsnorm_fn, residual_rmsnorm_inputs
  mesh = _mesh()
  rng = np.random.default_rng(15)
  fn = residual_rmsnorm_fn(mesh)
  cases = {"bfloat16": [(1, 4096), (4, 8192), (8, 1024), (64, 4096), (64, 8192), (7, 128)],
           "float32": [(1, 4096), (8, 2048), (32, 4096), (7, 128)]}
  cases = cases[dtype_name]
  with fresh_communicator(loopback=True, kernels="triton", poison_outputs=True) as comm, b12x_jax.channel("fused"):
    for rows, hidden in cases:
      for dtype in (dtype_name, "float16"):
        shards, residual, weight = residual_rmsnorm_inputs(rng, 1, rows, hidden, dtype)
        decided = len(comm.decisions)
        normed, new_residual = (np.asarray(o) for o in fn(*(_put(mesh, a) if a is shards else jnp.asarray(a)
                                                             for a in (shards, residual, weight))))
        assert_residual_rmsnorm_matches(normed, new_residual, shards, residual, weight, 1e-6, dtype)
        kinds = [d.kernel for d in comm.decisions[decided:]]
        assert kinds == (["ffi"] if dtype == "float16" else ["triton"]), (rows, hidden, dtype, kinds)
        if dtype != "float16":  # the sum plus residual, rounded once (ffi/rmsnorm.h)
          want = (shards[0].astype(np.float32) + residual.astype(np.float32)).astype(DTYPES[dtype])
          assert _same_bits(new_residual[0], want), (rows, hidden)
    assert comm.stats("fused", mesh.devices.flat[0])["epoch"] == 2 * len(cases)
    comm.check_errors()


@pytest.mark.parametrize("kernels", ["ffi", "triton"])
def test_the_dcp_merge_of_one_source_gives_back_its_input_in_the_lamport_window(kernels):
  # Through loopback a merge has one source: weight 1, so out and lse come back bit for bit, and a row
  # whose lse is -inf (its payload NaN, never summed) gives 0 and -inf. Shapes: a block's rows split
  # (B = 1), a block per batch row, odd B, one head (a cell's lse padded to a pack), a block's cell over
  # 512 packs (the FFI kernel's merge reads the cells back; the Triton one does not tile 5 heads);
  # float16 between.
  mesh = _mesh()
  rng = np.random.default_rng(16)
  fn = jax.jit(jax.shard_map(lambda o, l: b12x_jax.dcp_a2a(o, l, "x", return_lse=True), mesh=mesh,
                             in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
  shapes = [(1, 32, 128), (8, 4, 128), (3, 4, 16), (2, 1, 64), (1, 5, 1024)]
  with fresh_communicator(loopback=True, kernels=kernels, poison_outputs=True) as comm, b12x_jax.channel("dcp"):
    for shape in shapes:
      for dtype in (jnp.bfloat16, np.float16):
        for call in range(3):  # every Lamport buffer
          out = rng.standard_normal(shape).astype(np.float32).astype(dtype)
          lse = rng.standard_normal(shape[:2]).astype(np.float32)
          lse[-1, -1], out[-1, -1] = -np.inf, np.nan
          got, got_lse = fn(_put(mesh, out), _put(mesh, lse))
          want, want_lse = out.copy(), lse.copy()
          want[-1, -1] = 0
          assert _same_bits(got, want) and _same_bits(got_lse, want_lse), (shape, dtype, call)
          kind = kernels if dtype == jnp.bfloat16 and shape != (1, 5, 1024) else "ffi"
          assert comm.decisions[-1].kernel == kind and "lamport" in comm.decisions[-1].reason, comm.decisions[-1]
    assert comm.stats("dcp", mesh.devices.flat[0])["epoch"] == 6 * len(shapes)
    comm.check_errors()


# One call of each Triton kernel through loopback, in a process of its own that dumps XLA's PTX.
_DUMP_THE_KERNELS = """
import jax, jax.numpy as jnp, numpy as np, b12x_jax
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1])
put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("x")))
run = lambda body, specs, *args: jax.block_until_ready(jax.jit(jax.shard_map(
    body, mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=False))(*args))
comm = b12x_jax.Communicator(loopback=True, kernels="triton")
b12x_jax.get_communicator().close(); b12x_jax.set_communicator(comm)
rng = np.random.default_rng(0)
rows = rng.standard_normal((1, 1, 4096)).astype(jnp.bfloat16)
with b12x_jax.channel("pdl"):
  run(lambda v: b12x_jax.all_reduce(v, "x"), P("x"), put(rng.standard_normal(4096).astype(np.float32)))
  run(lambda v, r, w: [y[None] for y in b12x_jax.all_reduce_residual_rmsnorm(v[0], r, w, "x")], (P("x"), P(), P()),
      put(rows), jnp.asarray(rows[0]), jnp.asarray(rows[0, 0]))
  run(lambda o, l: b12x_jax.dcp_a2a(o, l, "x", return_lse=True), (P("x"), P("x")),
      put(rng.standard_normal((1, 8, 128)).astype(jnp.bfloat16)), put(rng.standard_normal((1, 8)).astype(np.float32)))
print("KINDS", sorted({d.kernel for d in comm.decisions}))
comm.check_errors(); comm.close()
"""


def test_every_triton_kernel_waits_for_the_kernel_before_it_and_lets_none_start_early(tmp_path):
  # XLA launches its Triton kernels, ours too, with programmatic dependent launch from Hopper (jaxlib
  # 0.11: xla_gpu_enable_pdl, on by default): a kernel may start before the one before it ends, and
  # waits in griddepcontrol.wait. A call's first loads read the Signal words the channel's previous call
  # wrote (docs/DESIGN.md, "Call order"), so in XLA's PTX of each kernel of ours the wait comes first,
  # before any access to global memory (and there is none below Hopper).
  import os
  import re
  import subprocess
  import sys
  # XLA writes PTX only where an emitter pattern asks (--xla_dump_emitter_re).
  env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
         "XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_emitter_re=.*"}
  proc = subprocess.run([sys.executable, "-c", _DUMP_THE_KERNELS], capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0 and "KINDS ['triton']" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
  kernels = {}
  for path in tmp_path.rglob("*.ptx"):
    for name, body in re.findall(r"\.entry\s+(\w+)(.*?)(?=\.entry\s|\Z)", path.read_text(), flags=re.S):
      op = re.search(r"b12x_(all_reduce|residual_rmsnorm|dcp_a2a)", name)
      if op:
        kernels[name] = (op.group(1), body)
  ops = sorted({op for op, _ in kernels.values()})
  assert ops == ["all_reduce", "dcp_a2a", "residual_rmsnorm"], (ops, sorted(p.name for p in tmp_path.rglob("*.ptx")))
  hopper = float(jax.devices("gpu")[0].compute_capability) >= 9.0  # where XLA launches them so
  for name, (_, body) in kernels.items():
    memory = re.search(r"\b(ld|st|atom|red)(\.\w+)*\.global\b", body)
    assert memory is not None, name
    wait = body.find("griddepcontrol.wait")
    assert (wait >= 0) == hopper, (name, hopper)
    assert wait < 0 or wait < memory.start(), (name, body[max(0, memory.start() - 300):memory.start() + 100])
    # Nor does a kernel of ours let the next one start early: XLA guards a fusion's non-coherent loads
    # only behind the producers it lets do that itself (docs/DESIGN.md, "Call order").
    assert "griddepcontrol.launch_dependents" not in body, name
