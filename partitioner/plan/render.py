"""Human-readable forms of a Plan: the stage table (rich) and a Graphviz DOT picture.

Module names are the user's (``add_module`` and ``nn.ModuleDict`` take any string), so both forms
escape them: the table shows control characters as Python escapes (an ANSI sequence never reaches
the terminal) and never reads rich markup in them; DOT strings escape backslashes and quotes.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich import box
from rich.cells import cell_len
from rich.console import Console, JustifyMethod
from rich.table import Table
from rich.text import Text

from partitioner.plan.units import fmt_bytes, fmt_count, fmt_flops, fmt_time
from partitioner.schedule.registry import stages_per_rank

if TYPE_CHECKING:
    from partitioner.cost.devices import Cluster
    from partitioner.plan.layout import Layout
    from partitioner.plan.records import PlanRecord, StagePlan

__all__ = ["TEXT_WIDTH", "render_text", "render_dot", "printable", "precision_words", "memory_words", "fmt_bytes",
           "fmt_time", "fmt_flops", "fmt_count"]

TEXT_WIDTH = 160  # str(plan)'s width: every column of a typical plan, with room for the module names


def printable(s: str) -> str:
    """``s`` with every character a terminal would act on written as its Python escape.

    ESC (ANSI colours, cursor moves, window titles), the other control characters, and invisible
    format characters such as right-to-left overrides: ``'\\x1b[31mred' -> '\\\\x1b[31mred'``.

    Example:
        >>> print(printable("h.\\x1b[2Jx\\ty"))
        h.\\x1b[2Jx\\ty
    """
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in s)


def _text(s: str) -> Text:
    """A cell or line as plain text: printable, and ``[bold]`` in a name stays ``[bold]``."""
    return Text(printable(s))


def precision_words(precision: str) -> str:
    """How a plan's precision reads: ``'fp32'``, or ``'bf16 autocast over fp32 weights'``.

    Example:
        >>> precision_words("bf16"), precision_words("fp32")
        ('bf16 autocast over fp32 weights', 'fp32')
    """
    return precision if precision == "fp32" else f"{precision} autocast over fp32 weights"


def memory_words(cluster: Cluster) -> str:
    """What each device's memory is and what of it a plan fills: its capacity, the reserve kept
    free (``DeviceSpec.memory_reserve``) and what is left, per kind of device.

    Example:
        >>> from partitioner import Cluster
        >>> print(memory_words(Cluster.uniform(2, "H100-80GB")))
        memory per device: 80.0 GiB less a 6.0 GiB reserve (--memory-reserve) = 74.0 GiB usable
    """
    kinds = dict.fromkeys((d.name, d.memory, d.memory_reserve) for d in cluster.devices)
    parts = []
    for name, memory, reserve in kinds:
        who = f" ({name})" if len(kinds) > 1 else ""
        if reserve > 0:
            parts.append(f"{fmt_bytes(memory)}{who} less a {fmt_bytes(reserve)} reserve (--memory-reserve) = "
                         f"{fmt_bytes(memory - reserve)} usable")
        else:
            parts.append(f"{fmt_bytes(memory)}{who}, no reserve: the plan may fill it all")
    return "memory per device: " + "; ".join(parts)


def _title(plan: PlanRecord) -> str:
    """The table's title: stages, devices, method, micro-batches, schedule and precision."""
    names = {st.device for st in plan.stages}
    v = stages_per_rank(plan.schedule)
    ndev = plan.num_stages // v
    where = f"{ndev} x {next(iter(names))}" if len(names) == 1 else f"{ndev} devices"
    if v > 1:
        where += f" ({v} stages per device)"
    # The costs are for one micro-batch of this many rows, whatever example the plan was made from.
    size = f" of {plan.microbatch_size}" if plan.microbatch_size else ""
    return (
        f"pipecut plan: {plan.num_stages} stages on {where}, method {plan.method}, "
        f"{plan.microbatches} micro-batches{size}, schedule {plan.schedule}, "
        f"precision {precision_words(plan.precision)}"
    )


def _stage_row(plan: PlanRecord, st: StagePlan, *, worst: int, recompute_column: bool) -> list[str]:
    """One stage's cells, the bottleneck's index marked ``*``, over-capacity memory marked ``OVER``."""
    over = st.memory > st.capacity
    mem = f"{fmt_bytes(st.memory)} / {fmt_bytes(st.capacity)}" + (" OVER" if over else "")  # usable, less the reserve
    return [
        f"{st.index}{'*' if st.index == worst else ''}",
        st.device,
        st.modules,
        str(len(st.nodes)),
        fmt_count(st.params),
        fmt_flops(st.fwd_flops),
        fmt_flops(st.bwd_flops),
        mem,
        *(["yes" if st.recompute else "-"] if recompute_column else []),
        fmt_time(st.fwd_time),
        fmt_time(st.bwd_time),
        fmt_time(st.comm_in_time + st.comm_out_time),
        fmt_time(st.time),
        fmt_bytes(st.send_bytes) if st.index < plan.num_stages - 1 else "-",
    ]


# The order columns leave in when a table is wider than the terminal. Stages: FLOPs and node
# counts first (the times say the same for the device), then the time split and the transfers;
# stage, modules, memory and time always stay, they are what a plan is read for. Candidates:
# schedule, micro-batches and whether it fits stay.
_STAGE_DROP_ORDER = ("fwd FLOPs", "bwd FLOPs", "nodes", "F", "B", "comm", "sends", "params", "recompute", "device")
_CANDIDATE_DROP_ORDER = ("stages", "bubble", "step", "peak memory", "per micro-batch")
_INFERENCE_DROP_ORDER = ("comm", "sends", "params", "time", "device")
_LAYOUT_DROP_ORDER = ("recompute", "tp", "exchanged", "bubble", "exchange", "#", "memory / device")
_FOLD_MIN = 20  # the narrowest a folding column (modules, fits) gets before a column is left out


def _inference_table(plan: PlanRecord, *, width: int) -> tuple[Table, list[str]]:
    """A row per stage of a plan for generation: what it holds (weights, cache, working memory), how
    many sequences it would hold, and its decode step."""
    inf = plan.inference
    assert inf is not None  # only for plans for generation
    uniform = len({st.device for st in plan.stages}) == 1
    names = ("stage", "device", "modules", "params", "weights", "KV cache", "working",
             "memory / usable", "sequences", "decode step", "comm", "time", "sends")
    columns: list[tuple[str, JustifyMethod]] = [(c, "left" if c in ("device", "modules") else "right") for c in names]
    worst = plan.bottleneck_stage
    rows = []
    for st in plan.stages:
        over = st.memory > st.capacity
        rows.append([
            f"{st.index}{'*' if st.index == worst else ''}", st.device, st.modules,
            fmt_count(st.params), fmt_bytes(st.state_bytes), fmt_bytes(st.kv_bytes),
            fmt_bytes(st.work_bytes), f"{fmt_bytes(st.memory)} / {fmt_bytes(st.capacity)}" + (" OVER" if over else ""),
            str(st.sequences), fmt_time(st.fwd_time), fmt_time(st.comm_in_time + st.comm_out_time),
            fmt_time(st.time), fmt_bytes(st.send_bytes) if st.index < plan.num_stages - 1 else "-",
        ])
    if uniform:
        columns.pop(1)
        for row in rows:
            row.pop(1)
    names_of = {st.device for st in plan.stages}
    where = f"{plan.num_stages} x {next(iter(names_of))}" if uniform else f"{plan.num_stages} devices"
    autocast = f", matmuls in {plan.precision} (autocast)" if plan.precision != "fp32" else ""
    title = (f"pipecut plan for generation: {plan.num_stages} stages on {where}, method {plan.method}, "
             f"{inf.batch} sequences of {inf.max_len} positions (prompt {inf.prompt_len}), weights and cache "
             f"{inf.dtype}{autocast}")
    return _fitted(title, columns, rows, width=width, wraps=("modules",), drop_order=_INFERENCE_DROP_ORDER)


def _inference_lines(plan: PlanRecord) -> list[str]:
    """Under a plan for generation's table: how many sequences fit, the decode rate, what the times
    are estimated from, each device's memory."""
    inf = plan.inference
    assert inf is not None  # only for plans for generation
    tightest = min(plan.stages, key=lambda st: st.sequences)
    worst = plan.bottleneck_stage
    verdict = ("" if inf.fits >= inf.batch
               else f"; the {inf.batch} asked for do NOT fit: plan for {inf.fits} or fewer")
    group = -(-inf.batch // inf.groups)
    lines = [
        f"fits {inf.fits} sequences of {inf.max_len} tokens (stage {tightest.index} holds the fewest){verdict}",
        f"decode: {fmt_time(plan.bottleneck)} per step of {group} sequence{'s' if group > 1 else ''} on the slowest "
        f"stage ({worst}, marked *), {inf.groups} group{'s' if inf.groups > 1 else ''} in flight: about "
        f"{fmt_count(inf.tokens_per_s)} tokens/s"
        + (f"   lower bound: {fmt_time(plan.lower_bound)}" if plan.lower_bound > 0 else ""),
        (f"times {plan.cluster.estimate_basis}; memory: weights + KV cache + working (docs/generate.md, "
         "\"What the planner counts\")"),
        memory_words(plan.cluster),
    ]
    if plan.shared_params:
        shared = ", ".join(f"{name} (stages {', '.join(map(str, ss))})" for name, ss in plan.shared_params)
        lines.append(f"shared parameters, a copy on each holder: {shared}")
    return lines


def _stage_table(plan: PlanRecord, *, width: int) -> tuple[Table, list[str]]:
    """A row per stage; no device column when all stages share one device type.

    Returns the table and the columns left out to fit ``width``.
    """
    if plan.inference is not None:
        return _inference_table(plan, width=width)
    uniform = len({st.device for st in plan.stages}) == 1
    columns: list[tuple[str, JustifyMethod]] = [
        ("stage", "right"), ("device", "left"), ("modules", "left"), ("nodes", "right"),
        ("params", "right"), ("fwd FLOPs", "right"), ("bwd FLOPs", "right"),
        ("memory / usable", "right"), ("F", "right"), ("B", "right"), ("comm", "right"),
        ("time", "right"), ("sends", "right"),
    ]
    recomputing = any(st.recompute for st in plan.stages)
    if recomputing:  # a column only when some stage recomputes: the plain table stays as it was
        columns.insert(columns.index(("F", "right")), ("recompute", "left"))
    if uniform:
        columns.pop(1)
    worst = plan.bottleneck_stage
    rows = []
    for st in plan.stages:
        row = _stage_row(plan, st, worst=worst, recompute_column=recomputing)
        if uniform:
            row.pop(1)
        rows.append(row)
    return _fitted(_title(plan), columns, rows, width=width, wraps=("modules",), drop_order=_STAGE_DROP_ORDER)


def _fitted(
    title: str, columns: list[tuple[str, JustifyMethod]], rows: list[list[str]], *, width: int,
    wraps: tuple[str, ...], drop_order: tuple[str, ...],
) -> tuple[Table, list[str]]:
    """A table of ``rows`` no wider than ``width``: the ``wraps`` columns fold their text, and while
    the table cannot fit even so, the next column of ``drop_order`` is left out.

    The test is rich's own measure of the table's narrowest form (folding columns at their
    minimum, the others at their longest cell, plus padding and edges), taken on an unbounded
    console: on a ``width`` one rich caps each column at the width it would squeeze it to.
    """
    measure = Console(width=1 << 16, no_color=True).measure
    names = [name for name, _ in columns]
    dropped: list[str] = []
    while True:
        keep = [i for i, name in enumerate(names) if name not in dropped]
        table = Table(title=_text(title), box=box.SIMPLE_HEAD, title_justify="left")
        for i in keep:
            name, justify = columns[i]
            # Rich measures a cell by its longest word; a cell that must not wrap needs its whole
            # width as the column's minimum, or the table "fits" by cutting it to "12…".
            whole = max(cell_len(printable(cell)) for cell in [name, *(row[i] for row in rows)])
            fold = name in wraps
            table.add_column(name, justify=justify, no_wrap=not fold,
                             min_width=min(whole, _FOLD_MIN) if fold else whole)
        for row in rows:
            table.add_row(*(_text(row[i]) for i in keep))
        left = [name for name in drop_order if name in names and name not in dropped]
        if measure(table).minimum <= width or not left:
            return table, dropped
        dropped.append(left[0])


def _summary_lines(plan: PlanRecord) -> list[str]:
    """The lines under the table: bottleneck vs lower bound, predicted steps and what they are estimated
    from, each device's memory and reserve, recomputation, sharing."""
    if plan.inference is not None:
        return _inference_lines(plan)
    worst = plan.bottleneck_stage
    lines = [
        f"bottleneck: {fmt_time(plan.bottleneck)} (stage {worst}, marked *)   "
        f"lower bound: {fmt_time(plan.lower_bound)}   "
        f"bottleneck / lower bound: {plan.bottleneck / plan.lower_bound:.3f}"
        if plan.lower_bound > 0
        else f"bottleneck: {fmt_time(plan.bottleneck)} (stage {worst})",
        f"predicted step of {plan.microbatches} micro-batches (event simulator): "
        + "   ".join(
            f"{pr.schedule} {fmt_time(pr.step_time)} (bubble {pr.bubble:.1%})" for pr in plan.predictions
        ),
    ]
    lines += [f"times {plan.cluster.estimate_basis}", memory_words(plan.cluster)]
    recomputing = [st.index for st in plan.stages if st.recompute]
    if recomputing:
        lines.append(
            f"activation recomputation on {len(recomputing)} of {plan.num_stages} stages ({_ranges(recomputing)}): "
            "they keep only their inputs per micro-batch in flight, and B runs their forward again (time includes it)"
        )
    if plan.shared_params:
        shared = ", ".join(f"{name} (stages {', '.join(map(str, ss))})" for name, ss in plan.shared_params)
        lines.append(f"shared parameters, gradients summed across holders: {shared}")
    return lines


def render_text(plan: PlanRecord, width: int = TEXT_WIDTH, top: int = 5) -> str:
    """The stage table with the summary lines under it, as plain text no wider than ``width``.

    ``str(plan)`` uses the default, wide enough for every column of a typical plan; the command line
    passes the terminal's width. Narrower, the modules column folds, then the least read columns
    are left out (FLOPs first; stage, modules, memory and time always stay) and a line says which.
    The summary lines wrap at ``width``. A plan from the layout search (``plan.layout``) starts with
    its layout and a table of the ``top`` fastest layouts that fit, with what each loses on.

    Example:
        >>> import torch
        >>> from partitioner import partition
        >>> plan = partition(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
        ...                  (torch.randn(2, 8),), 2)
        >>> max(len(line) for line in render_text(plan, width=80).splitlines()) <= 80
        True
    """
    buf = io.StringIO()
    console = Console(file=buf, width=width, no_color=True, highlight=False, soft_wrap=False)
    if plan.layout is not None:
        for line in _layout_lines(plan, plan.layout, min((st.capacity for st in plan.stages), default=0.0)):
            console.print(_text(line))
        table, dropped = _layouts_table(plan, width=width, top=top)
        console.print(table)
        if dropped:
            console.print(_text(f"(left out at {width} columns: {', '.join(dropped)})"))
        console.print(_text(_layout_counts(plan)))
        console.print(_text(f"chose {plan.choice}"))
        console.print()
    table, dropped = _stage_table(plan, width=width)
    console.print(table)
    if dropped:
        console.print(_text(f"(left out at {width} columns: {', '.join(dropped)}; a wider terminal shows them)"))
    for line in _summary_lines(plan):
        console.print(_text(line))
    if plan.candidates:
        table, dropped = _candidates_table(plan, width=width)
        console.print(table)
        if dropped:
            console.print(_text(f"(left out at {width} columns: {', '.join(dropped)})"))
        console.print(_text(f"chose {plan.choice}"))
    # rich pads each line to the width; the padding only makes copied text ragged.
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip().splitlines()) + "\n"


# How each sharding over the replicas reads in a layout's line (``partitioner.plan.sharding``).
_SHARDING = {
    "none": "",
    "zero1": ", optimizer state sharded over the replicas (ZeRO-1)",
    "fsdp": ", parameters, gradients and optimizer state sharded over the replicas (FSDP)",
}


def _layout_lines(plan: PlanRecord, lay: Layout, stage_capacity: float) -> list[str]:
    """The chosen layout in two lines: how the devices are spent (and at what precision), and what
    one step costs, estimated from what (``Cluster.estimate_basis``); then each device's memory
    and reserve; a fourth under FSDP when the stages were cut for less than a device holds
    (``stage_capacity``, the least any stage had): what each device keeps for the gathered weights."""
    rate = f"{fmt_count(lay.tokens_per_s)} tokens/s" if lay.tokens_per_row else f"{fmt_count(lay.samples_per_s)} rows/s"
    zero = _SHARDING.get(lay.zero, f", sharding {lay.zero!r}")
    tp = f" x {lay.tp}-way tensor parallel (inside a node)" if lay.tp > 1 else ""
    head = (
        f"pipecut layout: {lay.devices} devices = {lay.dp} replica(s) x {lay.pp}-rank pipeline ({lay.stages} stages, "
        f"{lay.schedule}){tp}; global batch {lay.global_batch} = {lay.dp} x {lay.microbatches} micro-batches of "
        f"{lay.microbatch_size}{zero}; precision {precision_words(plan.precision)}"
    )
    cost = (
        f"{plan.cluster.estimate_basis}: step {fmt_time(lay.step_time)} = pipeline {fmt_time(lay.pipeline_time)} "
        f"(bubble {lay.bubble:.1%}"
        f"{f', FSDP gathers {fmt_time(lay.gather_time)} per rank' if lay.gather_time else ''}"
        f"{f', tp all-reduces {fmt_time(lay.allreduce_time)} per rank' if lay.allreduce_time else ''}) "
        f"+ exchange not hidden {fmt_time(lay.exchange_time)} + optimizer {fmt_time(lay.optimizer_time)}; {rate}; "
        f"peak memory {fmt_bytes(lay.memory)} of {fmt_bytes(lay.capacity)} usable per device"
    )
    lines = [head, cost, memory_words(plan.cluster)]
    kept = lay.capacity - stage_capacity if lay.zero == "fsdp" else 0.0
    if kept > 0:
        lines.append(f"FSDP keeps {fmt_bytes(kept)} of each device for gathered weights (two of the largest block and "
                     "the parameters outside blocks): the stages' capacity below is what is left")
    return lines


def _layouts_table(plan: PlanRecord, *, width: int, top: int) -> tuple[Table, list[str]]:
    tokens = bool(plan.layout and plan.layout.tokens_per_row)
    names = ("#", "layout", "tp", "step", "tokens/s" if tokens else "rows/s", "memory / device", "bubble",
             "exchange", "exchanged", "recompute", "vs chosen")
    columns: list[tuple[str, JustifyMethod]] = [(c, "left" if c in ("layout", "vs chosen") else "right") for c in names]
    rows = []
    for i, lay in enumerate([r for r in plan.layouts if r.fits][:top], 1):
        rows.append([
            str(i), lay.label(), str(lay.tp), fmt_time(lay.step_time),
            fmt_count(lay.tokens_per_s if tokens else lay.samples_per_s),
            f"{fmt_bytes(lay.memory)} / {fmt_bytes(lay.capacity)}", f"{lay.bubble:.1%}", fmt_time(lay.exchange_time),
            fmt_bytes(lay.exchange_bytes), f"{lay.recompute}/{lay.stages}" if lay.recompute else "-", lay.note,
        ])
    return _fitted(f"layouts ranked by predicted step time (the {len(rows)} fastest that fit)", columns, rows,
                   width=width, wraps=("vs chosen",), drop_order=_LAYOUT_DROP_ORDER)


def _layout_counts(plan: PlanRecord) -> str:
    """How many layouts were searched, priced, pruned, and why the ones that lost without a price did."""
    rows = plan.layouts
    fit = sum(r.fits for r in rows)
    priced = sum(r.priced for r in rows)
    state = [r for r in rows if not r.priced and r.note.startswith("training state")]
    bound = sum(1 for r in rows if not r.priced and r.note.startswith("not priced"))
    other = [r for r in rows if (r.priced and not r.fits) or (not r.priced and r not in state and
                                                              not r.note.startswith("not priced"))]
    text = f"{len(rows)} layouts searched: {priced} priced, {fit} fit"
    if bound:
        text += f"; {bound} not priced (their lower bound cannot beat the ranked ones)"
    if state:
        most = max(state, key=lambda r: r.pp)
        text += f"; {len(state)} cannot hold the training state (up to {most.label()}: {most.note})"
    if other:
        text += f"; {len(other)} do not fit memory once cut"
    return text


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5] -> '0-2, 5'``."""
    out: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if v is not None:
            start = prev = v
    return ", ".join(out)


def _candidates_table(plan: PlanRecord, *, width: int) -> tuple[Table, list[str]]:
    columns: list[tuple[str, JustifyMethod]] = [
        (col, "left" if col in ("schedule", "fits") else "right")
        for col in ("schedule", "m", "stages", "step", "per micro-batch", "bubble", "peak memory", "fits")
    ]
    rows = []
    for c in sorted(plan.candidates, key=lambda c: (not c.fits, c.time_per_microbatch, c.microbatches)):
        won = c.schedule == plan.schedule and c.microbatches == plan.microbatches
        rows.append([
            f"{c.schedule}{' <- chosen' if won else ''}", str(c.microbatches), str(c.stages),
            fmt_time(c.step_time) if c.fits or c.step_time else "-",
            fmt_time(c.time_per_microbatch) if c.time_per_microbatch else "-",
            f"{c.bubble:.1%}" if c.step_time else "-",
            f"{fmt_bytes(c.memory)} / {fmt_bytes(c.capacity)}" if c.memory else "-",
            ("yes" + (f" ({c.note})" if c.note else "")) if c.fits else f"no: {c.note}",
        ])
    return _fitted("schedule choice (every candidate cut and simulated)", columns, rows, width=width,
                   wraps=("fits",), drop_order=_CANDIDATE_DROP_ORDER)


def render_dot(plan: PlanRecord) -> str:
    """A DOT digraph: one cluster per stage (its nodes listed when few), edges with bytes."""
    out = ["digraph pipecut_plan {", "  rankdir=LR;", '  node [shape=box, fontname="Helvetica"];']
    for st in plan.stages:
        label = _dot_lines(
            f"stage {st.index} ({st.device})", st.modules, f"{len(st.nodes)} nodes, {fmt_count(st.params)} params",
            f"time {fmt_time(st.time)}, mem {fmt_bytes(st.memory)}",
        )
        out.append(f'  s{st.index} [label="{label}"];')
    for io_ in plan.io:
        for v in io_.outputs:
            for c in v.consumers:
                if c != io_.stage:
                    out.append(f'  s{io_.stage} -> s{c} [label="{_dot_lines(v.name, fmt_bytes(v.nbytes))}"];')
    out.append("}")
    return "\n".join(out) + "\n"


def _dot_lines(*lines: str) -> str:
    """The body of a DOT double-quoted label, one line each: a backslash or quote in a name is
    escaped (``a\\b`` would read as an escape), control characters written as Python escapes."""
    return "\\n".join(printable(s).replace("\\", "\\\\").replace('"', '\\"') for s in lines)
