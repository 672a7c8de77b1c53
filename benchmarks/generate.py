"""Benchmark: pipelined generation on p ranks against one group at a time and against one process.

Run (CPU, ``p`` gloo processes with one thread each; a few minutes)::

    python benchmarks/generate.py
    python benchmarks/generate.py --quick --out /tmp/generate.json   # seconds: the test's run

One tiny-to-small Llama (random weights, ``--layers`` x ``--hidden``), planned into ``p`` stages
(``--ranks``), one stage per process, ``Generator(plan, transport='dist')``. For each batch size
(``--batches``, 1 to 64 sequences) of ``--prompt``-token prompts, ``--new`` new tokens each (no
end-of-sequence token: every sequence runs to its limit), side by side in the same processes:

* ``pipelined``: the sequences split into ``p`` groups in flight (the default), so every rank
  works on some group while the others work on others;
* ``in pieces``: the same with each group's prompt entering the pipeline ``--prefill-chunk``
  positions at a time (``generate(prefill_chunk=)``), so the next rank starts after the first
  piece rather than after the whole prompt (a shorter pipeline fill);
* ``2p groups``: the same with twice as many groups as ranks (from ``2 p`` sequences), so a
  rank whose next group is late has another to run;
* ``one group``: the same ranks with ``groups=1``, the device-map strategy (accelerate's
  ``device_map='auto'``): one rank works at a time;
* ``one process``: the whole model in rank 0, one thread, ``transport='sequential'`` (the other
  ranks wait in a barrier).

Tokens/s is the batch's new tokens over the wall time of ``generate`` (prefill included), the
best of ``--repeat`` runs after one untimed warm-up, the variants taking turns within each round.
All produce the same tokens (checked).

The cache check: on the pipelined ranks and a fixed batch, the time per new token at a
``--long``-token prefix against a ``--short`` one, each from two runs (``k`` and ``2k`` new
tokens; their difference over ``k`` leaves the prefill out). With a key/value cache a step
costs about the same whatever the prefix (attention over K positions is a small part of a
step at these sizes); without one it would grow with the prefix.

Each rank's peak resident memory (VmHWM) is set against the planner's estimate (``_memory_rows``):
the resident size before the model is built (interpreter, torch and transformers imported) is the
baseline, and the difference is what the run added. The estimate is the rank's stage in a plan for
generation (``Costing(inference=...)``: weights, KV cache and working memory, for the benchmark's
largest run: the most sequences at prompt + new tokens, or the cache check's long prefix) plus
what this benchmark keeps beside it, priced from the same plans: every rank builds the whole
model's weights (the Generator makes its own stage's modules real, the rest stays resident), and
rank 0 also holds the whole model in one process for the comparison, with its cache.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lib.common import int_list, load_before, proc_status, run_env, write_result
from partitioner import Costing, Inference, partition
from runtime.generate import Generator
from runtime.transport.launch import spawn


def _model(cfg: dict[str, Any]) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], num_key_value_heads=cfg["heads"], intermediate_size=4 * cfg["hidden"],
        max_position_embeddings=cfg["long"] + 4 * cfg["new"] + 8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _prompts(b: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(b * 1000 + length)
    return torch.randint(3, vocab, (b, length), generator=g).tolist()


def _timed(fns: list[Any], repeat: int) -> list[tuple[float, Any]]:
    """Best wall time of ``repeat`` calls of each of ``fns`` (all ranks start together), and its last result.

    The calls interleave (each round runs every function once, in turn), so a swing in the shared
    machine's load reaches every variant alike rather than the one that happened to run during it.
    """
    best, outs = [float("inf")] * len(fns), [None] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            dist.barrier()
            t = time.perf_counter()
            outs[i] = fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return list(zip(best, outs))


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    before = _resident_before_model()
    example = (torch.zeros(1, 8, dtype=torch.long),)
    gen = Generator(partition(_model(cfg), example, world), transport="dist", timeout=cfg["timeout"])
    whole = Generator(partition(_model(cfg), example, 1), transport="sequential") if rank == 0 else None
    new = cfg["new"]
    rows: list[dict[str, Any]] = []
    for b in cfg["batches"]:
        prompts = _prompts(b, cfg["prompt"], cfg["vocab"])

        def run(groups: int | None, chunk: int | None = None, prompts: list[list[int]] = prompts) -> Any:
            return gen.generate(prompts, max_new_tokens=new, eos_token_id=[], pad_token_id=0, groups=groups,
                                prefill_chunk=chunk)

        run(None)  # warm-up
        more = 2 * world  # twice as many groups as ranks: slack for a rank whose group comes back late
        variants = [lambda: run(None), lambda: run(1), lambda: run(None, cfg["prefill_chunk"] or None)]
        variants += [lambda m=more: run(m)] if b >= more else []
        (t_pipe, piped), (t_one, one), (t_pieces, pieces), *rest = _timed(variants, cfg["repeat"])
        t_more, deep = rest[0] if rest else (float("nan"), piped)
        dist.barrier()
        t_proc, same = float("nan"), True
        if whole is not None:
            whole.generate(prompts, max_new_tokens=new, eos_token_id=[], pad_token_id=0)
            t_proc = float("inf")
            for _ in range(cfg["repeat"]):
                t = time.perf_counter()
                alone = whole.generate(prompts, max_new_tokens=new, eos_token_id=[], pad_token_id=0)
                t_proc = min(t_proc, time.perf_counter() - t)
            same = all(torch.equal(alone.sequences, x.sequences) for x in (piped, one, deep, pieces))
        dist.barrier()
        tokens = b * new
        rows.append({"sequences": b, "groups_in_flight": min(b, world), "new_tokens": tokens,
                     "pipelined_tok_s": tokens / t_pipe, "one_group_tok_s": tokens / t_one,
                     "pipelined_2p_groups_tok_s": tokens / t_more, "pipelined_2p_groups_s": t_more,
                     "pipelined_pieces_tok_s": tokens / t_pieces, "pipelined_pieces_s": t_pieces,
                     "one_process_tok_s": tokens / t_proc, "pipelined_s": t_pipe, "one_group_s": t_one,
                     "one_process_s": t_proc, "same_tokens": same})
    cache = {}
    b, k = cfg["cache_batch"], new
    for length in (cfg["short"], cfg["long"]):
        prompts = _prompts(b, length, cfg["vocab"])

        def steps(n: int, prompts: list[list[int]] = prompts) -> Any:
            return gen.generate(prompts, max_new_tokens=n, eos_token_id=[], pad_token_id=0)

        steps(k)  # warm-up
        # Best of at least two rounds each: one round's noise can exceed k steps' time on a shared machine.
        (t_k, _), (t_2k, _) = _timed([lambda: steps(k), lambda: steps(2 * k)], max(cfg["repeat"], 2))
        cache[length] = max(t_2k - t_k, 0.0) / k
    return {"rows": rows, "cache_s_per_token": cache, "peak_rss_bytes": proc_status().get("VmHWM", 0),
            "rss_before_model_bytes": before}


def _resident_before_model() -> int:
    """This process's resident bytes before the model is built: the baseline (transformers imported first,
    so its libraries count in the baseline, not in what the run added)."""
    import transformers  # noqa: F401

    return proc_status().get("VmRSS", 0)


def _runs(cfg: dict[str, Any]) -> list[tuple[str, int, int, int]]:
    """The benchmark's runs that decide each rank's peak: (name, sequences, prompt tokens, positions reached)."""
    return [("largest batch", max(cfg["batches"]), cfg["prompt"], cfg["prompt"] + cfg["new"]),
            ("cache check", cfg["cache_batch"], cfg["long"], cfg["long"] + 2 * cfg["new"])]


def _estimated_stages(cfg: dict[str, Any], stages: int, batch: int, prompt: int, length: int) -> list[Any]:
    """The planner's stages for generation of ``batch`` sequences of ``length`` positions (prompt ``prompt``)."""
    from runtime import empty_weights

    with empty_weights():
        model = _model(cfg)
    plan = partition(model, (torch.zeros(1, prompt, dtype=torch.long),), stages,
                     costing=Costing(inference=Inference(batch=batch, max_len=length, dtype="fp32")))
    return list(plan.stages)


def _memory_rows(cfg: dict[str, Any], ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: VmHWM, the baseline and their difference against the planner's estimate, and their ratio."""
    p = len(ranks)
    per_run = {name: (_estimated_stages(cfg, p, b, prompt, length), (b, prompt, length))
               for name, b, prompt, length in _runs(cfg)}
    weights = sum(st.state_bytes for st in next(iter(per_run.values()))[0])  # the whole model's
    _, b, prompt, length = _runs(cfg)[0]
    (whole,) = _estimated_stages(cfg, 1, b, prompt, length)  # rank 0's one-process generator, its largest batch
    rows = []
    for r, rank in enumerate(ranks):
        run = max(per_run, key=lambda k: per_run[k][0][r].memory)
        st, (b, prompt, length) = per_run[run][0][r], per_run[run][1]
        beside = weights - st.state_bytes + (whole.memory if r == 0 else 0.0)
        estimate = st.memory + beside
        added = rank["peak_rss_bytes"] - rank["rss_before_model_bytes"]
        rows.append({
            "rank": r, "vmhwm_bytes": rank["peak_rss_bytes"], "baseline_bytes": rank["rss_before_model_bytes"],
            "added_bytes": added, "planned_for": {"run": run, "sequences": b, "prompt": prompt, "max_len": length},
            "stage": {"weights": st.state_bytes, "kv_cache": st.kv_bytes, "working": st.work_bytes,
                      "total": st.memory},
            "beside_stage_bytes": beside, "estimate_bytes": estimate,
            "added_over_estimate": added / estimate if estimate > 0 else float("inf"),
        })
    return rows


def _print_memory(rows: list[dict[str, Any]]) -> None:
    mib = 2**20
    print("peak memory per rank against the planner's estimate (MiB; estimate = stage + what the benchmark keeps "
          "beside it: the rest of the model's weights, rank 0's one-process model)")
    print(f"{'rank':>4} {'VmHWM':>8} {'baseline':>9} {'added':>8} {'stage w+kv+work':>22} {'beside':>8} "
          f"{'estimate':>9} {'added/estimate':>15}  planned for")
    for m in rows:
        st, f = m["stage"], m["planned_for"]
        parts = f"{st['weights'] / mib:.1f}+{st['kv_cache'] / mib:.1f}+{st['working'] / mib:.1f}"
        print(f"{m['rank']:>4} {m['vmhwm_bytes'] / mib:>8.0f} {m['baseline_bytes'] / mib:>9.0f} "
              f"{m['added_bytes'] / mib:>8.1f} {parts:>22} {m['beside_stage_bytes'] / mib:>8.1f} "
              f"{m['estimate_bytes'] / mib:>9.1f} {m['added_over_estimate']:>15.2f}  "
              f"{f['run']}: {f['sequences']} x {f['max_len']} (prompt {f['prompt']})")


def _print(cfg: dict[str, Any], rows: list[dict[str, Any]], cache: dict[int, float], ratio: float,
           rss: list[int]) -> None:
    p = cfg["ranks"]
    print(f"Llama {cfg['layers']} layers x hidden {cfg['hidden']}, vocab {cfg['vocab']}; {p} ranks (gloo processes, "
          f"1 thread each); prompts of {cfg['prompt']} tokens, {cfg['new']} new tokens each")
    print(f"{'seqs':>5} {'groups':>6} {'pipelined tok/s':>16} {'in pieces tok/s':>16} {f'{2 * p} groups tok/s':>16} "
          f"{'one group tok/s':>16} {'one process tok/s':>18} {'pipelined/one group':>20} "
          f"{'in pieces/one group':>20} {f'{2 * p} groups/one group':>22} {'same':>5}")
    for r in rows:
        one = r["one_group_tok_s"]
        print(f"{r['sequences']:>5} {r['groups_in_flight']:>6} {r['pipelined_tok_s']:>16.1f} "
              f"{r['pipelined_pieces_tok_s']:>16.1f} {r['pipelined_2p_groups_tok_s']:>16.1f} {one:>16.1f} "
              f"{r['one_process_tok_s']:>18.1f} {r['pipelined_tok_s'] / one:>20.2f} "
              f"{r['pipelined_pieces_tok_s'] / one:>20.2f} {r['pipelined_2p_groups_tok_s'] / one:>22.2f} "
              f"{'yes' if r['same_tokens'] else 'NO':>5}")
    print(f"target once enough sequences are in flight: pipelined/one group >= 0.7 x {p} = {0.7 * p:.1f}")
    print(f"time per new token, {cfg['cache_batch']} sequences: {cache[cfg['short']] * 1e3:.2f} ms at a "
          f"{cfg['short']}-token prefix, {cache[cfg['long']] * 1e3:.2f} ms at {cfg['long']}: {ratio:.2f}x "
          "(the cache is used: target within 1.5x)")
    print("peak RSS per rank: " + ", ".join(f"{x / 2**20:.0f} MiB" for x in rss))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="pipeline ranks p (processes)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batches", type=int_list, default=[1, 2, 4, 8, 16, 32, 64], help="sequence counts, e.g. 1,8,64")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--new", type=int, default=16, help="new tokens per sequence")
    ap.add_argument("--prefill-chunk", type=int, default=4,
                    help="prompt positions per prefill hop in the 'in pieces' column (generate(prefill_chunk=))")
    ap.add_argument("--short", type=int, default=64, help="the short prefix of the cache check")
    ap.add_argument("--long", type=int, default=512, help="the long prefix of the cache check")
    ap.add_argument("--cache-batch", type=int, default=4, help="sequences in the cache check")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per configuration (best kept)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    ap.add_argument("--quick", action="store_true", help="a tiny model and few sizes (seconds; for the test)")
    ap.add_argument("--out", default="benchmarks/results/generate.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.heads, args.vocab, args.batches = 2, 32, 4, 64, [1, 4]
        args.prompt, args.new, args.short, args.long, args.cache_batch, args.repeat = 4, 4, 8, 32, 2, 1
        args.prefill_chunk = 2
    if args.ranks < 1 or args.layers % args.ranks or args.new < 2 or min(args.batches) < 1 or args.prefill_chunk < 1:
        ap.error("need --ranks dividing --layers, --new >= 2, batch sizes >= 1 and --prefill-chunk >= 1")
    cfg = {k: getattr(args, k) for k in ("ranks", "layers", "hidden", "heads", "vocab", "batches", "prompt", "new",
                                         "prefill_chunk", "short", "long", "cache_batch", "repeat", "timeout")}
    t0 = time.time()
    load = load_before(f"the {args.ranks} pipeline processes")
    # Fresh interpreters, as torchrun starts ranks: each peak RSS is set against the estimate as a whole.
    ranks = spawn(_worker, args.ranks, cfg, timeout=args.timeout, threads=1, start_method="spawn")
    rows, cache = ranks[0]["rows"], ranks[0]["cache_s_per_token"]
    ratio = cache[args.long] / cache[args.short] if cache[args.short] > 0 else float("inf")
    rss = [r["peak_rss_bytes"] for r in ranks]
    _print(cfg, rows, cache, ratio, rss)
    memory = _memory_rows(cfg, ranks)
    _print_memory(memory)
    write_result(args.out, {
        "benchmark": "generate",
        "command": " ".join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
        "config": {**cfg, "threads_per_process": 1, "backend": "gloo", "model": "LlamaForCausalLM (random)"},
        "env": run_env(load, t0),
        "results": rows,
        "cache": {"sequences": args.cache_batch, "s_per_token": {str(k): v for k, v in cache.items()},
                  "long_over_short": ratio},
        "peak_rss_bytes_per_rank": rss,
        "memory_per_rank": memory,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
