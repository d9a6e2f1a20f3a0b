"""Sub-commands of the ``fp8kv`` CLI, one module each (see :mod:`fp8kv.cli`)."""
