"""all_reduce: one-shot sum over a mesh axis (DESIGN §1, §2)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from b12x_jax import _compat, tuning
from b12x_jax.channels import resolve_channel
from b12x_jax.communicator import get_communicator
from b12x_jax.ops._common import axis_size, b12x_lowering

_OP = "all_reduce"
_TARGET = "b12x_all_reduce"
# The `algorithm` attribute of the custom call (ffi/cuda/all_reduce.cu).
_ALGORITHM_CODES = {"one_shot": 0, "two_shot": 1, "one_shot_pull": 2}

# -- validation -----------------------------------------------------------------


def _check_operand(x) -> jax.Array:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"b12x_jax.{_OP}: x must be an array, got {type(x).__name__}")
  return jnp.asarray(x)


# -- public function -------------------------------------------------------------


def all_reduce(x, axis_name: str, *, channel: str | None = None) -> jax.Array:
  """Sum of ``x`` over the devices of mesh axis ``axis_name``, like
  ``jax.lax.psum(x, axis_name)``.

  Call it inside ``jax.shard_map`` (under ``jax.jit``). Every rank gets the
  same bits: fp32 accumulation in rank order 0..N-1, one rounding to x's
  dtype. Runs on the channel of the enclosing ``b12x_jax.channel`` scope
  (or ``channel``; "default" outside any scope).

  Takes the b12x path for float32/bfloat16/float16 payloads that are a
  multiple of 16 bytes and at most the communicator's ``capacity_bytes``;
  otherwise psum (policy "auto") or an IneligibleError (policy "strict").
  The choice is recorded in ``get_communicator().decisions``.
  """
  x = _check_operand(x)
  size = axis_size(axis_name, _OP)
  name = resolve_channel(channel, _OP)
  if size == 1:
    return x
  comm = get_communicator()
  nbytes = x.size * x.dtype.itemsize
  decision = comm.choose_path(_OP, name, nbytes, x.dtype, size)
  if decision.path == "psum":
    return jax.lax.psum(x, axis_name)
  algorithm, why = _algorithm(comm, nbytes, size)
  if algorithm == "psum" and comm.policy == "auto":
    comm.decisions[-1] = dataclasses.replace(decision, path="psum", reason=why)
    return jax.lax.psum(x, axis_name)
  comm.decisions[-1] = dataclasses.replace(decision, reason=f"{decision.reason}; {why}")
  return all_reduce_p.bind(x, axis_name=axis_name, channel=name, algorithm=np.int32(_ALGORITHM_CODES[algorithm]))


def _algorithm(comm, nbytes: int, size: int) -> tuple[str, str]:
  """"one_shot", "two_shot", "one_shot_pull" or "psum" for ``nbytes`` over ``size`` ranks,
  and why: the Communicator's setting, else the crossovers of tuning.py
  (payloads in the Lamport window take it whatever is chosen here)."""
  if comm.algorithm != "auto":
    return comm.algorithm, f"{comm.algorithm} (Communicator(algorithm={comm.algorithm!r}))"
  if nbytes <= comm.lamport_bytes:
    return "one_shot", "Lamport window"
  crossover = tuning.crossover_for(jax.devices()[0].device_kind, size)
  if crossover.psum_from is not None and nbytes >= crossover.psum_from:
    return "psum", f"psum is faster from {crossover.psum_from} bytes ({crossover.source})"
  if crossover.two_shot_from is not None and nbytes >= crossover.two_shot_from:
    return "two_shot", f"two_shot from {crossover.two_shot_from} bytes ({crossover.source})"
  return "one_shot", f"one_shot ({crossover.source})"


# -- lowering ---------------------------------------------------------------------


def _abstract_eval(x, *, axis_name: str, channel: str, algorithm: int):
  del channel, algorithm
  return _compat.drop_varying_axis(x, axis_name)


def _eager_impl(x, *, axis_name: str, channel: str, algorithm: int):
  raise ValueError(f"b12x_jax.{_OP} runs inside jax.shard_map under jax.jit, not eagerly "
                   f"(axis {axis_name!r}, channel {channel!r})")


def _psum_path(x, *, axis_name: str, algorithm: int = 0):
  del algorithm
  return [jax.lax.psum(x, axis_name)]


# -- registration ----------------------------------------------------------------

all_reduce_p = Primitive("b12x_all_reduce")
all_reduce_p.def_abstract_eval(_abstract_eval)
all_reduce_p.def_impl(_eager_impl)
for _platform in ("cpu", "cuda"):
  mlir.register_lowering(all_reduce_p, b12x_lowering(_OP, _TARGET, _psum_path), platform=_platform)
mlir.register_lowering(all_reduce_p, mlir.lower_fun(_psum_path, multiple_results=True))
