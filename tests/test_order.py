"""Calls on one channel run in program order on every device (DESIGN C15).

32 all_reduces whose inputs do not depend on each other, in one program
(straight, in scan, while_loop and cond), 50 runs: XLA:CPU runs such
independent custom calls in different orders on different devices, so
without the channel's order token ranks pair one call with another's data
(seen before the token: 148 of 640 results wrong at N = 2). Every result
must be exact (integer inputs: the float32 sum is exact); so must the fused
op's new residual, and a dcp_a2a merge within bfloat16 roundings
(helpers.independent_wrong).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from helpers import assert_sum_matches, expected_taken, put_sharded, random_shards
from jax.sharding import PartitionSpec as P

import b12x_jax
from conftest import run_worker
from test_channels import lowered_text  # noqa: F401 - a fixture


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_independent_calls_on_one_channel_run_in_program_order_on_every_rank(ranks):
  result = run_worker("order", "--devices", str(ranks), "--calls", "32", "--runs", "50", "--elems", "16384",
                      hard_timeout=300)
  assert result["results"] == 50 * 32 * ranks, result
  assert result["wrong"] == 0, result


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot", "one_shot_pull"])
def test_independent_calls_run_in_program_order_on_the_barrier_protocols_too(algorithm):
  # No Lamport window: every call stages, meets and reduces (two-shot: meets twice).
  result = run_worker("order", "--devices", "2", "--calls", "16", "--runs", "20", "--elems", "4096",
                      "--lamport-bytes", "0", "--algorithm", algorithm, hard_timeout=300)
  assert result["results"] == 20 * 16 * 2, result
  assert result["wrong"] == 0, result


@pytest.mark.parametrize("lamport_bytes", [1 << 20, 0], ids=["lamport", "barrier"])
@pytest.mark.parametrize("op", ["dcp_a2a", "residual_rmsnorm"])
def test_independent_merges_and_fused_calls_run_in_program_order_too(op, lamport_bytes):
  # Without the Lamport window dcp_a2a meets at its barrier and the fused op takes its unfused path.
  result = run_worker("order", "--devices", "4", "--calls", "16", "--runs", "20", "--elems", "4096",
                      "--lamport-bytes", str(lamport_bytes), "--op", op, hard_timeout=300)
  assert result["results"] == 20 * 16 * 4, result
  assert result["wrong"] == 0, result
  assert result["taken"] == expected_taken(op, "lamport" if lamport_bytes else "one_shot"), result


def _calls(text: str) -> list[tuple[str, str, str]]:
  """(channel, token in, token out) of every b12x custom call in ``text``,
  seen through the optimization barriers the CUDA lowering puts around each
  call (a barrier's result i is its operand i)."""
  through: dict[str, str] = {}
  calls = []
  for line in text.splitlines():
    barrier = re.match(r"\s*(%[\w]+)(?::\d+)? = stablehlo.optimization_barrier (.*?) :", line)
    if barrier:
      for k, operand in enumerate(barrier.group(2).split(", ")):
        through[f"{barrier.group(1)}#{k}"] = through.get(operand, operand)
      continue
    if "stablehlo.custom_call @b12x_" not in line:
      continue
    token_out = re.match(r"\s*(%[\w#]+)", line).group(1)
    token_in = re.search(r"custom_call @b12x_\w+\((%[\w#]+)", line).group(1)
    calls.append((re.search(r'channel_id = "([^"]+)"', line).group(1), through.get(token_in, token_in),
                  token_out + "#0"))
  return calls


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_each_channel_threads_one_token_through_its_calls_and_channels_stay_apart(lowered_text, platform):
  def body(x):
    outs = []
    for name in ("target", "draft", "target", "draft", "target"):
      with b12x_jax.channel(name):
        outs.append(b12x_jax.all_reduce(x * len(outs), "x"))
    return sum(outs)

  calls = _calls(lowered_text(body, platform=platform))
  assert [c for c, _, _ in calls] == ["target", "draft", "target", "draft", "target"]
  for name in ("target", "draft"):
    chain = [(t_in, t_out) for c, t_in, t_out in calls if c == name]
    for (_, previous_out), (next_in, _) in zip(chain, chain[1:]):
      assert next_in == previous_out, (name, calls)  # each call takes the token of the one before
  first_target, first_draft = calls[0][1], calls[1][1]
  assert first_target != first_draft  # two channels, two tokens: neither waits for the other


def test_an_aot_compiled_executable_runs_its_calls_in_order_again_and_again(cpu_mesh):
  mesh = cpu_mesh(2)
  fn = jax.jit(jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x") * 2, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  rng = np.random.default_rng(3)
  with b12x_jax.channel("aot"):
    shards = random_shards(rng, 2, 256, np.float32)
    compiled = fn.lower(put_sharded(mesh, shards)).compile()
    for _ in range(3):  # jax 0.11.2 dropped the order token from the second call on (channels.ChannelMemory)
      shards = random_shards(rng, 2, 256, np.float32)
      assert_sum_matches(np.asarray(compiled(put_sharded(mesh, shards))).reshape(2, -1) / 2, shards, "float32")


def _shard_map_chain(text: str) -> list[tuple[str, list[str]]]:
  """(result, operands) of every shard_map body in ``text`` (shardy's
  sdy.manual_computation; its result #0 is the channel's token out)."""
  found = re.findall(r"(%[\w]+)(?::\d+)? = sdy\.manual_computation\(([^)]*)\)", text)
  return [(result, operands.split(", ")) for result, operands in found]


@pytest.mark.parametrize("jitted", [False, True], ids=["shard_maps", "a jitted layer"])
def test_shard_maps_one_after_the_other_chain_their_calls_also_in_a_jitted_layer_called_twice(cpu_mesh, jitted):
  # Equal calls (one site, shape and dtype: equal tags) whose inputs do not depend on each other: only the
  # token orders them. JAX lowers an equation it can cache, and a jitted function, in a function of its
  # own: there each shard_map started a chain of its own (docs/DESIGN.md, "Call order").
  mesh = cpu_mesh(2)
  layer = jax.shard_map(lambda v: b12x_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
  layer = jax.jit(layer) if jitted else layer
  step = jax.jit(lambda a, b, c: (layer(a), layer(b), layer(c)))
  x = jax.ShapeDtypeStruct((2 * 64,), np.float32, sharding=jax.sharding.NamedSharding(mesh, P("x")))
  with b12x_jax.channel("layers"):
    text = step.lower(x, x, x).as_text()
  assert text.count("stablehlo.create_token") == 1, text
  chain = _shard_map_chain(text)
  assert len(chain) == 3, text
  for (previous, _), (_, operands) in zip(chain, chain[1:]):
    assert f"{previous}#0" in operands, text  # each takes the token the one before gave out


def test_meshes_that_name_the_same_devices_differently_chain_one_channels_calls(cpu_mesh):
  # The chain between shard_maps was kept per mesh axis name, the memory per device group: two
  # meshes of the same devices under other names ran equal calls (equal tags) on one channel's memory
  # with nothing but XLA's schedule between them.
  devices = cpu_mesh(2).devices
  meshes = [jax.sharding.Mesh(devices, (name,)) for name in ("a", "b", "a")]
  layers = [jax.shard_map(lambda v, name=m.axis_names[0]: b12x_jax.all_reduce(v, name), mesh=m,
                          in_specs=P(*m.axis_names), out_specs=P(*m.axis_names)) for m in meshes]
  step = jax.jit(lambda *xs: [layer(x) for layer, x in zip(layers, xs)])
  xs = [jax.ShapeDtypeStruct((2 * 64,), np.float32, sharding=jax.sharding.NamedSharding(m, P(*m.axis_names)))
        for m in meshes]
  with b12x_jax.channel("renamed"):
    text = step.lower(*xs).as_text()
  assert text.count("stablehlo.create_token") == 1, text
  chain = _shard_map_chain(text)
  assert len(chain) == 3, text
  for (previous, _), (_, operands) in zip(chain, chain[1:]):
    assert f"{previous}#0" in operands, text


def test_one_body_calling_over_two_axes_on_one_channel_joins_their_tokens(cpu_mesh):
  # A 2-D mesh: the body's calls over "x" and over "y" start from the channel's one token, and the
  # next shard_map takes both of their ends.
  mesh = jax.sharding.Mesh(np.array(cpu_mesh(4).devices).reshape(2, 2), ("x", "y"))
  body = lambda v: b12x_jax.all_reduce(v, "x") + b12x_jax.all_reduce(v, "y")  # noqa: E731
  layer = jax.shard_map(body, mesh=mesh, in_specs=P("x", "y"), out_specs=P(), check_vma=False)
  step = jax.jit(lambda a, b: (layer(a), layer(b)))
  x = jax.ShapeDtypeStruct((2 * 8, 2 * 8), np.float32, sharding=jax.sharding.NamedSharding(mesh, P("x", "y")))
  with b12x_jax.channel("two_axes"):
    text = step.lower(x, x).as_text()
  assert text.count("stablehlo.create_token") == 1 and text.count("stablehlo.after_all") == 2, text
  first, second = _shard_map_chain(text)
  joined = re.search(rf"(%[\w]+) = stablehlo.after_all {re.escape(first[0])}#0, {re.escape(first[0])}#1", text)
  assert joined and joined.group(1) in second[1], text
