"""The version of fp8kv: written here only (pyproject.toml reads it, ``fp8kv.__version__`` re-exports it)."""

__version__ = "0.3.0"
