"""Channel scopes: which channel a traced collective belongs to.

A channel is one totally ordered sequence of collectives with its own signal
counters and staging memory (DESIGN C1-C3). Its name is taken from the
innermost ``with channel(name):`` scope active while a function is traced,
and attached to the custom call as the static attribute ``channel_id``.

The scope is a ``jax.make_user_context`` value, so it is part of every jit
and trace cache key: the same jitted function traced under "target" and
under "draft" is traced, lowered and compiled twice, into two executables
bound to two channels, and a nested trace inherits its enclosing channel.

Known escapes (by construction of JAX, documented and tested):
  * other Python threads do not see a scope entered in this thread;
  * rules JAX traces after the call, under the scope active then: a
    ``vjp_fn`` called outside the scope, a ``custom_vjp``'s bwd (traced when
    the vjp_fn runs), a ``custom_jvp``'s rule of a jitted function
    differentiated later (``grad(jit(f))``); pass ``channel=`` in such rules,
    or put the scope around the differentiation;
  * AOT-compiled (``lower().compile()``) and exported functions keep the
    channel they were lowered with (in each call's ``channel_id``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
import zlib
from collections.abc import Iterator

import jax
import numpy as np

from b12x_jax import _compat
from b12x_jax.errors import ChannelError

DEFAULT_CHANNEL = "default"

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

# Part of jit's cache key: retracing per channel is what keeps two channels'
# executables apart.
_channel_context = jax.make_user_context(default_value=None)

_strict = threading.Event()


@dataclasses.dataclass(frozen=True)
class ChannelOrder(_compat.axis_effect_base()):
  """The order of one channel's calls over one mesh axis ``name`` inside a
  ``jax.shard_map`` (docs/DESIGN.md, "Call order"); made by
  ``channel_order``.

  An ordered effect, so JAX threads a token through every call of the
  channel in the shard_map's body: into and out of scan, while_loop, cond,
  nested jit, checkpoint and custom derivatives. Each call takes the token
  of the call before it and hands its own to the next, so every device runs
  the channel's calls in program order, whatever XLA's schedule.

  It is a named-axis effect of the call's mesh axis, which the shard_map
  binds: JAX drops such effects from the shard_map's own effects, as it
  does for psum's axis. So no function around the shard_map has an effect:
  its executable keeps JAX's fast dispatch path and the host runs ahead of
  the devices, as with psum. The chain starts and ends inside the module
  (``order_shard_maps``); from one executable to the next, each device's
  stream (or the host backend's queue) keeps dispatch order.
  """
  channel: str

  def __hash__(self) -> int:
    # The same in every process (str hashes are salted per process): JAX
    # orders a body's tokens by iterating a set of effects, and every
    # process must lower the same program (DESIGN "Call order").
    return zlib.crc32(f"b12x_jax.ChannelOrder/{self.channel}/{self.name}".encode())

  def __repr__(self) -> str:
    return f"ChannelOrder(channel={self.channel!r}, axis={self.name!r})"


_compat.register_ordered_effect(ChannelOrder)


def channel_order(channel: str, axis_name: str) -> ChannelOrder:
  """The ordered effect of ``channel``'s calls over mesh axis ``axis_name``."""
  return ChannelOrder(axis_name, channel)


def validate_channel_name(name: object, where: str) -> str:
  """Returns ``name`` if it is a valid channel name, else raises ChannelError."""
  if not isinstance(name, str) or not _NAME.fullmatch(name):
    raise ChannelError(
        f"{where}: channel name must be 1-64 characters of letters, digits, '_', '.' or '-', "
        f"got {name!r}; use a stable semantic name such as 'target' or 'draft'")
  return name


@contextlib.contextmanager
def channel(name: str) -> Iterator[str]:
  """Traces every collective inside the block on channel ``name``.

  Computations that can run independently of each other (a target and a
  draft model; profiling and production) must use different channels.
  Scopes nest; the innermost wins. Yields the name.
  """
  validate_channel_name(name, "b12x_jax.channel")
  with _channel_context(name):
    yield name


def current_channel() -> str | None:
  """The channel of the innermost active scope, or None outside any scope."""
  return _channel_context.value


def set_strict(enabled: bool = True) -> None:
  """In strict mode a collective traced outside any channel scope (and
  without ``channel=``) raises instead of using channel "default", and a
  channel must be prepared explicitly (``Communicator.prepare``) before use.
  It is read while tracing and is not part of jit's cache key: a function
  traced before it changed runs on as it was traced.
  """
  if not isinstance(enabled, (bool, np.bool_)):
    raise TypeError(f"b12x_jax.set_strict: enabled must be True or False, got {enabled!r}")
  if enabled:
    _strict.set()
  else:
    _strict.clear()


def is_strict() -> bool:
  return _strict.is_set()


def resolve_channel(explicit: str | None, op: str) -> str:
  """The channel a collective traced now belongs to: ``explicit``, else the
  active scope, else "default" (an error in strict mode)."""
  if explicit is not None:
    return validate_channel_name(explicit, f"b12x_jax.{op}(channel=...)")
  scoped = current_channel()
  if scoped is not None:
    return scoped
  if is_strict():
    raise ChannelError(
        f"b12x_jax.{op}: traced outside any channel scope in strict mode; wrap the "
        f"computation in `with b12x_jax.channel(name):` or pass channel=... (a custom_vjp bwd or "
        f"custom_jvp rule is traced when it is differentiated, after the scope of its call: pass channel= "
        f"there) (or leave strict mode: b12x_jax.set_strict(False))")
  return DEFAULT_CHANNEL
