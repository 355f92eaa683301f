"""Exceptions raised by b12x_jax. Messages name the op, the argument, what
must hold, the value seen and the fix."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator


class B12xError(RuntimeError):
  """Base class of every b12x_jax error."""


class ChannelError(B12xError, ValueError):
  """A channel is misnamed, unowned in strict mode, or not prepared; its
  settings differ between processes; or the communicator is closed."""


class IneligibleError(B12xError, ValueError):
  """A call is outside the b12x window under policy "strict" (DESIGN C12)."""


class TransportError(B12xError):
  """Peer memory could not be set up between the devices of a group."""


class GroupUnreachableError(TransportError):
  """The devices of a group cannot reach each other's memory at all (a
  failed peer-access probe, a group across hosts): a property of the group,
  which the Communicator remembers for every channel of it. Any other
  TransportError (a channel's allocation, opening its memory) is that
  channel's, met again by its next preparation."""


class CollectiveTimeoutError(B12xError):
  """A peer did not arrive within the channel's timeout (DESIGN C8)."""


# XLA:CPU fails an execution whose input is the output of a failed one with
# "Error dispatching computation: " plus that one's message, so the error of
# one failed collective read at the end of a loop of N dependent executions
# carries the prefix N times (seen on jax 0.11.2 and 0.12.0.1).
_DISPATCH_PREFIXES = re.compile(r"(?:Error dispatching computation: )+")


@contextlib.contextmanager
def short_errors() -> Iterator[None]:
  """Inside the block, a runtime error whose text repeats XLA's "Error
  dispatching computation: " is raised again, of the same type, with the
  repetitions cut to a count: the failed call's own message (for a b12x
  call: channel, rank, missing peer, epoch) comes first."""
  try:
    yield
  except RuntimeError as e:
    text = str(e)
    found = _DISPATCH_PREFIXES.search(text)
    if found is None:
      raise
    repeats = found.group().count("Error dispatching computation: ")
    raise type(e)(f"{text[:found.start()]}{text[found.end():]} (failed first; {repeats} later executions that "
                  f"depended on it failed with it, each adding XLA's 'Error dispatching computation: ')") from None
