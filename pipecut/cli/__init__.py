"""The ``pipecut`` command line: ``main`` (the console script and ``python -m pipecut``) and its subcommands.

``command`` holds the parser, ``main`` and ``plan``, ``simulate`` and ``train``; ``calibrate`` and
``generate`` each have a module of their own, and ``common`` holds what they share (the console,
count arguments, a Hugging Face folder's model on meta). What ``train`` and ``generate`` run lives
in ``pipecut.train`` and ``pipecut.generate``; these modules parse, print and exit.

Example:
    >>> from pipecut.cli import build_parser
    >>> build_parser().parse_args(["simulate", "plan.json", "--microbatches", "8"]).microbatches
    8
"""

from __future__ import annotations

from pipecut.cli.command import EXIT_ERROR, EXIT_OVER_CAPACITY, build_parser, main, version

__all__ = ["main", "build_parser", "version", "EXIT_ERROR", "EXIT_OVER_CAPACITY"]
