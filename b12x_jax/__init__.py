"""b12x_jax: intra-node collectives for JAX as XLA FFI custom calls.

Public API (re-exports only; see each module for the contracts). README.md
has the guide; docs/DESIGN.md the protocols.
"""

from b12x_jax._version import __version__
from b12x_jax.channels import DEFAULT_CHANNEL, channel, current_channel, is_strict, set_strict
from b12x_jax.communicator import Communicator, check_errors, get_communicator, set_communicator
from b12x_jax.errors import (B12xError, ChannelError, CollectiveTimeoutError, IneligibleError,
                             TransportError, short_errors)
from b12x_jax.ops.all_reduce import all_reduce
from b12x_jax.ops.dcp_a2a import dcp_a2a
from b12x_jax.ops.residual_rmsnorm import all_reduce_residual_rmsnorm
from b12x_jax.policy import Decision


__all__ = [
    "B12xError", "ChannelError", "CollectiveTimeoutError", "Communicator", "DEFAULT_CHANNEL", "Decision",
    "IneligibleError", "TransportError", "all_reduce", "all_reduce_residual_rmsnorm", "channel", "check_errors", "current_channel", "dcp_a2a",
    "get_communicator", "is_strict", "set_communicator", "set_strict", "short_errors", "__version__",
]
