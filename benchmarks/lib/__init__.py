"""What the benchmark scripts share; the scripts in ``benchmarks/`` are what you run, these are their parts.

A script imports them as ``lib.common``, ``lib.tensor_peak``... with ``benchmarks/`` on ``sys.path``
(where Python puts a script's own folder when it runs ``python benchmarks/X.py``; the scripts that
tests load in-process put it there themselves).

- ``common``: a result's file, the git state and machine it was measured on, list arguments, step times.
- ``fixed_cost``, ``schedules_report``: stages of known cost and the tables of ``schedules.py``.
- ``layout_stats``, ``tp_allreduce``: ``layout.py``'s statistics and its tensor-parallel all-reduce timing.
- ``memory_engines``, ``tensor_peak``: ``memory.py --engines``'s runs, and CPU tensor bytes over time.
"""
