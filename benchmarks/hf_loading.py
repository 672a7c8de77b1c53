"""Benchmark (issue 30): a rank's host memory while it loads its pipeline stages from a Hugging Face
Mixtral checkpoint, with and without the direct-to-slice copy of experts, beside ``from_pretrained``.

Run (CPU; the full profile about 6 minutes on a 2-core machine and 3 GiB of free memory; writes
``benchmarks/results/hf_loading.json``)::

    python benchmarks/hf_loading.py
    python benchmarks/hf_loading.py --quick --out /tmp/hf_loading.json    # a tiny Mixtral, p = 2
    python benchmarks/hf_loading.py --quick --modes streaming --out /tmp/hf_loading.json   # one mode
    python benchmarks/hf_loading.py --stages 2 --layers 4 --keep /tmp/mixtral

Legend: ``p`` stages (one per rank), ``L`` a layer, ``E`` an expert.

The checkpoint: a ``MixtralForCausalLM`` of ``--layers`` layers with ``--experts`` experts each,
written by ``save_pretrained`` in shards of ``--shard-mib``. transformers 5 keeps the experts fused
(``model.layers.L.mlp.experts.gate_up_proj`` and ``down_proj``) and writes them one by one
(``model.layers.L.block_sparse_moe.experts.E.w1/w2/w3.weight``), as Mixtral's published checkpoints
are; loading puts them back together through transformers' conversion mapping
(``runtime.state.hf_conversion``).

For each ``p`` of ``--stages``, twice (``streaming``: as shipped, each expert's tensor copied into
its slice of the fused destination as it is read; ``materialised``: ``_merged_slices`` patched to
return ``None``, so the converter stacks each layer's experts on the host first), ``p`` fresh gloo
processes (``runtime.transport.launch.spawn``) each partition the meta model into ``p`` stages and
build ``PipelineTrainer(plan, ..., transport='dist', init=Init(weights=folder))``, which
materialises the rank's own stage (left unwritten: ``will_load``) and reads only its tensors. The
trainer's call of ``load_weights`` is wrapped, and around it, per rank:

* the stage's destinations are written once (zeros) so their pages are resident before the
  baseline: what follows is what loading adds above the stage;
* ``VmHWM`` is reset to the RSS (``/proc/self/clear_refs``, ``5``, after ``gc`` and
  ``malloc_trim``): *RSS over stage* is the VmHWM after the load minus that RSS (heap, file pages
  mapped while read, glibc's slack; the profiler's own buffers too);
* *tensor peak over stage*: the highest bytes live in torch's CPU allocator counted from the same
  moment (``benchmarks/lib/tensor_peak.py``, every op recorded so the peak's blocks can be named),
  safetensors' whole-file mappings left out (c10 reports each ``safe_open`` as an allocation of the
  file's size; their pages, the ones read, are in the RSS figure) and counted apart
  (``mapped_files_peak_bytes``);
* the checkpoint keys the rank read (the safetensors reader's calls recorded), the largest of
  them, the files ``LoadReport.files`` names and ``bytes_read``; a check that every key read is of
  the rank's layers (or its non-layer names), and that every loaded tensor's float64 sum equals
  the writer's.

The bound checked (``--quick`` and the full profile): in the streaming path, *tensor peak over
stage* <= the largest source tensor the rank read + ``SLACK`` (64 KiB: the scalars and small
tensors of the load's bookkeeping, which do not grow with the model). Per row the table also
says whether each peak stays within one source tensor (``stage + one source tensor``).

The baseline a user would otherwise run: ``MixtralForCausalLM.from_pretrained(folder)`` in one
fresh process, with the same figures over its baseline (the whole model, so *over model*), twice:
as shipped (tensors read on worker threads, which the tensor count does not see) and with
``HF_DEACTIVATE_ASYNC_LOAD=1`` (on the calling thread: counted).

What the figures showed (full profile, ``results/hf_loading.json``): streaming, the tensor peak
over the stage is one expert's tensor, the copy ``Source.get`` makes of it before it goes into its
slices (a renamed tensor, the embedding say, is copied from the file mapping with no host copy).
The RSS over the stage is larger, for two reasons outside torch's allocator, measured by loading
two layers in one process: glibc's dynamic mmap threshold rises to the expert copy's size after
the first is freed, so later copies come from the heap, whose freed top is kept (about 11 of 19
MiB: 8 MiB with ``MALLOC_MMAP_THRESHOLD_=131072``); and the file pages of what a rank reads from
one shard stay in its RSS until that shard is closed (``_SafetensorsSource.read`` goes file by
file): the embedding's 16 MiB on the ranks that hold it. Copying each expert straight from the
mapping into its slices (``inner.read({key: views})`` instead of ``get``) measured 5 MiB over the
stage in place of 19 for the two layers, and no tensor peak.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# This checkout's packages first (an editable install may point at another one), and lib/.
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

from lib.common import int_list, load_before, run_env, write_result  # noqa: E402
from lib.common import proc_status as _status  # noqa: E402
from lib.tensor_peak import TensorTrace  # noqa: E402

__all__ = ["FULL", "QUICK", "SLACK", "Config", "main", "run"]

_MIB = 2**20
SLACK = 64 * 2**10  # bytes over the largest source tensor read that the bound allows (see the docstring)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Config:
    """The Mixtral checkpoint and the runs; passed to every spawned process."""

    layers: int
    hidden: int
    intermediate: int
    experts: int
    vocab: int
    heads: int
    kv_heads: int
    dtype: str
    shard_mib: float
    stages: tuple[int, ...]
    timeout: float = 900.0
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    def hf_config(self) -> Any:
        from transformers import MixtralConfig

        return MixtralConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            num_local_experts=self.experts, num_experts_per_tok=2, max_position_embeddings=256,
            tie_word_embeddings=False,
        )


# 8 x (8 experts x 3 x 1408 x 512) + 2 x 8k x 512 in fp32: 580 MiB, a 2.75 MiB expert tensor, 13 shards.
FULL = Config(layers=8, hidden=512, intermediate=1408, experts=8, vocab=8192, heads=8, kv_heads=2,
              dtype="float32", shard_mib=64, stages=(2, 4))
QUICK = Config(layers=2, hidden=64, intermediate=128, experts=4, vocab=512, heads=4, kv_heads=2,
               dtype="float32", shard_mib=0.25, stages=(2,), timeout=300.0)
MODES = ("streaming", "materialised")


# -- measuring (in each spawned process) -------------------------------------------------------------


def _reset_peak() -> tuple[int, bool]:
    """Free what can be freed and reset VmHWM to the RSS now (Linux 4.0+): the RSS, and whether it was reset."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc keeps freed blocks in its arenas: hand them back
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        reset = True
    except OSError:  # not allowed here: the VmHWM before the load is the baseline's peak (an underestimate)
        reset = False
    return _status()["VmRSS"], reset


@contextlib.contextmanager
def _measured(file_sizes: list[int]) -> Iterator[dict[str, Any]]:
    """Measure the block: VmHWM over the RSS at its start, and the tensor trace; fills the dict yielded."""
    out: dict[str, Any] = {}
    base, reset = _reset_peak()
    before = _status()
    hwm0 = before["VmHWM"]
    trace = TensorTrace(ops=True, exclude=file_sizes)
    with trace:
        yield out
        after = _status()  # before the profiler's replay allocates
    peak_ns = trace.peak_between(0, 2**63 - 1)[1]
    out.update(
        rss_baseline_bytes=base, hwm_reset=reset, rss_before=before, rss_after=after,
        rss_peak_over_baseline_bytes=after["VmHWM"] - (base if reset else hwm0),
        tensor_peak_over_baseline_bytes=trace.peak, tensor_after_bytes=trace.bytes_at(2**63 - 1),
        mapped_files_peak_bytes=trace.excluded_peak, tensor_allocations=trace.allocations,
        tensor_reused_addresses=trace.reused, tensor_live_at_peak=_group(trace.live_at(peak_ns)),
    )


def _group(live: list[Any], top: int = 8) -> list[dict[str, Any]]:
    """Blocks live at the peak, grouped by the op that allocated them (the innermost two), largest first."""
    groups: dict[str, list[int]] = {}
    for a in live:
        ops = [op for op in a.ops if not op.startswith("pipecut.span::")]
        g = groups.setdefault(" > ".join(ops[-2:]) or "(no op)", [0, 0])
        g[0] += a.nbytes
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return [{"bytes": b, "count": n, "ops": ops} for ops, (b, n) in rows[:top]]


def _unique_bytes(tensors: Iterator[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if not t.is_meta}
    return sum(storages.values())


# -- the steps, each in its own process ---------------------------------------------------------------


def _write(rank: int, world: int, cfg: Config, folder: str) -> dict[str, Any]:
    """The checkpoint, by ``save_pretrained``; the float64 sum of every tensor by its live name."""
    from transformers import MixtralForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model = MixtralForCausalLM(cfg.hf_config()).to(cfg.torch_dtype)
    model.save_pretrained(folder, max_shard_size=int(cfg.shard_mib * _MIB))
    sums = {n: torch.sum(t, dtype=torch.float64).item() for n, t in model.state_dict().items()}
    return {"sums": sums, "write_s": time.perf_counter() - t0,
            "model_bytes": _unique_bytes(iter(model.state_dict().values()))}


def _load_rank(rank: int, world: int, cfg: Config, folder: str, mode: str, file_sizes: list[int],
               sums: dict[str, float]) -> dict[str, Any]:
    """One rank: plan the meta model into ``world`` stages, build its stage from the checkpoint, measured."""
    from transformers import MixtralForCausalLM

    import runtime.state.hf_conversion as hf_conversion
    import runtime.trainer as trainer_module
    from partitioner import partition
    from runtime import Execution, Init, PipelineTrainer
    from runtime.state.materialize import empty_weights
    from runtime.state.weight_sources import _SafetensorsSource

    t0 = time.perf_counter()
    with empty_weights():
        model = MixtralForCausalLM(cfg.hf_config()).to(cfg.torch_dtype)
    plan = partition(model, (torch.zeros(1, 16, dtype=torch.long),), world, microbatches=world, schedule="1f1b")
    plan_s = time.perf_counter() - t0
    if mode == "materialised":  # the converter stacks each layer's experts on the host, then one copy
        hf_conversion._merged_slices = lambda group, wanted: None  # type: ignore[assignment]

    read_keys: list[str] = []
    safetensors_read = _SafetensorsSource.read

    def recording_read(self: Any, plan: Any, done: Any) -> int:
        read_keys.extend(plan)
        return safetensors_read(self, plan, done)

    _SafetensorsSource.read = recording_read  # type: ignore[method-assign]
    figures: dict[str, Any] = {}
    load_weights = trainer_module.load_weights

    def measured_load(source: Any, into: dict[str, torch.Tensor], **kw: Any) -> Any:
        with torch.no_grad():
            for t in into.values():
                t.zero_()  # the stage's pages resident before the baseline
        with _measured(file_sizes) as out:
            t = time.perf_counter()
            report = load_weights(source, into, **kw)
            out["load_s"] = time.perf_counter() - t
        figures.update(out)
        return report

    trainer_module.load_weights = measured_load  # type: ignore[attr-defined]
    reports: list[Any] = []
    logger = _report_logger(reports)
    trainer = PipelineTrainer(plan, None, execution=Execution(schedule="1f1b", transport="dist", timeout=cfg.timeout),
                              init=Init(weights=folder, seed=cfg.seed))
    logger()
    (report,) = reports
    modules = [st.module for st in trainer.stages.values()]
    stage_bytes = _unique_bytes(t for m in modules for t in (*m.parameters(), *m.buffers()))
    param_bytes = _unique_bytes(t for m in modules for t in m.parameters())
    names = dict(trainer.named_parameters())
    names.update({n: b for m in modules for n, b in m.named_buffers()})
    own_layers = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
    index = _index(folder)
    foreign = []
    for key in read_keys:
        match = _LAYER.match(key)
        mine = int(match.group(1)) in own_layers if match else report.prefix.to_name(key) in names
        if not mine:
            foreign.append(key)
    loaded = {n: t for m in modules for n, t in m.state_dict().items()}
    wrong = [n for n in report.names if not math.isclose(
        torch.sum(loaded[n], dtype=torch.float64).item(), sums[n], rel_tol=1e-9, abs_tol=1e-6)]
    largest = max(read_keys, key=lambda k: index[k][0], default=None)
    real = _unique_bytes(iter(model.parameters()))  # the meta model's real parameters: this rank's only
    return {
        "rank": rank, "stages": sorted(trainer.stages), "modules": [plan.stages[s].modules for s in trainer.stages],
        "layers": sorted(own_layers), "stage_bytes": stage_bytes, "param_bytes": param_bytes,
        "real_param_bytes_in_model": real,
        "keys_read": len(read_keys), "largest_read_key": largest,
        "largest_read_bytes": index[largest][0] if largest else 0,
        "foreign_keys_read": foreign, "values_wrong": wrong,
        "files": [os.path.basename(f) for f in report.files], "bytes_read": report.bytes_read,
        "files_read": sorted({os.path.basename(index[k][1]) for k in read_keys}),
        "tensors_loaded": len(report.names), "converted_keys": report.converted, "plan_s": plan_s, **figures,
    }


def _report_logger(into: list[Any]) -> Callable[[], None]:
    """Collect the LoadReports ``runtime.state.weights`` logs; returns the function that stops it."""
    import logging

    from runtime.state.weights import LoadReport

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            args = record.args if isinstance(record.args, tuple) else ()
            into.extend(a for a in args if isinstance(a, LoadReport))

    log = logging.getLogger("runtime.state.weights")
    handler = Keep(logging.INFO)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return lambda: log.removeHandler(handler)


def _index(folder: str) -> dict[str, tuple[int, str]]:
    """Checkpoint key -> (bytes, file), from the headers."""
    from runtime.state.weights import checkpoint_index

    return {k: (info.nbytes, info.files[0]) for k, info in checkpoint_index(folder).items()}


def _from_pretrained(rank: int, world: int, cfg: Config, folder: str, file_sizes: list[int],
                     threads: bool) -> dict[str, Any]:
    """The whole model as a user loads it without pipecut: ``from_pretrained``, measured the same way.

    transformers 5 reads tensors on a pool of worker threads by default (``threads``), whose
    allocations the tensor count does not see (``benchmarks/lib/tensor_peak.py``): its RSS is the
    figure then. ``HF_DEACTIVATE_ASYNC_LOAD=1`` loads on this thread, where every block is counted.
    """
    from transformers import MixtralForCausalLM

    if not threads:
        os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    with _measured(file_sizes) as out:
        t = time.perf_counter()
        model = MixtralForCausalLM.from_pretrained(folder, dtype=cfg.torch_dtype)
        out["load_s"] = time.perf_counter() - t
    out["threads"] = threads
    if threads:
        out["tensor_peak_over_baseline_bytes"] = None  # the workers' blocks are not counted
    return {"model_bytes": _unique_bytes(t for t in (*model.parameters(), *model.buffers())), **out}


# -- the run (in the launching process) --------------------------------------------------------------------


def run(cfg: Config, *, folder: str | None = None, modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    """Write the checkpoint into ``folder`` (a temporary one if ``None``), measure every rank of every
    ``p`` in each of ``modes`` and ``from_pretrained``; the results, checks included."""
    from runtime.transport.launch import spawn

    keep = folder is not None
    directory = folder or tempfile.mkdtemp(prefix="pipecut-hf-loading-")
    phases: dict[str, float] = {}
    try:
        t = time.perf_counter()
        writer = spawn(_write, 1, cfg, directory, timeout=cfg.timeout)[0]
        phases["write_s"] = time.perf_counter() - t
        index = _index(directory)
        files = sorted({f for _, f in index.values()})
        file_sizes = [os.path.getsize(f) for f in files]
        per_expert = [k for k in index if ".block_sparse_moe.experts." in k]
        if not per_expert:
            raise RuntimeError("save_pretrained wrote the experts fused: this transformers does not exercise the "
                               "conversion this benchmark measures")
        runs: dict[str, list[dict[str, Any]]] = {}
        for p in cfg.stages:
            for mode in modes:
                t = time.perf_counter()
                runs[f"{p}/{mode}"] = spawn(_load_rank, p, cfg, directory, mode, file_sizes, writer["sums"],
                                            timeout=cfg.timeout, threads=1)
                phases[f"p{p}_{mode}_s"] = time.perf_counter() - t
        t = time.perf_counter()
        whole = [spawn(_from_pretrained, 1, cfg, directory, file_sizes, threads, timeout=cfg.timeout)[0]
                 for threads in (True, False)]
        phases["from_pretrained_s"] = time.perf_counter() - t
    finally:
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)
    largest_key = max(index, key=lambda k: index[k][0])
    checkpoint = {
        "files": [os.path.basename(f) for f in files], "file_bytes": file_sizes, "keys": len(index),
        "per_expert_keys": len(per_expert), "bytes": sum(b for b, _ in index.values()),
        "largest_key": largest_key, "largest_bytes": index[largest_key][0],
        "largest_expert_bytes": max(index[k][0] for k in per_expert), "write_s": writer["write_s"],
        "kept": directory if keep else None,
    }
    rows = [_row(p, mode, r, runs[f"{p}/{other}"][r["rank"]] if f"{p}/{other}" in runs else None)
            for p in cfg.stages for mode, other in zip(MODES, reversed(MODES)) if mode in modes
            for r in runs[f"{p}/{mode}"]]
    for w in whole:
        w["over_model"] = {k: None if w[f"{k}_peak_over_baseline_bytes"] is None
                           else w[f"{k}_peak_over_baseline_bytes"] - w["model_bytes"] for k in ("rss", "tensor")}
    return {"config": {**dataclasses.asdict(cfg), "modes": list(modes)}, "checkpoint": checkpoint, "rows": rows,
            "from_pretrained": whole, "checks": _checks(rows), "phases_s": phases}


def _row(p: int, mode: str, r: dict[str, Any], other: dict[str, Any] | None) -> dict[str, Any]:
    """A rank's figures in one mode, with the bound's verdicts (``other``: the same rank in the other
    mode, if it ran)."""
    one = r["largest_read_bytes"]
    tensor, rss = r["tensor_peak_over_baseline_bytes"], r["rss_peak_over_baseline_bytes"]
    return {
        "p": p, "mode": mode, **r,
        "tensor_over_stage_bytes": tensor, "rss_over_stage_bytes": rss,
        "tensor_within_one_source": tensor <= one + SLACK, "rss_within_one_source": rss <= one + SLACK,
        "tensor_margin_bytes": one + SLACK - tensor,
        "same_stages_as_other_mode": None if other is None else r["stages"] == other["stages"],
    }


def _checks(rows: list[dict[str, Any]]) -> dict[str, Any]:
    streaming = [r for r in rows if r["mode"] == "streaming"]
    return {
        "streaming_tensor_peak_within_bound": {
            "rule": f"tensor peak over stage <= largest source tensor read + {SLACK} bytes, every rank, streaming",
            "per_rank": [(r["p"], r["rank"], r["tensor_margin_bytes"]) for r in streaming],
            "met": all(r["tensor_within_one_source"] for r in streaming),
        },
        "only_own_layers_read": {"met": not any(r["foreign_keys_read"] for r in rows)},
        "loaded_values_match": {"met": not any(r["values_wrong"] for r in rows)},
        "only_own_stage_allocated": {"met": all(r["real_param_bytes_in_model"] == r["param_bytes"] for r in rows)},
    }


# -- reporting -------------------------------------------------------------------------------------------


def _print(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def mib(x: float | None) -> str:
        return "-" if x is None else f"{x / _MIB:.2f}"

    cfg, ck = res["config"], res["checkpoint"]
    title = (f"Loading a Mixtral checkpoint per rank ({cfg['layers']} layers x {cfg['experts']} experts, hidden "
             f"{cfg['hidden']}, intermediate {cfg['intermediate']}, vocab {cfg['vocab']}, {cfg['dtype']}; "
             f"{len(ck['files'])} shards, {mib(ck['bytes'])} MiB), MiB")
    table = Table(title=title, title_justify="left")
    for col in ("p", "rank", "layers", "stage", "largest src read", "files", "read", "mode", "tensor peak over stage",
                "RSS peak over stage", "mapped (virtual)", "within stage + 1 src (tensor, RSS)", "load s"):
        table.add_column(col, justify="left" if col in ("layers", "mode", "files") else "right")
    for r in res["rows"]:
        layers = f"{r['layers'][0]}-{r['layers'][-1]}" if r["layers"] else "-"
        within = ", ".join("yes" if r[f"{k}_within_one_source"] else "no" for k in ("tensor", "rss"))
        table.add_row(str(r["p"]), str(r["rank"]), layers, mib(r["stage_bytes"]), mib(r["largest_read_bytes"]),
                      str(len(r["files_read"])), mib(r["bytes_read"]), r["mode"],
                      "+" + mib(r["tensor_over_stage_bytes"]), "+" + mib(r["rss_over_stage_bytes"]),
                      mib(r["mapped_files_peak_bytes"]), within, f"{r['load_s']:.2f}")
    console = Console(width=200)
    console.print(table)
    for w in res["from_pretrained"]:
        how = "worker threads (default)" if w["threads"] else "HF_DEACTIVATE_ASYNC_LOAD=1"
        console.print(
            f"from_pretrained, {how} (one process, the whole model): model {mib(w['model_bytes'])} MiB, RSS peak "
            f"+{mib(w['rss_peak_over_baseline_bytes'])} MiB over its baseline ({mib(w['over_model']['rss'])} over "
            f"the model), "
            + ("tensor peak not counted (worker threads)" if w["tensor_peak_over_baseline_bytes"] is None else
               f"tensor peak {mib(w['tensor_peak_over_baseline_bytes'])} MiB "
               f"({mib(w['over_model']['tensor'])} over the model: tensors not fused stay views of the mapped files)")
            + f", files mapped {mib(w['mapped_files_peak_bytes'])} MiB, {w['load_s']:.2f} s", soft_wrap=True)
    console.print(f"largest tensor in the checkpoint: {ck['largest_key']} ({mib(ck['largest_bytes'])} MiB); "
                  f"an expert's: {mib(ck['largest_expert_bytes'])} MiB", soft_wrap=True)
    for name, c in res["checks"].items():
        console.print(f"check {name}: {'met' if c['met'] else 'MISSED'}" + (f" ({c['rule']})" if "rule" in c else ""),
                      soft_wrap=True)
    for r in res["rows"]:
        if not r["tensor_within_one_source"]:
            top = r["tensor_live_at_peak"][:3]
            console.print(f"p={r['p']} rank {r['rank']} {r['mode']}: live at the tensor peak: "
                          + "; ".join(f"{mib(g['bytes'])} MiB in {g['count']} by {g['ops']}" for g in top),
                          soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny Mixtral (2 layers of 4 experts), p = 2")
    ap.add_argument("--stages", type=int_list, default=None, help="p values, comma-separated (default 2,4)")
    for name in ("layers", "hidden", "intermediate", "experts", "vocab"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    ap.add_argument("--shard-mib", type=float, default=None, help="save_pretrained's max_shard_size")
    ap.add_argument("--timeout", type=float, default=None, help="seconds for each spawned run")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)} (default both)")
    ap.add_argument("--keep", default=None, metavar="DIR", help="write the checkpoint here and keep it")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hf_loading.json"))
    cli = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(cli)
    given_modes = {m.strip() for m in args.modes.split(",") if m.strip()}
    modes = tuple(m for m in MODES if m in given_modes)  # streaming first, as the rows are
    if not modes or given_modes - set(MODES):
        ap.error(f"--modes {args.modes!r}: a comma-separated list of {', '.join(MODES)}")
    cfg = QUICK if args.quick else FULL
    given = {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "experts", "vocab", "dtype",
                                           "shard_mib", "timeout")}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in given.items() if v is not None})
    if args.stages:
        cfg = dataclasses.replace(cfg, stages=tuple(args.stages))
    t0 = time.time()
    load = load_before("the loading ranks")
    res = run(cfg, folder=args.keep, modes=modes)
    _print(res)
    meta = {"benchmark": "hf_loading", "command": shlex.join(["python", "benchmarks/hf_loading.py", *cli]),
            "slack_bytes": SLACK, **run_env(load, t0)}
    write_result(args.out, {"meta": meta, **res})
    return 0 if all(c["met"] for c in res["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
