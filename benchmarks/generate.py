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
* ``one group``: the same ranks with ``groups=1``, the device-map strategy (accelerate's
  ``device_map='auto'``): one rank works at a time;
* ``one process``: the whole model in rank 0, one thread, ``transport='sequential'`` (the other
  ranks wait in a barrier).

Tokens/s is the batch's new tokens over the wall time of ``generate`` (prefill included), the
best of ``--repeat`` runs after one untimed warm-up. The three produce the same tokens (checked).

The cache check: on the pipelined ranks and a fixed batch, the time per new token at a
``--long``-token prefix against a ``--short`` one, each from two runs (``k`` and ``2k`` new
tokens; their difference over ``k`` leaves the prefill out). With a key/value cache a step
costs about the same whatever the prefix (attention over K positions is a small part of a
step at these sizes); without one it would grow with the prefix.

Each rank's peak resident memory (VmHWM) is reported too. The planner does not price inference
yet (issue 34), so there is no estimate to set it against.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _common import int_list, load_before, proc_status, run_env, write_result
from partitioner import partition
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


def _timed(fn: Any, repeat: int) -> tuple[float, Any]:
    """Best wall time of ``repeat`` calls of ``fn`` (all ranks start together), and its last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        dist.barrier()
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    example = (torch.zeros(1, 8, dtype=torch.long),)
    gen = Generator(partition(_model(cfg), example, world), transport="dist", timeout=cfg["timeout"])
    whole = Generator(partition(_model(cfg), example, 1), transport="sequential") if rank == 0 else None
    new = cfg["new"]
    rows: list[dict[str, Any]] = []
    for b in cfg["batches"]:
        prompts = _prompts(b, cfg["prompt"], cfg["vocab"])

        def run(groups: int | None, prompts: list[list[int]] = prompts) -> Any:
            return gen.generate(prompts, max_new_tokens=new, eos_token_id=[], pad_token_id=0, groups=groups)

        run(None)  # warm-up
        t_pipe, piped = _timed(lambda: run(None), cfg["repeat"])
        t_one, one = _timed(lambda: run(1), cfg["repeat"])
        dist.barrier()
        t_proc, same = float("nan"), True
        if whole is not None:
            whole.generate(prompts, max_new_tokens=new, eos_token_id=[], pad_token_id=0)
            t_proc = float("inf")
            for _ in range(cfg["repeat"]):
                t = time.perf_counter()
                alone = whole.generate(prompts, max_new_tokens=new, eos_token_id=[], pad_token_id=0)
                t_proc = min(t_proc, time.perf_counter() - t)
            same = torch.equal(alone.sequences, piped.sequences) and torch.equal(one.sequences, piped.sequences)
        dist.barrier()
        tokens = b * new
        rows.append({"sequences": b, "groups_in_flight": min(b, world), "new_tokens": tokens,
                     "pipelined_tok_s": tokens / t_pipe, "one_group_tok_s": tokens / t_one,
                     "one_process_tok_s": tokens / t_proc, "pipelined_s": t_pipe, "one_group_s": t_one,
                     "one_process_s": t_proc, "same_tokens": same})
    cache = {}
    b, k = cfg["cache_batch"], new
    for length in (cfg["short"], cfg["long"]):
        prompts = _prompts(b, length, cfg["vocab"])

        def steps(n: int, prompts: list[list[int]] = prompts) -> Any:
            return gen.generate(prompts, max_new_tokens=n, eos_token_id=[], pad_token_id=0)

        steps(k)  # warm-up
        t_k, _ = _timed(lambda: steps(k), cfg["repeat"])
        t_2k, _ = _timed(lambda: steps(2 * k), cfg["repeat"])
        cache[length] = max(t_2k - t_k, 0.0) / k
    return {"rows": rows, "cache_s_per_token": cache, "peak_rss_bytes": proc_status().get("VmHWM", 0)}


def _print(cfg: dict[str, Any], rows: list[dict[str, Any]], cache: dict[int, float], ratio: float,
           rss: list[int]) -> None:
    p = cfg["ranks"]
    print(f"Llama {cfg['layers']} layers x hidden {cfg['hidden']}, vocab {cfg['vocab']}; {p} ranks (gloo processes, "
          f"1 thread each); prompts of {cfg['prompt']} tokens, {cfg['new']} new tokens each")
    print(f"{'seqs':>5} {'groups':>6} {'pipelined tok/s':>16} {'one group tok/s':>16} {'one process tok/s':>18} "
          f"{'pipelined/one group':>20} {'same':>5}")
    for r in rows:
        print(f"{r['sequences']:>5} {r['groups_in_flight']:>6} {r['pipelined_tok_s']:>16.1f} "
              f"{r['one_group_tok_s']:>16.1f} {r['one_process_tok_s']:>18.1f} "
              f"{r['pipelined_tok_s'] / r['one_group_tok_s']:>20.2f} "
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
    if args.ranks < 1 or args.layers % args.ranks or args.new < 2 or min(args.batches) < 1:
        ap.error("need --ranks dividing --layers, --new >= 2 and batch sizes >= 1")
    cfg = {k: getattr(args, k) for k in ("ranks", "layers", "hidden", "heads", "vocab", "batches", "prompt", "new",
                                         "short", "long", "cache_batch", "repeat", "timeout")}
    t0 = time.time()
    load = load_before(f"the {args.ranks} pipeline processes")
    ranks = spawn(_worker, args.ranks, cfg, timeout=args.timeout, threads=1)
    rows, cache = ranks[0]["rows"], ranks[0]["cache_s_per_token"]
    ratio = cache[args.long] / cache[args.short] if cache[args.short] > 0 else float("inf")
    rss = [r["peak_rss_bytes"] for r in ranks]
    _print(cfg, rows, cache, ratio, rss)
    write_result(args.out, {
        "benchmark": "generate",
        "command": " ".join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
        "config": {**cfg, "threads_per_process": 1, "backend": "gloo", "model": "LlamaForCausalLM (random)"},
        "env": run_env(load, t0),
        "results": rows,
        "cache": {"sequences": args.cache_batch, "s_per_token": {str(k): v for k, v in cache.items()},
                  "long_over_short": ratio},
        "peak_rss_bytes_per_rank": rss,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
