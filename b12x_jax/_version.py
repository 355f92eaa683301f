"""The package version, read from its installed metadata (pyproject.toml's)."""

from importlib.metadata import version

__version__ = version("b12x_jax")
