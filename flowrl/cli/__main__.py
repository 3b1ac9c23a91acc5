"""``python -m flowrl.cli``, the same as ``python -m flowrl`` and the ``flowrl`` command."""

import sys

from . import main

sys.exit(main())
