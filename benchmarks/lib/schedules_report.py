"""The schedule benchmark's tables (rich) and Chrome traces; ``schedules.py`` measures, this prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from partitioner.schedule.timeline import Timeline, save_chrome_trace


def _ms(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x * 1e3:.{digits}f}"


def print_report(console: Any, cfg: dict[str, Any], rows: list[dict[str, Any]], zb: list[dict[str, Any]],
           real: dict[str, Any] | None) -> None:
    from rich.table import Table

    c = cfg["cost_ms"]
    for transport in cfg["transports"]:
        mine = [r for r in rows if r["transport"] == transport]
        if not mine:
            continue
        how = "in-process, one thread per rank" if transport == "local" else f"{cfg['p']} gloo processes"
        t = Table(title=f"fixed costs, p = {cfg['p']}, F = B_in = W = {c:g} ms per rank ({c / 2:g} ms per chunk "
                        f"when v = 2), {how}; median of {cfg['steps']} steps", title_justify="left")
        for col in ("schedule", "m", "sim ms", "meas ms", "meas/sim", "sim(meas acts) ms", "bubble sim",
                    "bubble meas", "idle/rank sim ms", "idle/rank meas ms", "peak held meas", "peak held sched"):
            t.add_column(col, justify="left" if col == "schedule" else "right")
        for r in mine:
            me = r["measured"]
            t.add_row(
                r["schedule"] + (f" (v={r['v']})" if r["v"] > 1 else ""), str(r["m"]), _ms(r["simulated_step_s"]),
                _ms(me and me["step_s"]), "n/a" if me is None else f"{me['ratio_to_simulated']:.3f}",
                _ms(me and me["sim_measured_actions_step_s"]), f"{r['simulated_bubble']:.3f}",
                "n/a" if me is None else f"{me['bubble']:.3f}", _ms(r["simulated_idle_per_rank_s"]),
                _ms(me and me["idle_per_rank_s"]), "n/a" if me is None else str(tuple(me["peak_per_rank"])),
                str(tuple(r["schedule_peak_per_rank"])),
            )
        console.print(t)
    if zb:
        t = Table(title="zero-bubble vs 1F1B at the same m (target: idle time per rank <= 1/3 of 1F1B's, "
                        "peak memory <= 1F1B's, in whole-stage units)", title_justify="left")
        for col in ("schedule", "transport", "m", "idle ratio theory", "idle ratio meas", "bubble ratio theory",
                    "bubble ratio meas", "peak mem (zb / 1f1b)", "target met"):
            t.add_column(col, justify="left" if col in ("schedule", "transport") else "right")
        for z in zb:
            me = z["measured"]
            t.add_row(
                z["schedule"], z["transport"], str(z["m"]), f"{z['idle_ratio_theory']:.3f}",
                "n/a" if me is None else f"{me['idle_ratio']:.3f}", f"{z['bubble_ratio_theory']:.3f}",
                "n/a" if me is None else f"{me['bubble_ratio']:.3f}",
                "n/a" if me is None else "{:g} / {:g}".format(*me["memory"]),
                "n/a" if me is None else ("yes" if me["target_met"] else "no"),
            )
        console.print(t)
    if real is not None:
        g = real["config"]
        t = Table(title=f"GPT-2 (n_layer={g['n_layer']}, n_embd={g['n_embd']}, seq {g['seq']}), batch {g['batch']} "
                        f"= {g['m']} micro-batches, 2 stages cut at {real['cut']}, 2 gloo processes x 1 thread; "
                        f"median of {g['steps']} rounds, schedules interleaved; "
                        f"load average {real['load_avg_before'][0]:.1f} before, {real['load_avg_after'][0]:.1f} after",
                  title_justify="left")
        for col in ("schedule", "predicted (profile) ms", "predicted (roofline) ms", "measured ms",
                    "meas/profile", "meas/roofline", "sim(meas acts) ms", "note"):
            t.add_column(col, justify="left" if col in ("schedule", "note") else "right")
        for r in real["results"]:
            ok = r["measured_s"] is not None
            t.add_row(r["schedule"], _ms(r["predicted_profile_s"]), _ms(r["predicted_roofline_s"]),
                      _ms(r["measured_s"]), f"{r['ratio_to_profile']:.2f}" if ok else "n/a",
                      f"{r['ratio_to_roofline']:.2f}" if ok else "n/a", _ms(r.get("sim_measured_actions_s")),
                      "" if ok else f"failed: {r['error']}")
        console.print(t)
        t = Table(title="GPT-2 per-stage costs per micro-batch, ms: the plans' estimates and the measured actions "
                        "(mean, receive waits removed)", title_justify="left")
        for col in ("stage", "profile F / B (W part)", "roofline F / B (W part)",
                    *(f"measured {r['schedule']}" for r in real["results"])):
            t.add_column(col, justify="right")
        for s in range(2):
            cells = []
            for how in ("profile", "roofline"):
                c = real["stage_costs"][how][s]
                cells.append(f"{_ms(c['fwd_s'], 2)} / {_ms(c['bwd_s'], 2)} ({_ms(c['wgrad_s'], 2)})")
            for r in real["results"]:
                acts = (r.get("measured_mean_action_s") or {}).get(str(s), {})
                cells.append(" ".join(f"{k} {_ms(v, 2)}" for k, v in acts.items()) or "n/a")
            t.add_row(str(s), *cells)
        console.print(t)


def save_traces(folder: Path, m: int, timelines: dict[tuple[str, int, str], dict[str, Timeline]]) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for (schedule, mm, transport), tls in sorted(timelines.items()):
        if mm != m or transport != "local":
            continue
        for what, tl in tls.items():
            path = folder / f"{schedule}_m{m}_{what}.json"
            save_chrome_trace(tl, path, name=f"pipecut {schedule} m={m} ({what})")
            written.append(path.as_posix())
    return written
