"""all_reduce: one-shot sum over a mesh axis (DESIGN §1, §2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from b12x_jax import _compat
from b12x_jax.channels import resolve_channel
from b12x_jax.communicator import get_communicator
from b12x_jax.ops._common import axis_size, b12x_lowering

_OP = "all_reduce"
_TARGET = "b12x_all_reduce"

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
  decision = get_communicator().choose_path(_OP, name, x.size * x.dtype.itemsize, x.dtype, size)
  if decision.path == "psum":
    return jax.lax.psum(x, axis_name)
  return all_reduce_p.bind(x, axis_name=axis_name, channel=name)


# -- lowering ---------------------------------------------------------------------


def _abstract_eval(x, *, axis_name: str, channel: str):
  del channel
  return _compat.drop_varying_axis(x, axis_name)


def _eager_impl(x, *, axis_name: str, channel: str):
  raise ValueError(f"b12x_jax.{_OP} runs inside jax.shard_map under jax.jit, not eagerly "
                   f"(axis {axis_name!r}, channel {channel!r})")


def _psum_path(x, *, axis_name: str):
  return [jax.lax.psum(x, axis_name)]


# -- registration ----------------------------------------------------------------

all_reduce_p = Primitive("b12x_all_reduce")
all_reduce_p.def_abstract_eval(_abstract_eval)
all_reduce_p.def_impl(_eager_impl)
for _platform in ("cpu", "cuda"):
  mlir.register_lowering(all_reduce_p, b12x_lowering(_OP, _TARGET, _psum_path), platform=_platform)
mlir.register_lowering(all_reduce_p, mlir.lower_fun(_psum_path, multiple_results=True))
