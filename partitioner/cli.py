"""The ``pipecut`` command line: ``pipecut plan MODEL --stages N`` prints (and saves) a plan.

Examples::

    pipecut plan gpt2-tiny --stages 4
    pipecut plan gpt2-175b --stages 64 --device A100-80GB --granularity module --json plan.json
    pipecut plan my_model.py:build --stages 2 --device cpu --dot plan.dot
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from .api import METHODS, partition
from .devices import DEVICE_PRESETS, Cluster
from .errors import PipecutError
from .zoo import MODELS, load_model

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``pipecut``."""
    parser = argparse.ArgumentParser(
        prog="pipecut", description="Cut a PyTorch model into pipeline stages and show the plan."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log each step's timing")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="trace, cost and partition a model; print the stage table")
    plan.add_argument(
        "model", help=f"a built-in model ({', '.join(MODELS)}) or path/to/file.py:factory "
        "where factory() returns (model, example_inputs) for one micro-batch"
    )
    plan.add_argument("--stages", type=int, required=True, help="number of pipeline stages")
    plan.add_argument(
        "--device", default="A100-80GB", help=f"device preset for every stage ({', '.join(DEVICE_PRESETS)})"
    )
    plan.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    plan.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    plan.add_argument("--method", default="exact", choices=METHODS)
    plan.add_argument("--no-refine", action="store_true", help="skip the DAG refinement after 'exact'")
    plan.add_argument("--split-points", default=None, help="comma-separated module names where stages begin")
    plan.add_argument("--granularity", default="node", choices=("node", "module"))
    plan.add_argument("--state-bytes", type=float, default=16.0, help="training-state bytes per parameter")
    plan.add_argument("--link-bandwidth", type=float, default=None, help="bytes/s between neighbouring devices")
    plan.add_argument("--json", dest="json_path", default=None, help="write the plan as JSON here")
    plan.add_argument("--dot", dest="dot_path", default=None, help="write a Graphviz DOT picture here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return _plan(args)
    except (PipecutError, ImportError, FileNotFoundError, ValueError) as e:
        print(f"pipecut: error: {e}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    model, inputs = load_model(args.model)
    cluster = Cluster.uniform(args.stages, args.device, link_bandwidth=args.link_bandwidth)
    split = [s.strip() for s in args.split_points.split(",")] if args.split_points else None
    plan = partition(
        model, inputs, args.stages, cluster=cluster, microbatches=args.microbatches,
        schedule=args.schedule, method=args.method, refine=not args.no_refine, split_points=split,
        granularity=args.granularity, state_bytes_per_param=args.state_bytes,
    )
    print(plan, end="")
    if args.json_path:
        plan.save(args.json_path)
        print(f"plan written to {args.json_path}")
    if args.dot_path:
        plan.to_dot(args.dot_path)
        print(f"DOT written to {args.dot_path}")
    logging.getLogger(__name__).info("total %.2fs", time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
