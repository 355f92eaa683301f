"""jax.export of functions with b12x calls (README, "jax.export"): the
exported function carries no effect (its calls' order lives inside the
module, docs/DESIGN.md "Call order"), the module serializes, and the
deserialized module gives the right values, in this process and in a fresh
one that prepared its channels; without them the call fails naming the
missing b12x target."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (assert_merge_matches, assert_residual_rmsnorm_matches, assert_sum_matches, attention_shards,
                     fresh_communicator, lower_for_cuda, residual_rmsnorm_inputs)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import b12x_jax

TARGETS = ("b12x_all_reduce", "b12x_dcp_a2a", "b12x_residual_rmsnorm")
N, ELEMS, ROWS, HIDDEN, BATCH, HEADS, DIM = 2, 64, 2, 64, 2, 4, 64


def _every_op(x, out, lse, res_x, residual, weight):
  """One call of each op on channel "exported" and one all_reduce on
  "exported-2" (two ordered effects); every rank's results stacked."""
  total = b12x_jax.all_reduce(x[0], "x")
  merged, merged_lse = b12x_jax.dcp_a2a(out, lse, "x", return_lse=True)
  normed, new_residual = b12x_jax.all_reduce_residual_rmsnorm(res_x[0], residual, weight, "x")
  other = b12x_jax.all_reduce(x[0] * 2, "x", channel="exported-2")
  return jax.tree.map(lambda r: r[None], (total, merged, merged_lse, normed, new_residual, other))


def _inputs(rng):
  """Host inputs of _every_op and what each result must be checked against."""
  shards = rng.standard_normal((N, ELEMS)).astype(np.float32)
  outs, lses, want, want_lse = attention_shards(rng, N, BATCH, HEADS, DIM, jnp.bfloat16)
  res_shards, residual, weight = residual_rmsnorm_inputs(rng, N, ROWS, HIDDEN, "float32")
  host = (shards, outs.reshape(N * BATCH, HEADS, DIM), lses.reshape(N * BATCH, HEADS), res_shards, residual, weight)
  return host, (shards, outs, want, want_lse, res_shards, residual, weight)


def _check(results, expected) -> None:
  total, merged, merged_lse, normed, new_residual, other = (np.asarray(r) for r in results)
  shards, outs, want, want_lse, res_shards, residual, weight = expected
  assert_sum_matches(total, shards, "float32")
  assert_sum_matches(other, shards * 2, "float32")
  assert_merge_matches(merged, merged_lse, outs, want, want_lse, "bfloat16")
  assert_residual_rmsnorm_matches(normed, new_residual, res_shards, residual, weight, 1e-6, "float32")


def _placed(mesh, host):
  specs = (P("x"), P("x"), P("x"), P("x"), P(), P())
  return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(host, specs)]


def _exported(mesh, args):
  fn = jax.jit(jax.shard_map(_every_op, mesh=mesh, in_specs=(P("x"),) * 4 + (P(), P()),
                             out_specs=(P("x"),) * 6, check_vma=False))
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]
  with b12x_jax.channel("exported"):
    return jax.export.export(fn, disabled_checks=checks)(*args)


def test_an_export_serializes_and_the_deserialized_module_runs(cpu_mesh):
  pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
  mesh = cpu_mesh(N)
  rng = np.random.default_rng(0)
  with fresh_communicator(poison_outputs=True):
    host, expected = _inputs(rng)
    exported = _exported(mesh, _placed(mesh, host))
    assert exported.ordered_effects == () and exported.unordered_effects == ()  # dispatched like psum's
    restored = jax.export.deserialize(exported.serialize())
    for _ in range(2):  # fresh inputs, both Lamport buffers
      host, expected = _inputs(rng)
      _check(restored.call(*_placed(mesh, host)), expected)


def _symbolic_args(mesh):
  """_every_op's arguments with the all_reduce's length, dcp_a2a's batch and the fused op's rows symbolic."""
  e, b, r = jax.export.symbolic_shape("e, b, r")
  shapes = [((N, e), jnp.float32, P("x")), ((N * b, HEADS, DIM), jnp.bfloat16, P("x")), ((N * b, HEADS), jnp.float32,
            P("x")), ((N, r, HIDDEN), jnp.float32, P("x")), ((r, HIDDEN), jnp.float32, P()),
            ((HIDDEN,), jnp.float32, P())]
  return [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)) for shape, dtype, spec in shapes]


def test_an_export_of_symbolic_sizes_takes_every_fallback(cpu_mesh):
  # Each op compared the symbolic size with its windows while tracing (an
  # InconclusiveDimensionOperation; dcp_a2a a nanobind TypeError), under every policy: psum exported.
  # (Not called: on jax 0.11.2's XLA:CPU, calling such an export of a shard_map segfaults with psum alone.)
  mesh = cpu_mesh(N)
  with fresh_communicator() as comm:
    exported = _exported(mesh, _symbolic_args(mesh))
    decisions = {d.op: d for d in comm.decisions if d.channel == "exported"}
    assert {op: d.path for op, d in decisions.items()} == {
        "all_reduce": "psum", "dcp_a2a": "all_to_all", "all_reduce_residual_rmsnorm": "unfused"}, comm.decisions
    assert all("symbolic shape" in d.reason for d in decisions.values()), comm.decisions
    module = exported.mlir_module()
    assert not any(t in module for t in TARGETS), [t for t in TARGETS if t in module]
    assert "stablehlo.all_reduce" in module and "stablehlo.all_to_all" in module
    assert [str(d) for d in exported.in_avals[0].shape] == [str(N), "e"], exported.in_avals
  with fresh_communicator(policy="strict"):
    with pytest.raises(b12x_jax.IneligibleError, match=r"b12x_jax.all_reduce: x has a symbolic shape \[e\] .*"
                       r"Export with concrete shapes"):
      _exported(mesh, _symbolic_args(mesh))


_LOADER = textwrap.dedent("""
    import sys
    import jax, numpy as np
    import b12x_jax
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices("cpu")[:2])
    if sys.argv[1] == "prepare":
      b12x_jax.get_communicator().prepare(mesh, "x", channels=["exported", "exported-2"])
    blob = open(sys.argv[2], "rb").read()
    restored = jax.export.deserialize(bytearray(blob))
    from jax.sharding import NamedSharding, PartitionSpec as P
    host = np.load(sys.argv[3])
    specs = (P("x"), P("x"), P("x"), P("x"), P(), P())
    arrays = [host[f"a{i}"] for i in range(6)]
    arrays[1] = arrays[1].astype(jax.numpy.bfloat16)  # npz keeps no bfloat16: out came as float32
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs)]
    try:
      results = restored.call(*args)
    except Exception as e:
      print("ERROR", e)
      raise SystemExit(0)
    np.savez(sys.argv[4], *[np.asarray(r).astype(np.float32) for r in results])
    print("DONE")
""")


def test_a_serialized_export_runs_in_a_fresh_process_that_prepared_its_channels(cpu_mesh, tmp_path):
  pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
  mesh = cpu_mesh(N)
  rng = np.random.default_rng(1)
  with fresh_communicator():
    host, _ = _inputs(rng)
    blob = tmp_path / "every_op.bin"
    blob.write_bytes(_exported(mesh, _placed(mesh, host)).serialize())
  host, expected = _inputs(rng)
  np.savez(tmp_path / "inputs.npz", **{f"a{i}": a.astype(np.float32) for i, a in enumerate(host)})
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  run = lambda how: subprocess.run(  # noqa: E731
      [sys.executable, "-c", _LOADER, how, str(blob), str(tmp_path / "inputs.npz"), str(tmp_path / "out.npz")],
      capture_output=True, text=True, env=env, timeout=300)
  proc = run("prepare")
  assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
  results = np.load(tmp_path / "out.npz")
  results = [results[f"arr_{i}"] for i in range(6)]
  results[1] = results[1].astype(jnp.bfloat16)  # merged out, as the op returns it
  _check(results, expected)
  # Without prepare() nothing in the process registered b12x's FFI targets: XLA names the one it lacks.
  proc = run("none")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "ERROR" in proc.stdout and "b12x_all_reduce" in proc.stdout and "DONE" not in proc.stdout, proc.stdout


def test_an_export_for_cuda_takes_the_ffi_kernel_where_triton_would_bake_in_addresses(cpu_mesh, monkeypatch):
  # The Triton kernel carries this process's addresses of the channel: a
  # module run elsewhere must find its channel by name, as the FFI call does.
  mesh = cpu_mesh(N)
  fn = jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  spec = jax.ShapeDtypeStruct((N * ELEMS,), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  with fresh_communicator(kernels="triton") as comm, b12x_jax.channel("exported-triton"):
    exported = jax.export.export(fn, platforms=("cuda",),
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("b12x_all_reduce")])(spec)
    assert lower_for_cuda(fn, [spec], monkeypatch).count("__gpu$xla.gpu.triton") == 1  # jit alone: Triton
  text = exported.mlir_module()
  assert "__gpu$xla.gpu.triton" not in text and "b12x_all_reduce" in text
  assert [d.kernel for d in comm.decisions][:2] == ["triton", "ffi"], comm.decisions
  assert "jax.export: an exported module must not carry this process's channel addresses" in comm.decisions[1].reason


@pytest.mark.parametrize("platform", ["rocm", "tpu"])
def test_an_export_for_a_platform_without_b12x_records_the_fallback_or_raises_under_strict(cpu_mesh, platform):
  # Every op lowers its fallback there, and the decision says so: b12x has CPU and CUDA backends only.
  mesh = cpu_mesh(N)
  fn = jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  spec = jax.ShapeDtypeStruct((N * ELEMS,), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  with fresh_communicator() as comm, b12x_jax.channel("elsewhere"):
    text = jax.export.export(fn, platforms=(platform,))(spec).mlir_module()
    assert "b12x_all_reduce" not in text and "all_reduce" in text
    assert comm.decisions[-1].path == "psum" and f"no b12x backend for platform '{platform}'" in \
        comm.decisions[-1].reason, comm.decisions
  with fresh_communicator(policy="strict"), b12x_jax.channel("elsewhere-strict"):
    with pytest.raises(b12x_jax.IneligibleError, match=f"all_reduce: no b12x backend for platform '{platform}'"):
      jax.export.export(fn, platforms=(platform,))(spec)


# A module called with its devices at other mesh positions than it was
# exported for (docs/DESIGN.md, "Placement"): its group attribute names the
# peers of other positions. Seen on 9d8e8da: the sum over "y" instead of "x".
_MISPLACED = "on another device assignment than its module was lowered for"


def _grid_meshes(order):
  """The 2 x 2 mesh ("y", "x") of CPU devices 0-3, and the one with them in ``order``."""
  devices = np.array(jax.devices("cpu")[:4])
  return jax.sharding.Mesh(devices.reshape(2, 2), ("y", "x")), jax.sharding.Mesh(devices[order].reshape(2, 2), ("y", "x"))


@pytest.mark.parametrize("order, axis_names", [([0, 2, 1, 3], None), ([2, 3, 0, 1], None), ([0, 3, 2, 1], None),
                                               ([0, 2, 1, 3], {"x"})])
def test_an_export_called_with_its_devices_at_other_mesh_positions_stops_with_an_error_or_is_psum(cpu_mesh, order,
                                                                                                   axis_names):
  # [2, 3, 0, 1] keeps every device's axis group and [0, 3, 2, 1] its index
  # along "x": only the whole position tells the module's devices apart.
  # With "y" automatic (axis_names={"x"}) the call is psum's (docs/DESIGN.md,
  # "Placement"), which runs right wherever the devices are.
  cpu_mesh(4)
  exported_on, called_on = _grid_meshes(order)
  manual = {} if axis_names is None else {"axis_names": axis_names}
  spec = P(None, "x") if axis_names else P("y", "x")
  fn = lambda mesh: jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=spec,  # noqa: E731
                                          out_specs=spec, **manual))
  aval = jax.ShapeDtypeStruct((4, 2 * ELEMS), jnp.float32, sharding=NamedSharding(exported_on, spec))
  rng = np.random.default_rng(5)
  with fresh_communicator(poison_outputs=True) as comm:
    with b12x_jax.channel("placed"):
      exported = jax.export.export(fn(exported_on), disabled_checks=[
          jax.export.DisabledSafetyCheck.custom_call("b12x_all_reduce")])(aval)
    call = jax.jit(exported.call)
    x = rng.standard_normal((4, 2 * ELEMS)).astype(np.float32)
    want = np.tile(x[:, :ELEMS].astype(np.float64) + x[:, ELEMS:], 2)
    np.testing.assert_allclose(np.asarray(call(jax.device_put(x, NamedSharding(exported_on, spec)))), want, rtol=1e-6)
    if axis_names:
      assert "@b12x" not in exported.mlir_module() and comm.decisions[-1].path == "psum", comm.decisions[-1]
      np.testing.assert_allclose(np.asarray(call(jax.device_put(x, NamedSharding(called_on, spec)))), want,
                                 rtol=1e-6)
      return
    misplaced = call(jax.device_put(x, NamedSharding(called_on, spec)))
    with pytest.raises(Exception, match=_MISPLACED):
      np.asarray(misplaced)
    # Kept alive, so release waits for every shard of it (communicator.settle): a shard still on its way
    # would reach its device after the release, be refused there and not on the others, and the
    # preparation below would wait for it to reach them too (docs/DESIGN.md, "Lifetime").
    comm.release("placed")
    comm.prepare(exported_on, "x", channels=["placed"])
    x = rng.standard_normal((4, 2 * ELEMS)).astype(np.float32)
    want = np.tile(x[:, :ELEMS].astype(np.float64) + x[:, ELEMS:], 2)
    np.testing.assert_allclose(np.asarray(call(jax.device_put(x, NamedSharding(exported_on, spec)))), want, rtol=1e-6)


def test_only_an_exported_call_carries_the_placement_operand(cpu_mesh):
  mesh = cpu_mesh(N)
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  aval = jax.ShapeDtypeStruct((N * ELEMS,), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  call = re.compile(r"custom_call @b12x_all_reduce\(.*\} : \(([^)]*)\)")
  with fresh_communicator(), b12x_jax.channel("placed-hlo"):
    jitted = call.search(fn.lower(aval).as_text()).group(1)
    exported = call.search(jax.export.export(fn, disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("b12x_all_reduce")])(aval).mlir_module()).group(1)
  assert jitted == f"!stablehlo.token, tensor<{ELEMS}xf32>", jitted
  assert exported == f"!stablehlo.token, tensor<{ELEMS}xf32>, tensor<i32>", exported


def test_an_aot_executable_called_on_other_devices_is_refused_by_jax(cpu_mesh):
  cpu_mesh(N)
  devices = jax.devices("cpu")[:N]
  compiled_on, called_on = (jax.sharding.Mesh(np.array(d), ("x",)) for d in (devices, devices[::-1]))
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=compiled_on, in_specs=P("x"),
                             out_specs=P("x")))
  x = np.random.default_rng(6).standard_normal(N * ELEMS).astype(np.float32)
  with fresh_communicator(), b12x_jax.channel("placed-aot"):
    compiled = fn.lower(jax.device_put(x, NamedSharding(compiled_on, P("x")))).compile()
    with pytest.raises(ValueError, match="compiled for input shardings that disagree"):
      compiled(jax.device_put(x, NamedSharding(called_on, P("x"))))
