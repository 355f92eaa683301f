"""Exceptions raised by b12x_jax. Messages name the op, the argument, what
must hold, the value seen and the fix."""

from __future__ import annotations


class B12xError(RuntimeError):
  """Base class of every b12x_jax error."""


class ChannelError(B12xError, ValueError):
  """A channel is misnamed, unowned in strict mode, or not prepared."""


class IneligibleError(B12xError, ValueError):
  """A call is outside the b12x window under policy "strict" (DESIGN C12)."""


class TransportError(B12xError):
  """Peer memory could not be set up between the devices of a group."""


class CollectiveTimeoutError(B12xError):
  """A peer did not arrive within the channel's timeout (DESIGN C8)."""
