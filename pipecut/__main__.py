"""``python -m pipecut``: the same command line as the ``pipecut`` script."""

from __future__ import annotations

import sys

from pipecut.cli import main

if __name__ == "__main__":
    sys.exit(main())
