"""``python -m megatron_hetero.cli``: the ``megatron-hetero`` command."""

import sys

from . import main

sys.exit(main())
