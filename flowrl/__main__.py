"""``python -m flowrl``: the CLI (also what ``accelerate launch -m flowrl train CONFIG`` runs in each process)."""

import sys

from .cli import main

sys.exit(main())
