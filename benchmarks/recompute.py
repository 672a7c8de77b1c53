"""Benchmark: activation recomputation per stage, measured against the plan's prediction.

Run (CPU, one thread, about a minute; writes ``benchmarks/results/recompute.json``)::

    python benchmarks/recompute.py
    python benchmarks/recompute.py --layers 4 --width 256 --seq 128 --stages 2 --microbatches 4 \
        --repeat 5 --out benchmarks/results/recompute.json

A small GPT-2 (``partitioner.zoo.gpt2``) is planned with measured node times (``profile=True``,
so the plan's times are this machine's) and trained with ``PipelineTrainer(transport=
'sequential', schedule='gpipe', record=True)``, once with ``recompute=False`` and once with
``recompute=True``, ``--repeat`` steps each after one warm-up step. Per stage:

* memory: bytes saved for backward by one micro-batch's forward (``runtime.execute.saved_memory.
  SavedBytes`` around the stage module's call, parameters excluded), and the bytes of the
  inputs a recomputing stage keeps instead (its tensor arguments). Saved per micro-batch in
  flight = plain forward's saved bytes - inputs; predicted = ``act_bytes - in_bytes``.
* time: the median ``B`` action of each way (``ActionRecord``); added = recomputing ``B`` -
  plain ``B``; predicted = the stage's ``fwd_time`` (``StagePlan.recompute_time``). The measured
  plain ``F`` is shown too: the replay is one more forward, so added / F is about 1.

Ratios are measured / predicted. Gradients of the two ways are checked equal before timing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# This checkout's packages first (an editable install may point at another one), and lib/.
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from torch import nn  # noqa: E402

from lib.common import git_state  # noqa: E402
from partitioner import partition  # noqa: E402
from partitioner.plan.render import fmt_bytes, fmt_time  # noqa: E402
from partitioner.zoo import gpt2  # noqa: E402
from runtime import Execution, PipelineTrainer  # noqa: E402
from runtime.execute.saved_memory import SavedBytes  # noqa: E402


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


class _Probe:
    """Per stage module call: bytes saved for backward inside it, and its tensor inputs' bytes."""

    def __init__(self, trainer: PipelineTrainer) -> None:
        self.params = list(trainer.parameters())
        self.saved: dict[int, list[int]] = defaultdict(list)
        self.inputs: dict[int, list[int]] = defaultdict(list)
        self._open: dict[int, SavedBytes] = {}
        for s, st in trainer.stages.items():
            st.module.register_forward_pre_hook(self._pre(s))
            st.module.register_forward_hook(self._post(s))

    def _pre(self, s: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            storages = {a.untyped_storage().data_ptr(): a.untyped_storage().nbytes()
                        for a in args if isinstance(a, torch.Tensor)}
            self.inputs[s].append(sum(storages.values()))
            meter = SavedBytes(exclude=self.params)
            self._open[s] = meter.__enter__()
        return hook

    def _post(self, s: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            meter = self._open.pop(s)
            meter.__exit__(None, None, None)
            self.saved[s].append(meter.total)
        return hook


def _run(plan: Any, recompute: bool, batches: list[tuple[torch.Tensor, torch.Tensor]], repeat: int) -> dict[str, Any]:
    trainer = PipelineTrainer(plan, _lm_loss, recompute=recompute,
                              execution=Execution(transport="sequential", schedule="gpipe", record=True))
    x, y = batches[0]
    trainer.zero_grad()  # the stages share the plan's model: the other way's gradients are there
    trainer.forward_backward(x, y)  # warm-up
    grads = {n: p.grad.clone() for n, p in trainer.named_parameters() if p.grad is not None}
    probe = _Probe(trainer)
    times: dict[tuple[int, str], list[float]] = defaultdict(list)
    for i in range(repeat):
        trainer.zero_grad()
        x, y = batches[1 + i % (len(batches) - 1)]
        trainer.forward_backward(x, y)
        for r in trainer.last_records:
            times[(r.stage, r.kind)].append(r.end - r.start)
    return {"grads": grads, "probe": probe, "times": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recompute.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model, _ = gpt2(n_layer=args.layers, n_embd=args.width, n_head=args.heads, vocab_size=args.vocab,
                    n_positions=args.seq, batch=args.rows, seq=args.seq)
    m = args.microbatches
    example = torch.randint(0, args.vocab, (args.rows, args.seq))
    plan = partition(model, (example,), args.stages, microbatches=m, schedule="gpipe", profile=True,
                     profile_device="cpu")
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, args.vocab, (args.rows * m, args.seq), generator=gen),
                torch.randint(0, args.vocab, (args.rows * m, args.seq), generator=gen))
               for _ in range(3)]
    plain = _run(plan, False, batches, args.repeat)
    recomputed = _run(plan, True, batches, args.repeat)
    for name, g in plain["grads"].items():  # one warm-up step each, same batch: same gradients
        torch.testing.assert_close(recomputed["grads"][name], g, rtol=2e-5, atol=2e-6)

    rows = []
    for st in plan.stages:
        s = st.index
        saved_plain = statistics.median(plain["probe"].saved[s])
        # A recomputing stage's module runs twice per micro-batch: F (saves nothing), then the replay.
        saved_rc_forward = min(recomputed["probe"].saved[s])
        inputs = statistics.median(plain["probe"].inputs[s])
        b_plain = statistics.median(plain["times"][(s, "B")])
        b_rc = statistics.median(recomputed["times"][(s, "B")])
        f_plain = statistics.median(plain["times"][(s, "F")])
        added = b_rc - b_plain
        rows.append({
            "stage": s,
            "saved_bytes_plain": saved_plain,
            "saved_bytes_recompute_forward": saved_rc_forward,
            "input_bytes": inputs,
            "memory_saved_measured": saved_plain - inputs,
            "memory_saved_predicted": st.act_bytes - st.in_bytes,
            "act_bytes_predicted": st.act_bytes,
            "in_bytes_predicted": st.in_bytes,
            "memory_ratio": (saved_plain - inputs) / (st.act_bytes - st.in_bytes),
            "forward_s_measured": f_plain,
            "backward_s_plain": b_plain,
            "backward_s_recompute": b_rc,
            "backward_added_s_measured": added,
            "backward_added_s_predicted": st.fwd_time,
            "time_ratio": added / st.fwd_time,
            "added_over_forward": added / f_plain,
        })

    console = Console(width=160, highlight=False)
    table = Table(title=f"recomputation per stage: GPT-2 {args.layers} layers x {args.width}, {args.rows} x "
                        f"{args.seq} tokens per micro-batch, {args.stages} stages, GPipe, m={m} (CPU, "
                        f"{args.threads} thread)", title_justify="left")
    for col in ("stage", "saved / mb (plain)", "inputs / mb", "saved by recompute", "predicted", "ratio",
                "F", "B plain", "B recompute", "B added", "predicted", "ratio", "added / F"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["stage"]), fmt_bytes(r["saved_bytes_plain"]), fmt_bytes(r["input_bytes"]),
            fmt_bytes(r["memory_saved_measured"]), fmt_bytes(r["memory_saved_predicted"]), f"{r['memory_ratio']:.2f}",
            fmt_time(r["forward_s_measured"]), fmt_time(r["backward_s_plain"]), fmt_time(r["backward_s_recompute"]),
            fmt_time(r["backward_added_s_measured"]), fmt_time(r["backward_added_s_predicted"]),
            f"{r['time_ratio']:.2f}", f"{r['added_over_forward']:.2f}",
        )
    console.print(table)
    console.print("ratio = measured / predicted; a recomputing forward saved "
                  f"{max(r['saved_bytes_recompute_forward'] for r in rows):.0f} bytes for backward")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/recompute.py" + ("" if argv is None else " " + " ".join(argv))
        env = {"torch": torch.__version__, "machine": platform.machine(), "python": platform.python_version(),
               "threads": args.threads, **git_state()}
        out.write_text(json.dumps({"benchmark": "recompute", "command": command, "config": vars(args),
                                   "env": env, "results": rows}, indent=2) + "\n")
        console.print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
