"""Channel scopes and lowering, checked without a GPU: the channel_id
attribute in the lowered module for CPU and CUDA, nesting, overrides,
the default, strict mode."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import b12x_jax


def _channel_ids(text: str) -> list[str]:
  return re.findall(r'channel_id = "([^"]+)"', text)


@pytest.fixture
def lowered_text(cpu_mesh):
  mesh = cpu_mesh(2)

  def lower(fn, *, platform="cpu"):
    sm = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P()))
    x = jax.ShapeDtypeStruct((2 * 64,), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P("x")))
    if platform == "cpu":
      return sm.lower(x).as_text()
    return sm.trace(x).lower(lowering_platforms=(platform,)).as_text()

  return lower


@jax.jit
def inner(x):
  return b12x_jax.all_reduce(x, "x")


def test_one_inner_function_gets_target_and_draft_channels(lowered_text):
  with b12x_jax.channel("target"):
    target = lowered_text(inner)
  with b12x_jax.channel("draft"):
    draft = lowered_text(inner)
  assert _channel_ids(target) == ["target"]
  assert _channel_ids(draft) == ["draft"]
  assert "has_side_effect = true" not in target  # order is the token's (DESIGN "Call order")


def test_cuda_lowering_carries_the_channel_without_a_gpu(lowered_text):
  with b12x_jax.channel("target"):
    text = lowered_text(inner, platform="cuda")
  assert "@b12x_all_reduce" in text
  assert _channel_ids(text) == ["target"]


def test_nested_traces_inherit_the_enclosing_channel(lowered_text):
  def outer(x):
    y = inner(x)
    y = jax.lax.scan(lambda c, _: (inner(c), None), y, None, length=2)[0]
    y = jax.lax.cond(True, inner, lambda v: v, y)
    return jax.checkpoint(inner)(y)

  with b12x_jax.channel("draft"):
    ids = _channel_ids(lowered_text(outer))
  assert ids and set(ids) == {"draft"}  # jitted functions lower once and are called


def test_explicit_channel_overrides_the_scope(lowered_text):
  def fn(x):
    return b12x_jax.all_reduce(x, "x", channel="aux") + b12x_jax.all_reduce(x, "x")

  with b12x_jax.channel("target"):
    assert sorted(_channel_ids(lowered_text(fn))) == ["aux", "target"]


def test_no_scope_gives_default(lowered_text):
  assert b12x_jax.current_channel() is None
  assert _channel_ids(lowered_text(inner)) == ["default"]


def test_innermost_scope_wins_and_scopes_restore():
  with b12x_jax.channel("target"):
    with b12x_jax.channel("draft"):
      assert b12x_jax.current_channel() == "draft"
    assert b12x_jax.current_channel() == "target"
  assert b12x_jax.current_channel() is None


def test_strict_mode_rejects_an_unowned_collective(lowered_text):
  b12x_jax.set_strict(True)
  try:
    with pytest.raises(b12x_jax.ChannelError, match=r"all_reduce: traced outside any channel scope in strict mode"):
      lowered_text(lambda x: b12x_jax.all_reduce(x, "x"))
  finally:
    b12x_jax.set_strict(False)


def test_strict_mode_rejects_an_unprepared_channel(lowered_text):
  b12x_jax.set_strict(True)
  try:
    with b12x_jax.channel("never-prepared"):
      with pytest.raises(b12x_jax.ChannelError, match=r"channel 'never-prepared' is not prepared.*prepare\(mesh"):
        lowered_text(lambda x: b12x_jax.all_reduce(x, "x"))
  finally:
    b12x_jax.set_strict(False)


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, 3])
def test_bad_channel_names_are_rejected(bad):
  with pytest.raises(b12x_jax.ChannelError, match="channel name must be"):
    with b12x_jax.channel(bad):
      pass


def test_other_threads_see_the_default_channel():
  import threading
  seen = []
  with b12x_jax.channel("target"):
    t = threading.Thread(target=lambda: seen.append(b12x_jax.current_channel()))
    t.start()
    t.join()
  assert seen == [None]


def test_aot_compiled_function_keeps_its_channel(cpu_mesh):
  mesh = cpu_mesh(2)
  fn = jax.jit(jax.shard_map(lambda x: b12x_jax.all_reduce(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
  x = jax.device_put(np.ones(2 * 16, np.float32), jax.sharding.NamedSharding(mesh, P("x")))
  with b12x_jax.channel("aot"):
    compiled = fn.lower(x).compile()
  before = b12x_jax.get_communicator().stats("aot", jax.devices("cpu")[0])["epoch"]
  compiled(x).block_until_ready()  # runs outside the scope, still on "aot"
  assert b12x_jax.get_communicator().stats("aot", jax.devices("cpu")[0])["epoch"] == before + 1


@pytest.mark.parametrize("op", ["all_reduce", "all_reduce_residual_rmsnorm", "dcp_a2a"])
def test_a_platform_without_a_b12x_backend_lowers_every_op_to_its_fallback(cpu_mesh, op):
  mesh = cpu_mesh(2)
  if op == "dcp_a2a":
    fn = lambda o, l: b12x_jax.dcp_a2a(o, l, "x")  # noqa: E731
    args = (jax.ShapeDtypeStruct((2, 8, 64), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, P(None))),
            jax.ShapeDtypeStruct((2, 8), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P(None))))
    specs = (P(), P())
  elif op == "all_reduce":
    fn, specs = (lambda v: b12x_jax.all_reduce(v, "x")), (P("x"),)
    args = (jax.ShapeDtypeStruct((128,), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P("x"))),)
  else:
    fn = lambda v: b12x_jax.all_reduce_residual_rmsnorm(v, v, jnp.ones(64, v.dtype), "x")[0]  # noqa: E731
    specs = (P("x"),)
    args = (jax.ShapeDtypeStruct((4, 64), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P("x"))),)
  sm = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False))
  text = sm.trace(*args).lower(lowering_platforms=("rocm",)).as_text()  # the generic rule, not the CPU one
  assert "b12x_" not in text and ("all_reduce" in text or "all_to_all" in text), text[-2000:]


_LOWER_SIX_CHANNELS = """
import hashlib, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import b12x_jax
mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
names = ["target", "draft", "c2", "c3", "c4", "c5"]
def calls(x):
  return sum(b12x_jax.all_reduce(x * i, "x", channel=name) for i, name in enumerate(names))
def body(x):  # six chains in the body and through a scan's carry, whose token order a set of effects gives
  return jax.lax.scan(lambda c, _: (calls(c), None), calls(x), None, length=2)[0]
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False))
x = jax.ShapeDtypeStruct((128,), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P("x")))
print("PROGRAM", hashlib.sha256(f.trace(x).lower(lowering_platforms=("cuda",)).as_text().encode()).hexdigest())
"""


def test_every_process_lowers_the_same_program_whatever_its_hash_seed():
  # Processes salt str hashes differently; JAX orders a program's tokens by
  # iterating a set of effects. Different programs per process hang XLA:GPU's
  # sharded autotuning and reorder XLA:CPU's schedules (DESIGN "Call order").
  import os
  import subprocess
  import sys
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  programs = set()
  for seed in ("0", "1", "2", "3"):
    proc = subprocess.run([sys.executable, "-c", _LOWER_SIX_CHANNELS], capture_output=True, text=True,
                          env={**env, "PYTHONHASHSEED": seed}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    programs.add(proc.stdout.split("PROGRAM ")[-1].strip())
  assert len(programs) == 1, programs


@pytest.mark.parametrize("pinned", [False, True])
def test_a_rule_traced_after_its_call_takes_the_scope_active_then_unless_pinned(lowered_text, pinned):
  # Known escapes (b12x_jax/channels.py): JAX traces a custom_vjp's bwd when
  # the vjp_fn runs, after the scope around the call has exited.
  @jax.custom_vjp
  def reduce(v):
    return b12x_jax.all_reduce(v, "x")

  def forward(v):
    return reduce(v), v

  def backward(v, g):  # v * the sum: the cotangent varies as v does
    return (v * b12x_jax.all_reduce(g, "x", channel="draft" if pinned else None),)

  reduce.defvjp(forward, backward)

  def fn(x):
    with b12x_jax.channel("draft"):
      y, vjp_fn = jax.vjp(reduce, x)
    with b12x_jax.channel("target"):
      (g,) = vjp_fn(y)
    return y.sum() + b12x_jax.all_reduce(g.sum(), "x", channel="draft")

  assert sorted(set(_channel_ids(lowered_text(fn)))) == (["draft"] if pinned else ["draft", "target"])
