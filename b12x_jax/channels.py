"""Channel scopes: which channel a traced collective belongs to.

A channel is one totally ordered sequence of collectives with its own signal
counters and staging memory (DESIGN §2). Its name is taken from the
innermost ``with channel(name):`` scope active while a function is traced,
and attached to the custom call as the static attribute ``channel_id``.

The scope is a ``jax.make_user_context`` value, so it is part of every jit
and trace cache key: the same jitted function traced under "target" and
under "draft" is traced, lowered and compiled twice, into two executables
bound to two channels, and a nested trace inherits its enclosing channel.

Known escapes (by construction of JAX, documented and tested):
  * other Python threads do not see a scope entered in this thread;
  * a ``vjp_fn`` called outside the scope traces under the scope active then;
  * AOT-compiled (``lower().compile()``) and exported functions keep the
    channel they were lowered with (an exported one names it in its ordered
    effect, ``channel_order``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
import zlib
from collections.abc import Iterator
from typing import ClassVar

import jax

from b12x_jax import _compat
from b12x_jax.errors import ChannelError

DEFAULT_CHANNEL = "default"

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

# Part of jit's cache key: retracing per channel is what keeps two channels'
# executables apart.
_channel_context = jax.make_user_context(default_value=None)

_strict = threading.Event()


class ChannelOrder(_compat.effect_base()):
  """The ordered effect of every call on one channel (DESIGN C15); made by
  ``channel_order(name)``.

  JAX threads one token per effect through the program: each call on a
  channel takes the token of the call before it and hands its own to the
  next, through scan, while_loop and cond, and from one executable to the
  next in dispatch order. So every device runs a channel's calls in program
  order, whatever XLA's schedule (XLA:CPU runs independent custom calls in
  different orders on different devices), and two channels stay independent.

  Each channel's effect is an instance of a class of its own, named after
  the channel, whose constructor takes no argument: ``jax.export``
  serializes an effect as its class's name and deserializes it by calling
  the registered class of that name, so the name must say the channel and
  the class must make the effect by itself. Instances of one class are
  equal.
  """
  channel: ClassVar[str]

  def __eq__(self, other) -> bool:
    return type(other) is type(self)

  def __hash__(self) -> int:
    # The same in every process (str hashes are salted per process): JAX
    # orders a program's tokens by iterating a set of effects, and every
    # process must lower the same program (DESIGN "Call order"); XLA:GPU's
    # sharded autotuning waits forever for peers whose module differs.
    return zlib.crc32(f"b12x_jax.ChannelOrder/{self.channel}".encode())

  def __repr__(self) -> str:
    return f"ChannelOrder(channel={self.channel!r})"


_order_types: dict[str, type[ChannelOrder]] = {}
_order_types_lock = threading.Lock()


def channel_order(name: str) -> ChannelOrder:
  """The ordered effect of channel ``name`` (a valid channel name). Its
  class is made and registered with JAX on first use: before
  ``jax.export.deserialize`` of a module with calls on ``name``, something
  in the process must have made it (``channel(name)``,
  ``Communicator.prepare`` or a traced call on the channel)."""
  with _order_types_lock:
    order_type = _order_types.get(name)
    if order_type is None:
      order_type = type(f"ChannelOrder[{name}]", (ChannelOrder,),
                        {"channel": name, "__module__": __name__, "__qualname__": f"ChannelOrder[{name}]"})
      _compat.register_effect(order_type, ordered=True)
      _order_types[name] = order_type
  return order_type()


@dataclasses.dataclass(frozen=True)
class ChannelMemory(_compat.effect_base()):
  """The unordered effect every b12x call has besides its ChannelOrder: it
  writes channel memory outside the program's buffers. So
  ``jax.effects_barrier()`` waits for it, and an AOT-compiled executable
  (``lower().compile()``) dispatches every call through the path that passes
  the order tokens: on jax 0.11.2 the C++ fast path of a compiled executable
  without unordered effects drops them ("Execution supplied 1 arguments but
  compiled program expected 2" from its second call on)."""


channel_memory = ChannelMemory()
_compat.register_effect(ChannelMemory, ordered=False)


def settle() -> None:
  """Waits until every execution this thread dispatched with b12x calls (on
  any channel) is done, and forgets their order tokens: a failed call's
  error, raised from that call, does not come back from the next one."""
  _compat.wait_for_dispatched()


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
  channel_order(name)  # what jax.export.deserialize of a module on this channel looks up
  with _channel_context(name):
    yield name


def current_channel() -> str | None:
  """The channel of the innermost active scope, or None outside any scope."""
  return _channel_context.value


def set_strict(enabled: bool = True) -> None:
  """In strict mode a collective traced outside any channel scope (and
  without ``channel=``) raises instead of using channel "default", and a
  channel must be prepared explicitly (``Communicator.prepare``) before use.
  """
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
        f"computation in `with b12x_jax.channel(name):` or pass channel=... "
        f"(or leave strict mode: b12x_jax.set_strict(False))")
  return DEFAULT_CHANNEL
