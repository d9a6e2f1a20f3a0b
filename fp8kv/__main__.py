"""``python -m fp8kv``: the same as the ``fp8kv`` command."""

import sys

from .cli import main

sys.exit(main())
