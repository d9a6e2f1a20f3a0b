"""fp8kv's hardware CI matrix: cells as data (``ci/matrix.toml``), claims derived from the
backend registry for each cell's device, a runner for one cell, and the aggregated report
``ci/reports/MATRIX.md``. Not part of the installed package: run from a checkout, ``python -m ci``."""
