"""What every op module shares: the axis check and the lowering of a b12x
custom call (preparation of the channel, then the FFI call or the psum path)."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.interpreters import mlir

from b12x_jax import _compat, _native
from b12x_jax.communicator import get_communicator


def axis_size(axis_name: str, op: str) -> int:
  """The size of a bound mesh axis, or a ValueError that says how to bind it."""
  if not isinstance(axis_name, str):
    raise TypeError(f"b12x_jax.{op}: axis_name must be one mesh axis name (a str), got {axis_name!r}")
  try:
    return jax.lax.axis_size(axis_name)
  except (NameError, KeyError, ValueError) as e:
    raise ValueError(
        f"b12x_jax.{op}: unknown axis_name {axis_name!r}: call it inside jax.shard_map over a mesh with "
        f"that axis ({e})") from None


def b12x_lowering(op: str, target: str, fallback: Callable, fallback_path: str = "psum") -> Callable:
  """A lowering rule: prepares the call's channel for the device groups of
  its axis (DESIGN C4: before any execution), then emits the FFI custom call
  with ``channel_id`` and the op's static parameters as attributes. Where
  the group's transport is broken and the policy allows, lowers ``fallback``
  (the ``fallback_path``: psum, or all_to_all for dcp_a2a) instead."""
  ffi_rule = jax.ffi.ffi_lowering(target, has_side_effect=True)
  fallback_rule = mlir.lower_fun(fallback, multiple_results=True)

  def rule(ctx, *args, axis_name: str, channel: str, **params):
    groups = _compat.axis_device_groups(ctx, axis_name)
    _native.ensure_registered()
    if get_communicator().ensure_prepared(op, channel, groups, fallback_path) is not None:
      return fallback_rule(ctx, *args, axis_name=axis_name, **params)
    return ffi_rule(ctx, *args, channel_id=channel, **params)

  return rule
