"""A plan's predicted step under any schedule: its stage costs run through the event simulator.

Legend: ``S`` stages (model chunks), ``p`` devices (ranks), ``v = S / p`` chunks per device,
``m`` micro-batches, ``s`` a stage index, ``r`` a rank.

The schedules and their placement come from ``partitioner.schedule.registry``; the simulator is
``partitioner.schedule.simulate``.
"""

from __future__ import annotations

from collections.abc import Sequence

from partitioner.cost.devices import Cluster
from partitioner.plan.records import Prediction, StagePlan
from partitioner.schedule.ir import Schedule
from partitioner.schedule.registry import stage_schedule, stages_per_rank
from partitioner.schedule.simulate import Link, Simulation, StageCosts, simulate
from partitioner.schedule.validation import peak_inflight

__all__ = ["stage_inflight", "predict", "prediction", "simulate_stages"]

def stage_inflight(schedule: str, num_stages: int, m: int) -> tuple[int, ...]:
    """Micro-batches whose activations each stage holds at its peak under ``schedule``.

    Example:
        >>> stage_inflight("1f1b", 4, 8)
        (4, 3, 2, 1)
    """
    return tuple(peak_inflight(stage_schedule(schedule, num_stages, m)))


def predict(
    stages: Sequence[StagePlan], cluster: Cluster, schedule: str, m: int, *, built: Schedule | None = None
) -> Prediction:
    """Simulate one step of ``stages`` under ``schedule`` with ``m`` micro-batches.

    Args:
        stages: the plan's stages; stage ``s`` runs on ``cluster.devices[s]`` and sends over
            ``cluster`` link ``s``.
        cluster: one device per stage, one link per boundary.
        schedule: a training schedule (see ``partitioner.schedule.registry.TRAINING_SCHEDULES``).
        m: micro-batches per step.
        built: ``stage_schedule(schedule, len(stages), m)`` if the caller has it: a schedule is
            built and checked once, however many times it is predicted.

    Returns:
        The step time, the bubble, and the fullest device's memory (state of its stages plus
        the activations it holds at its peak).

    Example:
        >>> from partitioner.plan.records import StagePlan
        >>> st = [StagePlan(s, "cpu", ("n",), "", 0, 0.0, 0.0, 0.0, 1e9, 1, 1.0, 2.0, 0.0, 0.0, 0.0,
        ...                 wgrad_time=1.0) for s in range(4)]
        >>> pr = predict(st, Cluster.uniform(4, "cpu", link_latency=0.0), "1f1b", 8)
        >>> pr.step_time, round(pr.bubble, 4)    # (m + p - 1)(F + B), (p - 1) / (m + p - 1)
        (33.0, 0.2727)
    """
    sched, sim = simulate_stages(stages, cluster, schedule, m, built=built)
    return prediction(stages, schedule, m, sched, sim)


def prediction(
    stages: Sequence[StagePlan], schedule: str, m: int, sched: Schedule, sim: Simulation
) -> Prediction:
    """:func:`predict`'s result from a step already simulated (``simulate_stages``'s pair)."""
    state = [0.0] * sched.num_ranks
    for s, r in enumerate(sched.stage_to_rank):
        state[r] += stages[s].state_bytes
    peaks = sim.peak_bytes or (0.0,) * sched.num_ranks
    memory = max(st + act for st, act in zip(state, peaks))
    return Prediction(sched.name or schedule, m, sim.step_time, sim.bubble_total, memory, stages_per_rank(schedule))


def simulate_stages(
    stages: Sequence[StagePlan], cluster: Cluster, schedule: str, m: int, *, built: Schedule | None = None
) -> tuple[Schedule, Simulation]:
    """The schedule and the full ``partitioner.schedule.simulate.Simulation`` (timeline included) of a step.

    Each stage's backward is split into input-gradient and weight-gradient time
    (``StagePlan.wgrad_time``); activations cross boundary ``s`` over cluster link ``s``. A stage
    that recomputes (``StagePlan.recompute``) holds its input bytes per micro-batch in flight,
    and from its ``B`` / ``I`` on also the activations it rebuilds there, whose forward adds to
    that action's time (the runtime replays the forward at ``I``). ``built``: as :func:`predict`.
    """
    sched = built or stage_schedule(schedule, len(stages), m)
    # Stage 0 reads only graph inputs, which need no gradient: its split backward has nothing to
    # send back, so all of it runs as W (the executor's I on stage 0 is empty).
    wgrad = [st.bwd_time if s == 0 else min(st.wgrad_time, st.bwd_time) for s, st in enumerate(stages)]
    costs = StageCosts(
        forward=tuple(st.fwd_time for st in stages),
        backward_input=tuple(st.bwd_time - w + st.recompute_time for st, w in zip(stages, wgrad)),
        backward_weight=tuple(wgrad),
        activation_bytes=tuple(st.held_bytes for st in stages),
        output_bytes=tuple(st.send_bytes for st in stages[:-1]),
        replay_bytes=tuple(st.act_bytes if st.recompute else 0.0 for st in stages)
        if any(st.recompute for st in stages) else None,
        action_overhead=tuple(d.action_overhead for d in cluster.devices)
        if any(d.action_overhead for d in cluster.devices) else None,
    )
    links = [Link(latency=lat, bandwidth=bw) for lat, bw in zip(cluster.link_latency, cluster.link_bandwidth)]
    return sched, simulate(sched, costs, links=links)
