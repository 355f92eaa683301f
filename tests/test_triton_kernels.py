"""Communicator(kernels=...) and the Triton Lamport all_reduce, checked
without a GPU (docs/DESIGN.md, "Triton kernels"): which kernel kind a call
gets and why (recorded in decisions), the CPU fallback, policy "strict";
and the module lowered for CUDA: the Triton custom call named after its
channel, tied into the channel's token chain by optimization barriers
between FFI calls of the same channel, with this device's addresses baked
in. The kernels themselves run on the GPU tests (tests/gpu/test_triton_gpu.py,
tests/test_gpu_rig.py)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (assert_residual_rmsnorm_matches, assert_sum_matches, fresh_communicator, lower_for_cuda, put_sharded,
                     random_shards, residual_rmsnorm_fn, residual_rmsnorm_inputs)
from jax.extend.core import jaxprs_in_params
from jax.sharding import PartitionSpec as P

import b12x_jax
from b12x_jax import _native


def _sum_fn(mesh):
  return jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def test_kernels_must_be_one_of_the_kinds():
  with pytest.raises(ValueError, match=r"kernels must be one of \('auto', 'ffi', 'triton'\), got 'cuda'"):
    b12x_jax.Communicator(kernels="cuda")


@pytest.mark.parametrize("dtype, nbytes, kind, why", [
    (np.float32, 4096, "triton", "the Triton kernel (kernels='triton')"),
    (jnp.bfloat16, 4096, "triton", "the Triton kernel (kernels='triton')"),
    (np.float16, 4096, "ffi", "no Triton kernel for dtype float16"),
    (np.float32, 2 << 20, "ffi", "above the Lamport window of 1048576 bytes"),
])
def test_the_decision_says_which_kernel_a_call_got_and_why(cpu_mesh, dtype, nbytes, kind, why):
  mesh = cpu_mesh(2)
  with fresh_communicator(kernels="triton") as comm, b12x_jax.channel("kinds"):
    shards = random_shards(np.random.default_rng(5), 2, nbytes // np.dtype(dtype).itemsize, dtype)
    got = np.asarray(_sum_fn(mesh)(put_sharded(mesh, shards))).reshape(shards.shape)
    assert_sum_matches(got, shards, np.dtype(dtype).name)
    traced = comm.decisions[0]
    assert traced.path == "b12x" and traced.kernel == kind and why in traced.reason, traced
    if kind == "triton":  # lowered for CPU: the ffi kernel of the same protocol ran it
      assert comm.decisions[1].kernel == "ffi", comm.decisions
      assert "Pallas Triton has no cpu path" in comm.decisions[1].reason, comm.decisions
    else:
      assert len(comm.decisions) == 1, comm.decisions


def test_auto_takes_the_ffi_kernel_off_cuda_and_ffi_is_the_default(cpu_mesh):
  mesh = cpu_mesh(2)
  x = put_sharded(mesh, random_shards(np.random.default_rng(6), 2, 256, np.float32))
  for kernels, why in (("auto", "kernels='auto' and the default backend is cpu"), ("ffi", None)):
    options = {} if kernels == "ffi" else {"kernels": kernels}
    with fresh_communicator(**options) as comm, b12x_jax.channel("auto"):
      _sum_fn(mesh)(x).block_until_ready()
      assert comm.kernels == kernels and [d.kernel for d in comm.decisions] == ["ffi"], comm.decisions
      assert why is None or why in comm.decisions[0].reason, comm.decisions


@pytest.mark.parametrize("kernels", ["auto", "triton"])
def test_a_jax_without_pallas_triton_gives_every_call_the_ffi_kernel_with_the_reason(cpu_mesh, monkeypatch, kernels):
  # The day JAX drops the deprecated backend (docs/DESIGN.md, "Triton kernels").
  from b12x_jax import kernels as device_kernels
  monkeypatch.setattr(b12x_jax.communicator.jax, "default_backend", lambda: "gpu")
  import jax.experimental.pallas
  monkeypatch.delattr(jax.experimental.pallas, "triton")  # its import fails
  monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
  device_kernels.backend_problem.cache_clear()
  try:
    problem = device_kernels.backend_problem()
    assert problem is not None and "has no Pallas Triton backend" in problem, problem
    mesh = cpu_mesh(2)
    shards = random_shards(np.random.default_rng(7), 2, 1024, np.float32)
    with fresh_communicator(kernels=kernels) as comm, b12x_jax.channel("no-pallas"):
      got = np.asarray(_sum_fn(mesh)(put_sharded(mesh, shards))).reshape(shards.shape)
      assert_sum_matches(got, shards, "float32")
      assert [d.kernel for d in comm.decisions] == ["ffi"] and problem in comm.decisions[0].reason, comm.decisions
    with fresh_communicator(kernels="triton", policy="strict"), b12x_jax.channel("no-pallas-strict"):
      with pytest.raises(b12x_jax.IneligibleError, match="has no Pallas Triton backend"):
        _sum_fn(mesh)(put_sharded(mesh, shards))
  finally:
    device_kernels.backend_problem.cache_clear()


def test_auto_takes_the_triton_kernel_on_cuda_where_one_exists(monkeypatch):
  monkeypatch.setattr(b12x_jax.communicator.jax, "default_backend", lambda: "gpu")
  comm = b12x_jax.Communicator(kernels="auto")
  assert comm.choose_kernel("all_reduce", None) == ("triton", "the Triton kernel (kernels='auto')")
  kind, why = comm.choose_kernel("all_reduce", "no Triton kernel for dtype float16")
  assert kind == "ffi" and why == "the ffi kernel: no Triton kernel for dtype float16", why
  assert b12x_jax.Communicator(kernels="triton").choose_kernel("all_reduce", None)[0] == "triton"


def test_strict_refuses_triton_where_it_cannot_run(cpu_mesh):
  mesh = cpu_mesh(2)
  f16 = put_sharded(mesh, random_shards(np.random.default_rng(7), 2, 256, np.float16))
  f32 = put_sharded(mesh, random_shards(np.random.default_rng(7), 2, 256, np.float32))
  with fresh_communicator(kernels="triton", policy="strict"), b12x_jax.channel("strict"):
    b12x_jax.get_communicator().prepare(mesh, "x", channels=["strict"])
    with pytest.raises(b12x_jax.IneligibleError, match=r"kernels='triton' but no Triton kernel for dtype float16"):
      _sum_fn(mesh)(f16)
    with pytest.raises(b12x_jax.IneligibleError, match=r"kernels='triton' but Pallas Triton has no cpu path"):
      _sum_fn(mesh)(f32)


def _calls(text: str) -> list[tuple[str, str, str, str]]:
  """(kind, name, result, line) of every b12x FFI call and Triton kernel in
  ``text``, in program order."""
  calls = []
  for line in text.splitlines():
    call = re.match(r"\s*(%[\w]+)(?::\d+)? = stablehlo.custom_call @(b12x_all_reduce|__gpu\$xla.gpu.triton)\(", line)
    if call:
      name = re.search(r'channel_id = "([^"]+)"|name = "([^"]+)"', line)
      calls.append((call.group(2), name.group(1) or name.group(2), call.group(1), line))
  return calls


def _depends(text: str, later: str, earlier: str) -> bool:
  """Whether SSA value ``later`` is computed from ``earlier`` (through any
  chain of operations of ``text``)."""
  uses: dict[str, set[str]] = {}
  for line in text.splitlines():
    defined = re.match(r"\s*(%[\w]+)(?::\d+)? = (.*)", line)
    if defined:
      uses[defined.group(1)] = {v.split("#")[0] for v in re.findall(r"%[\w#]+", defined.group(2))}
  seen, todo = set(), [later]
  while todo:
    value = todo.pop()
    if value == earlier:
      return True
    if value not in seen:
      seen.add(value)
      todo.extend(uses.get(value, ()))
  return False


def test_the_cuda_lowering_chains_triton_and_ffi_calls_on_one_token(cpu_mesh, monkeypatch):
  mesh = cpu_mesh(2)

  def body(x, y):
    x = b12x_jax.all_reduce(x, "x")  # float32: Triton
    y = b12x_jax.all_reduce(y, "x")  # float16: FFI, independent of x but for the channel's token
    return b12x_jax.all_reduce(x * 2, "x"), y

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P(), P())))
  args = [jax.ShapeDtypeStruct((2 * n,), dtype, sharding=jax.sharding.NamedSharding(mesh, P("x")))
          for n, dtype in ((1024, jnp.float32), (2048, jnp.float16))]
  with fresh_communicator(kernels="triton") as comm, b12x_jax.channel("chain"):
    text = lower_for_cuda(fn, args, monkeypatch)
  calls = _calls(text)
  assert [(kind, name) for kind, name, _, _ in calls] == [
      ("__gpu$xla.gpu.triton", "b12x_all_reduce_lamport_chain"), ("b12x_all_reduce", "chain"),
      ("__gpu$xla.gpu.triton", "b12x_all_reduce_lamport_chain")]
  for kind, _, _, line in calls:
    if kind == "b12x_all_reduce":
      assert "has_side_effect = true" not in line
    else:  # the channel in the kernel's metadata too
      assert 'serialized_metadata = "{\\22b12x_channel\\22: \\22chain\\22}"' in line, line
  assert [d.kernel for d in comm.decisions] == ["triton", "ffi", "triton"], comm.decisions
  # Program order on the channel: each call is computed from the one before
  # it (the float16 call shares no data with the others: only the token).
  results = [result for _, _, result, _ in calls]
  assert _depends(text, results[1], results[0]) and _depends(text, results[2], results[1])
  assert not _depends(text, results[0], results[1])
  # Each kernel's address row comes out of a barrier, never straight from its slice of the table.
  defined = {m.group(1): m.group(2) for m in re.finditer(r"\s*(%[\w]+)(?::\d+)? = (.*)", text)}
  for kind, _, _, line in calls:
    if kind != "b12x_all_reduce":
      row = re.search(r"@__gpu\$xla\.gpu\.triton\((%[\w]+)(#\d+)?", line).group(1)
      assert defined[row].startswith("stablehlo.optimization_barrier"), defined[row]


def test_each_device_gets_its_own_addresses_and_the_generation_of_its_preparation(cpu_mesh):
  mesh = cpu_mesh(2)
  x = put_sharded(mesh, random_shards(np.random.default_rng(8), 2, 256, np.float32))
  with fresh_communicator() as comm:
    comm.prepare(mesh, "x", channels=["views"])
    views = [_native.kernel_view("cpu", "views", "0,1", d.id, 1024, dtype="bfloat16", site=5)
             for d in mesh.devices.flat]
    assert [v["rank"] for v in views] == [0, 1] and views[0]["lamport"] == views[1]["lamport"]
    assert views[0]["signals"][0] != views[0]["signals"][1] and views[0]["generation"] > 0
    assert (views[0]["algorithm"], views[0]["grid"], views[0]["packs"]) == (3, 1, 64)  # plan_for: Lamport
    assert views[0]["tag"] == (1 | 1 << 8 | 1 << 16, 3, 64, 5)  # all_reduce of bfloat16 (1), grid 1; lamport
    comm.release("views")
    with b12x_jax.channel("views"):
      _sum_fn(mesh)(x).block_until_ready()  # prepares it again: the same memory, a new generation
    again = _native.kernel_view("cpu", "views", "0,1", 0, 1024, dtype="bfloat16", site=5)
    assert again["lamport"] == views[0]["lamport"] and again["generation"] > views[0]["generation"]


_SIGNAL_WORDS = ("lamport_calls", "lamport_buffer", "lamport_packs", "served", "poisoned", "generation", "row_shares",
                 "row_arrivals")
_ERROR_WORDS = ("state", "kind", "rank", "peer", "epoch", "peer_gave_up", "first_call", "expected", "seen",
                "channel_generation")


def _view(max_blocks: int = 64, cell_words: int = 4096, cells_bytes: int = 0) -> dict:
  return {"world": 2, "loopback": False, "grid": 1, "per_block": 1, "cell_bytes": 4 * cell_words,
          "cells_bytes": cells_bytes, "max_blocks": max_blocks, "tag": (1 | 1 << 16, 3, 1, 0), "algorithm": 3,
          "packs": 1, "timeout_ns": 10**9, "first_timeout_ns": 10**9, "poison_grace_ns": 10**6,
          "signal_offsets": {name: 4096 * k for k, name in enumerate(_SIGNAL_WORDS)},
          "error_offsets": {name: 64 * k for k, name in enumerate(_ERROR_WORDS)}, "empty_word": 0xFFFFFFFF,
          "nan_word": 0x7FFF7FFF,
          "failure_timeout": 1, "failure_mismatch": 2, "failure_stale": 3, "error_complete": 1}


def _plan(max_blocks: int = 64, cell_words: int = 4096):
  from b12x_jax import kernels as triton
  return triton.make_plan(_view(max_blocks, cell_words))


# The kernel's offsets into a Lamport region are int32: a region of 2 GiB or more takes the FFI kernel
# with the reason (one whose cells alone reach 2 GiB raised OverflowError while tracing), one below it
# the Triton kernel.
@pytest.mark.parametrize("op", ["all_reduce", "residual_rmsnorm", "dcp_a2a"])
@pytest.mark.parametrize("cells_bytes", [2**31 - 3 * 2 * 64 * 16, 2**31])
def test_a_lamport_region_beyond_32_bit_offsets_takes_the_ffi_kernel(op, cells_bytes):
  from b12x_jax import kernels as triton
  headers = 3 * 2 * 64 * 16
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  avals = {"all_reduce": [f32(4)], "residual_rmsnorm": [f32(1, 4), f32(1, 4), f32(4)],
           "dcp_a2a": [jax.ShapeDtypeStruct((1, 2, 8), jnp.bfloat16), f32(1, 2)]}[op]
  params = {"eps": 1e-6, "base2": False, "return_lse": True}
  beyond = triton.call_for(op, _view(cells_bytes=cells_bytes), avals, params, channel="c", site=0, poison=False)
  why = f"Lamport region of {cells_bytes + headers} bytes is beyond the Triton kernel's 32-bit offsets"
  assert isinstance(beyond, str) and why in beyond, beyond
  within = triton.call_for(op, _view(cells_bytes=2**31 - headers - 16), avals, params, channel="c", site=0,
                           poison=False)
  assert isinstance(within, triton.Call), within


# Programs per row: rows of >= 4096 words split, each part >= 1024 words, at most 4 per row, the
# grid within the channel's 64 blocks.
@pytest.mark.parametrize("rows, row_words, split", [(1, 2048, 1), (4, 4096, 4), (1, 8192, 4), (8, 8192, 4),
                                                    (16, 8192, 4), (32, 4096, 2), (64, 4096, 1), (5, 1024, 1),
                                                    (1, 4, 1)])
def test_the_fused_kernel_runs_a_row_over_programs_of_a_block_each(rows, row_words, split):
  from b12x_jax import kernels as triton
  plan = triton.rows_plan(_plan(cell_words=8192), rows, 4 * row_words, "float32", 77)
  assert plan.split == split and plan.grid == rows * split and plan.block_words == row_words // split
  # The fused op's tag (ffi/channel.h make_tag): op 2, float32 (0), its grid; lamport and the row's packs;
  # the packs; the site.
  assert plan.tag == (2 | rows * split << 16, 3 | row_words // 4 << 2, rows * row_words // 4, 77)


@pytest.mark.parametrize("rows, row_words, why", [
    (65, 1024, "65 rows of 4096 bytes do not fit the channel's 64 Lamport cells of 16384 bytes"),
    (1, 8192, "1 rows of 32768 bytes do not fit"),
    (3, 1000, "a row of 4000 bytes is not a power of two of 32-bit words"),
    (1, 16384, "a row of 65536 bytes is not a power of two of 32-bit words, or above 8192")])
def test_the_fused_kernel_says_which_rows_it_cannot_take(rows, row_words, why):
  from b12x_jax import kernels as triton
  problem = triton.rows_plan(_plan(), rows, 4 * row_words, "float32", 0)
  assert isinstance(problem, str) and why in problem, problem


def test_the_fused_op_lowers_to_its_triton_kernel_for_cuda_and_float16_to_ffi(cpu_mesh, monkeypatch):
  mesh = cpu_mesh(2)

  def body(x, residual, weight, y):
    normed, new_residual = b12x_jax.all_reduce_residual_rmsnorm(x, residual, weight, "x")
    return normed, new_residual, b12x_jax.all_reduce_residual_rmsnorm(y, residual.astype(jnp.float16),
                                                                     weight.astype(jnp.float16), "x")[0]

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P(), P("x")), out_specs=(P(), P(), P())))
  sharded = jax.sharding.NamedSharding(mesh, P("x"))
  replicated = jax.sharding.NamedSharding(mesh, P())
  args = [jax.ShapeDtypeStruct((2, 1024), jnp.bfloat16, sharding=sharded),
          jax.ShapeDtypeStruct((1, 1024), jnp.bfloat16, sharding=replicated),
          jax.ShapeDtypeStruct((1024,), jnp.bfloat16, sharding=replicated),
          jax.ShapeDtypeStruct((2, 1024), jnp.float16, sharding=sharded)]
  with fresh_communicator(kernels="triton") as comm, b12x_jax.channel("fusedchain"):
    text = lower_for_cuda(fn, args, monkeypatch)
  assert text.count('@__gpu$xla.gpu.triton') == 1 and 'b12x_residual_rmsnorm_lamport_fusedchain' in text
  assert text.count("@b12x_residual_rmsnorm(") == 1  # the float16 call
  assert [d.kernel for d in comm.decisions] == ["triton", "ffi"], comm.decisions


def test_the_fused_ops_decision_names_rows_the_triton_kernel_cannot_take(cpu_mesh):
  # Said at trace time (the lowering's own check is then never the first to see it); strict refuses there.
  mesh = cpu_mesh(2)
  shards, residual, weight = residual_rmsnorm_inputs(np.random.default_rng(9), 2, 2, 1000, "float32")
  args = (jax.device_put(shards, jax.sharding.NamedSharding(mesh, P("x"))), jnp.asarray(residual), jnp.asarray(weight))
  with fresh_communicator(kernels="triton") as comm, b12x_jax.channel("oddrows"):
    normed, new_residual = (np.asarray(o) for o in residual_rmsnorm_fn(mesh)(*args))
    assert_residual_rmsnorm_matches(normed, new_residual, shards, residual, weight, 1e-6, "float32")
    decision = comm.decisions[0]
    assert decision.kernel == "ffi" and "a row of 4000 bytes is not a power of two of 32-bit words" in decision.reason
  with fresh_communicator(kernels="triton", policy="strict"), b12x_jax.channel("oddrows"):
    with pytest.raises(b12x_jax.IneligibleError, match=r"kernels='triton' but a row of 4000 bytes is not a power"):
      residual_rmsnorm_fn(mesh)(*args)


@pytest.mark.parametrize("return_lse", [True, False])
def test_dcp_a2a_lowers_to_its_triton_kernel_for_cuda_and_float16_to_ffi(cpu_mesh, monkeypatch, return_lse):
  # One head per rank (a cell's lse padded to a pack) and 8: the host channel's one block takes the call's rows.
  mesh = cpu_mesh(2)

  def body(out, lse, out16, lse16, out8, lse8):
    merged = b12x_jax.dcp_a2a(out, lse, "x", return_lse=return_lse)
    return merged, b12x_jax.dcp_a2a(out16, lse16, "x")[0], b12x_jax.dcp_a2a(out8, lse8, "x", lse_base="2")

  sharded = jax.sharding.NamedSharding(mesh, P("x"))
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharded)
          for shape, dtype in (((2, 2, 64), jnp.bfloat16), ((2, 2), jnp.float32), ((2, 4, 64), jnp.float16),
                               ((2, 4), jnp.float32), ((2, 16, 128), jnp.bfloat16), ((2, 16), jnp.float32))]
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
  with fresh_communicator(kernels="triton") as comm, b12x_jax.channel("dcpchain"):
    text = lower_for_cuda(fn, args, monkeypatch)
  assert text.count('@__gpu$xla.gpu.triton') == 2 and 'b12x_dcp_a2a_lamport_dcpchain' in text
  assert text.count("@b12x_dcp_a2a(") == 1  # the float16 call
  assert [d.kernel for d in comm.decisions] == ["triton", "ffi", "triton"], comm.decisions
  assert "no Triton kernel for dcp_a2a of dtype float16" in comm.decisions[1].reason


def _every_kernel_kind(cpu_mesh, monkeypatch) -> list[tuple[int, list]]:
  """(num_warps, [(inline asm, result shape)]) of six Triton kernels lowered
  through shard_map: all_reduce of 8, 64 and 2048 words, the fused op of 8
  and 256 words a row, and dcp_a2a of [2, 2, 64]."""
  kernels = _record_inline_asm(monkeypatch)
  mesh = cpu_mesh(2)

  def body(*args):
    sums = [b12x_jax.all_reduce(a, "x") for a in args[:3]]
    fused = [b12x_jax.all_reduce_residual_rmsnorm(x, r, w, "x")[0] for x, r, w in (args[3:6], args[6:9])]
    return (*sums, *fused, b12x_jax.dcp_a2a(args[9], args[10], "x"))

  sharded = jax.sharding.NamedSharding(mesh, P("x"))
  replicated = jax.sharding.NamedSharding(mesh, P())
  shapes = [((8,), jnp.float32, sharded), ((64,), jnp.float32, sharded), ((2048,), jnp.bfloat16, sharded),
            ((2, 8), jnp.bfloat16, sharded), ((1, 8), jnp.bfloat16, replicated), ((8,), jnp.bfloat16, replicated),
            ((2, 256), jnp.bfloat16, sharded), ((1, 256), jnp.bfloat16, replicated),
            ((256,), jnp.bfloat16, replicated), ((2, 2, 64), jnp.bfloat16, sharded), ((2, 2), jnp.float32, sharded)]
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype, sharding in shapes]
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(a.sharding.spec for a in args),
                             out_specs=(P("x"),) * 3 + (P(),) * 2 + (P("x"),)))
  with fresh_communicator(kernels="triton") as comm, b12x_jax.channel("onethread"):
    lower_for_cuda(fn, args, monkeypatch)
  assert [d.kernel for d in comm.decisions] == ["triton"] * 6, comm.decisions
  assert len(kernels) == 6
  return kernels


def test_every_read_of_memory_that_peers_write_gives_each_element_one_thread(cpu_mesh, monkeypatch):
  # Triton gives a tensor narrower than the program's threads copies in several threads, each
  # loading on its own; reductions read one copy, so threads disagreed on when a poll ended (the
  # one-GPU rig: NaN in a row of the fused op inside a loop, no error). Polls, poison words and the
  # clock are read in one 1-D shape at least as wide as the threads; narrower reads only of words
  # the polls saw arrived (docs/DESIGN.md, "Triton kernels").
  for warps, asms in _every_kernel_kind(cpu_mesh, monkeypatch):
    _assert_one_thread_per_polled_element(warps, asms)


def test_every_store_to_memory_that_peers_read_gives_each_element_one_thread(cpu_mesh, monkeypatch):
  # dcp_a2a pushed each lse word [rows] from every thread that held a copy of it (16 at 8 rows and
  # 4 warps): a late copy could land after the owner's refill and read as arrived three calls later
  # (docs/DESIGN.md, "Lamport"). Every store is issued at a shape with at least one element a thread;
  # tests/test_triton_compile.py reads the layouts Triton gives them.
  from b12x_jax import kernels as triton
  for warps, asms in _every_kernel_kind(cpu_mesh, monkeypatch):
    shapes = [shape for code, shape in asms if code == triton.exchange._STORE]
    assert shapes and all(math.prod(shape) >= 32 * warps for shape in shapes), (warps, shapes)


def triton_kernel_case(name: str):
  """(fn, abstract args) of one Triton kernel at a test plan, by ``name``:
  "all_reduce float32" / "all_reduce bfloat16" (2 ranks, 2 blocks of 512
  words), "all_reduce loopback", "all_reduce bfloat16, 8 ranks" (a block of
  2048 words: 8 warps), "dcp_a2a" ([1, 16, 64] over 2 ranks: one block of 8
  rows of 32 words per destination), "fused, one program a row", "fused,
  a row over 4 programs", "fused, a wide row in one program" (a channel of 2
  blocks: 4096 words a program, its residual and weight read late) and
  "fused, a row over 2 programs" (a channel of 4 blocks: the unused share
  slots reset). tests/test_triton_compile.py compiles them."""
  from b12x_jax import kernels as triton
  row = jax.ShapeDtypeStruct((triton.ROW_WORDS,), jnp.int32)
  if name.startswith("all_reduce"):
    plan = dataclasses.replace(_plan(), block_words=512, grid=2)
    if name.endswith("loopback"):
      plan = dataclasses.replace(plan, world=1, loopback=True, block_words=1024, grid=1)
    if name.endswith("8 ranks"):
      plan = dataclasses.replace(plan, world=8, block_words=2048, grid=1)
    dtype = "float32" if "float32" in name or name.endswith("loopback") else "bfloat16"
    x = jax.ShapeDtypeStruct((plan.grid * plan.block_words * (1 if dtype == "float32" else 2),), dtype)
    return functools.partial(triton.all_reduce.all_reduce, plan=plan, channel="c", poison=False), (x, row)
  if name == "dcp_a2a":
    plan = dataclasses.replace(_plan(), block_words=256, grid=1)
    args = (jax.ShapeDtypeStruct((1, 16, 64), jnp.bfloat16), jax.ShapeDtypeStruct((1, 16), jnp.float32), row)
    return (lambda o, lse, t: triton.dcp_a2a.dcp_a2a(o, lse, t, plan, base2=False, return_lse=True, channel="c",
                                                      poison=False)), args
  hidden, split, blocks = {"fused, one program a row": (2048, 1, 64), "fused, a row over 4 programs": (8192, 4, 64),
                           "fused, a wide row in one program": (8192, 1, 2), "fused, a row over 2 programs": (8192, 2, 4)}[name]
  plan = triton.rows_plan(_plan(blocks, cell_words=8192), 2, 2 * hidden, "bfloat16", 0)
  assert plan.split == split, plan.split
  args = (jax.ShapeDtypeStruct((2, hidden), jnp.bfloat16),) * 2 + (jax.ShapeDtypeStruct((hidden,), jnp.bfloat16), row)
  return (lambda x, r, w, t: triton.residual_rmsnorm.residual_rmsnorm(x, r, w, t, plan, eps=1e-6, channel="c",
                                                                       poison=False)), args


def _record_inline_asm(monkeypatch) -> list[tuple[int, list]]:
  """(num_warps, [(inline asm, result shape)]) of each Pallas Triton kernel lowered from now on."""
  from jax.experimental.pallas import triton as plt
  kernels: list[tuple[int, list]] = []
  real_asm, real_params = plt.elementwise_inline_asm, plt.CompilerParams

  def params(**options):
    kernels.append((options["num_warps"], []))
    return real_params(**options)

  def asm(code, *, result_shape_dtypes, **options):
    kernels[-1][1].append((code, tuple(result_shape_dtypes[0].shape)))
    return real_asm(code, result_shape_dtypes=result_shape_dtypes, **options)

  monkeypatch.setattr(plt, "CompilerParams", params)
  monkeypatch.setattr(plt, "elementwise_inline_asm", asm)
  return kernels


def _assert_one_thread_per_polled_element(warps: int, asms: list) -> None:
  from b12x_jax import kernels as triton
  polled = {triton.exchange._LOAD, triton.exchange._LOAD_IF, triton.exchange._CLOCK, triton.exchange._LOAD_SLOT,
            triton.exchange._STORE_SLOT, triton.exchange._ADD}
  shapes = {shape for code, shape in asms if code in polled}
  assert shapes and all(len(shape) == 1 and shape[0] >= 32 * warps for shape in shapes), (warps, shapes)
  assert {code for code, _ in asms} <= polled | {triton.exchange._LOAD_ARRIVED, triton.exchange._LOAD_OWN, triton.exchange._STORE,
                                              triton.exchange._ROUND_PAIR} | {
      code for code, _ in asms if "global.cas" in code}
  # Only the block's own Signal words (no one else writes them while it runs), once each, may be one element.
  assert sum(code == triton.exchange._LOAD_OWN for code, _ in asms) == len(triton.exchange.OWN_WORDS), asms


@pytest.mark.parametrize("max_blocks, split", [(64, 4), (4, 2)])
def test_a_row_over_several_programs_lowers_with_their_meeting(monkeypatch, max_blocks, split):
  # Host channels have one block, so the program above never splits a row: the kernel of a
  # plan of more blocks, lowered on its own. Each program of the row stores its share and the call's
  # tag in its slot, one 64-bit word, resets the slots a split of fewer programs leaves unused, adds to
  # the row's meeting word, and polls the row's slots.
  from b12x_jax import _native
  from b12x_jax import kernels as triton
  plan = triton.rows_plan(_plan(max_blocks, cell_words=8192), 2, 4 * 4096, "bfloat16", 0)
  assert plan.split == split and plan.grid == 2 * split
  kernels = _record_inline_asm(monkeypatch)
  fn = jax.jit(lambda x, r, w, row: triton.residual_rmsnorm.residual_rmsnorm(
      x, r, w, row, plan, eps=1e-6, channel="split", poison=False))
  args = [jax.ShapeDtypeStruct((2, 8192), jnp.bfloat16), jax.ShapeDtypeStruct((2, 8192), jnp.bfloat16),
          jax.ShapeDtypeStruct((8192,), jnp.bfloat16), jax.ShapeDtypeStruct((triton.ROW_WORDS,), jnp.int32)]
  text = lower_for_cuda(fn, args, monkeypatch)
  assert text.count('@__gpu$xla.gpu.triton') == 1 and f"grid_x = {2 * split}" in text
  ((warps, asms),) = kernels
  codes = [code for code, _ in asms]
  assert codes.count(triton.exchange._ADD) == 1 and codes.count(triton.exchange._LOAD_SLOT) == 1
  assert codes.count(triton.exchange._STORE_SLOT) == _native.MAX_ROW_SPLIT // split
  _assert_one_thread_per_polled_element(warps, asms)


@pytest.mark.parametrize("kernel", ["all_reduce float32", "all_reduce bfloat16", "fused, one program a row",
                                    "fused, a row over 4 programs", "fused, a wide row in one program", "dcp_a2a"])
def test_every_inline_asm_the_exchange_emits_survives_in_the_kernel(monkeypatch, kernel):
  # Pallas drops what does not reach a kernel's output, and inline asm is pure to it: an access
  # whose result joins no chain to the output (module docstring of kernels/exchange.py) is gone
  # from the kernel, silently. Once the refill moved before the polls, the failure record (the
  # poison word's claim) was: a failed Triton call left NaN but poisoned nothing and recorded no
  # error. Every asm traced must be in the kernel pallas_call keeps, as often as traced.
  from collections import Counter

  kernels = _record_inline_asm(monkeypatch)
  fn, args = triton_kernel_case(kernel)
  traced = jax.make_jaxpr(fn)(*args)
  ((_, asms),) = kernels
  emitted = Counter(code for code, _ in asms)
  text = str(traced)
  assert any("sys.global.cas" in code for code in emitted), "the failure record was not traced"
  kept = {code: text.count(code) for code in emitted}
  assert kept == dict(emitted), [(n, kept[code], code[:80]) for code, n in emitted.items() if kept[code] != n]
  # The record's branch holds no reduction: inline asm is pure, so the compiler may hoist the
  # branch onto every call, and a reduction across warps is a barrier (docs/DESIGN.md, "Triton kernels").
  (branch,) = [b for b in _cond_branches(traced.jaxpr) if "sys.global.cas" in str(b)]
  assert not [e.primitive.name for e in _equations(branch) if e.primitive.name.startswith("reduce_")], branch


def _equations(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs inside it."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jaxprs_in_params(eqn.params):
      yield from _equations(sub)


def _cond_branches(jaxpr):
  """The branches of every cond in ``jaxpr``, at any depth."""
  return [b for e in _equations(jaxpr) if e.primitive.name == "cond" for b in e.params["branches"]]


@pytest.mark.parametrize("shape, blocks, cell, plan", [
    ((1, 16, 128, 2), 64, 16384, (1, 8)),     # 8 heads of 128 bytes: 1 KiB, one block
    ((1, 32, 512, 2), 64, 16384, (2, 8)),     # 16 heads of 512 bytes: split into blocks of 4 KiB
    ((8, 8, 128, 2), 64, 16384, (8, 4)),      # a block per batch row
    ((3, 2, 64, 2), 1, 1 << 20, (1, 3)),      # the host's one block: every row
    ((128, 8, 128, 2), 64, 16384, (64, 8)),   # B above the blocks: two batch rows per block
    ((1, 2, 16384, 2), 64, 16384, (0, 0)),    # a 16 KiB row and its lse overflow a cell: the barrier protocol
    ((2, 8, 128, 2), 64, 0, (0, 0)),          # no Lamport window
    ((2, 16, 128, 16), 64, 16384, (0, 0)),    # more ranks than a channel has
])
def test_the_dcp_lamport_plan(shape, blocks, cell, plan):
  batch, heads, row_bytes, world = shape
  grid, per_block, tag = _native.dcp_lamport_plan(cell, blocks, batch, heads, world, row_bytes, dtype="float16",
                                                  site=9, base2=True)
  assert (grid, per_block) == plan
  if grid:  # dcp_a2a, float16 (2), the grid, base 2; lamport, H and D's packs; the input's packs; the site
    assert tag == (3 | 2 << 8 | grid << 16 | 1 << 24, 3 | heads << 2 | row_bytes // 16 << 17,
                   batch * heads * row_bytes // 16, 9)


def test_dcp_calls_of_one_size_and_grid_but_other_rows_have_other_tags():
  # [1, 32, 512 B] and [2, 16, 512 B] over 2 ranks: 8-row blocks, 2 of them, 1024 packs each.
  one, two = (_native.dcp_lamport_plan(16384, 64, batch, heads, 2, 512, dtype="bfloat16", site=0, base2=False)
              for batch, heads in ((1, 32), (2, 16)))
  assert one[:2] == two[:2] == (2, 8) and one[2][2] == two[2][2] and one[2] != two[2]
