"""b12x_jax.short_errors: the error of one failed collective, read at the end
of a loop of executions that consumed its outputs, comes back without XLA's
"Error dispatching computation: " repeated once per execution."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

import b12x_jax

ORIGINAL = "b12x_jax: channel 'c' rank 0 timed out after 0.3 s at epoch 1 waiting for rank 1, which did not arrive."

# A lonely rank 0 times out; 300 jitted steps chained on its output follow
# before the result is read, as in a decode loop.
LOOP = """
import contextlib
import jax, jax.numpy as jnp, b12x_jax
from jax.sharding import NamedSharding, PartitionSpec as P
b12x_jax.set_communicator(b12x_jax.Communicator(timeout_s=0.3))
mesh = jax.make_mesh((2,), ("tp",))
lonely = jax.jit(jax.shard_map(lambda v: jax.lax.cond(jax.lax.axis_index("tp") == 0,
                                                      lambda v: b12x_jax.all_reduce(v, "tp"), lambda v: v, v),
                               mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
step = jax.jit(lambda v: v * 2)
y = lonely(jax.device_put(jnp.ones((2, 256)), NamedSharding(mesh, P("tp"))))
try:
  with b12x_jax.short_errors() if SHORT else contextlib.nullcontext():
    for _ in range(300):
      y = step(y)
    y.block_until_ready()
except jax.errors.JaxRuntimeError as e:
  print("ERROR", str(e))
"""


def test_repeated_dispatch_prefixes_are_cut_to_a_count():
  with pytest.raises(jax.errors.JaxRuntimeError) as info:
    with b12x_jax.short_errors():
      raise jax.errors.JaxRuntimeError("INTERNAL: " + "Error dispatching computation: " * 300 + ORIGINAL)
  assert str(info.value).startswith("INTERNAL: " + ORIGINAL + " (failed first; 300 later executions")


def test_other_errors_pass_unchanged():
  error = RuntimeError(ORIGINAL)
  with pytest.raises(RuntimeError) as info:
    with b12x_jax.short_errors():
      raise error
  assert info.value is error


@pytest.mark.parametrize("short", [False, True])
def test_a_timeout_read_after_300_dependent_executions(short):
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  proc = subprocess.run([sys.executable, "-c", f"SHORT = {short}\n{LOOP}"], capture_output=True, text=True,
                        timeout=120, env={**os.environ, **env})
  message = next(line for line in proc.stdout.splitlines() if line.startswith("ERROR "))
  assert "channel 'default' rank 0 timed out" in message and "waiting for rank 1" in message
  if short:
    assert "Error dispatching computation" not in message.replace("'Error dispatching computation: '", "")
    assert "300 later executions" in message and len(message) < 600
  else:  # what XLA gives without it
    assert message.count("Error dispatching computation: ") == 300
