"""The records a Plan is made of: its stages, predictions and candidates, and the Plan's own fields.

Legend: ``p`` stages, ``s`` a stage index, ``m`` micro-batches.

Plain frozen data with the properties that read it; rendering (``render``) and prediction
(``predict``) read these records, and ``plan.Plan`` adds what needs the model or a file: binding,
building the stage modules, saving and loading, printing.
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from partitioner.cost.devices import Cluster
from partitioner.errors import MissingPredictionError, PlanFormatError
from partitioner.plan.layout import Layout
from partitioner.plan.split import GRAPH_INPUT, StageIO

if TYPE_CHECKING:
    import torch
    from torch.utils._pytree import TreeSpec

    from partitioner.tracing.trace import TracedModel

__all__ = [
    "StagePlan", "Prediction", "Candidate", "InferenceSummary", "PlanRecord", "binding", "structure_text",
    "structure_spec", "structure_leaves",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagePlan:
    """One stage of a plan, with its estimated costs for one micro-batch.

    Attributes:
        index: the stage index ``s``.
        device: the device's preset name.
        nodes: the fx node names the stage computes, in graph order.
        modules: a short reading of the module range (``'transformer.h.0 … transformer.h.5'``).
        params: parameter elements the stage holds (a tied parameter counts in every holder).
        fwd_flops: forward FLOPs.
        bwd_flops: backward FLOPs.
        memory: estimated peak bytes: training state of its parameters and buffers plus saved
            activations times the micro-batches in flight; with ``recompute``, input bytes times
            the micro-batches in flight plus one micro-batch's activations (rebuilt in backward).
        capacity: the device's memory in bytes.
        inflight: micro-batches whose activations the stage holds at its peak.
        fwd_time: forward compute seconds.
        bwd_time: backward compute seconds.
        comm_in_time: seconds receiving from the previous stage.
        comm_out_time: seconds sending to the next stage.
        send_bytes: bytes crossing the boundary to the next stage (0 for the last stage).
        wgrad_time: the part of ``bwd_time`` that computes weight gradients (what zero-bubble
            schedules run as ``W``).
        act_bytes: activation bytes saved for backward per micro-batch.
        state_bytes: bytes of training state of its parameters and buffers.
        in_bytes: bytes of the stage's inputs per micro-batch (what crosses its incoming cuts,
            and the graph inputs it reads): all it keeps per micro-batch when it recomputes.
        recompute: whether the stage recomputes its activations (``runtime.execute.recompute``): its
            forward keeps only its inputs, its backward runs the forward again first, so its
            backward costs ``fwd_time`` more (``recompute_time``).
        kv_bytes: in a plan for generation (``plan.inference``), the key/value cache of its layers
            for the plan's batch at its maximum length; 0 in a training plan.
        work_bytes: in a plan for generation, its working memory (the prefill's forward, the cache's
            concatenation); 0 in a training plan.
        sequences: in a plan for generation, the most sequences of the maximum length it holds.

    In a plan for generation ``state_bytes`` is the weights and buffers, ``memory`` is ``state_bytes
    + kv_bytes + work_bytes``, ``fwd_time`` one decode step of a group of sequences, and there is no
    backward (docs/generate.md, "What the planner counts").
    """

    index: int
    device: str
    nodes: tuple[str, ...]
    modules: str
    params: int
    fwd_flops: float
    bwd_flops: float
    memory: float
    capacity: float
    inflight: int
    fwd_time: float
    bwd_time: float
    comm_in_time: float
    comm_out_time: float
    send_bytes: float
    wgrad_time: float = 0.0
    act_bytes: float = 0.0
    state_bytes: float = 0.0
    in_bytes: float = 0.0
    recompute: bool = False
    kv_bytes: float = 0.0
    work_bytes: float = 0.0
    sequences: int = 0

    @property
    def recompute_time(self) -> float:
        """Seconds the backward spends running the forward again: ``fwd_time`` if it recomputes."""
        return self.fwd_time if self.recompute else 0.0

    @property
    def held_bytes(self) -> float:
        """Bytes one micro-batch in flight holds between its forward and backward."""
        return self.in_bytes if self.recompute else self.act_bytes

    @property
    def time(self) -> float:
        """Forward + backward (+ recomputation) + transfer seconds: what the partitioner balances."""
        return self.fwd_time + self.bwd_time + self.recompute_time + self.comm_in_time + self.comm_out_time


@dataclass(frozen=True)
class Prediction:
    """One schedule's predicted step, from the event simulator (``partitioner.schedule.simulate``).

    Attributes:
        schedule: the schedule's name.
        microbatches: ``m``.
        step_time: seconds for one step of ``m`` micro-batches (without the optimizer update).
        bubble: fraction of device-time idle during the step.
        memory: the fullest device's peak bytes: training state plus the activations it holds.
        chunks: stages per device (2 for interleaved and ZB-V, else 1).
    """

    schedule: str
    microbatches: int
    step_time: float
    bubble: float
    memory: float = 0.0
    chunks: int = 1


@dataclass(frozen=True)
class Candidate:
    """One (schedule, micro-batch count) tried by ``schedule='auto'`` / ``microbatches='auto'``.

    Attributes:
        schedule: the schedule's name.
        microbatches: ``m``.
        stages: stages cut (devices x chunks per device).
        step_time: simulated seconds per step.
        time_per_microbatch: ``step_time / m``, the objective.
        bubble: idle fraction of the step.
        memory: the fullest device's simulated peak bytes.
        capacity: the smallest device's memory.
        fits: whether the candidate fits every device.
        note: why it does not fit, if it does not.
    """

    schedule: str
    microbatches: int
    stages: int
    step_time: float
    time_per_microbatch: float
    bubble: float
    memory: float
    capacity: float
    fits: bool
    note: str = ""


@dataclass(frozen=True)
class InferenceSummary:
    """What a plan for generation is priced for, and what it concludes (``Costing(inference=...)``).

    Attributes:
        batch: sequences every stage caches (``Inference.batch``).
        max_len: positions each sequence reaches (``Inference.max_len``).
        prompt_len: the prefill's positions: the example's.
        dtype: what the weights and the cache are held in (``'fp32'``, ``'bf16'``, ``'fp16'``).
        groups: groups of sequences in flight the decode step is priced for (one per stage, at most
            one per sequence: the generator's default).
        fits: the most sequences of ``max_len`` positions every stage holds.
        tokens_per_s: estimated decoding rate: ``batch`` tokens every ``groups`` steps of the slowest stage.
    """

    batch: int
    max_len: int
    prompt_len: int
    dtype: str
    groups: int
    fits: int
    tokens_per_s: float


@dataclass(frozen=True)
class _Binding:
    traced: TracedModel
    persistent: set[str]
    state: dict[str, torch.Tensor]  # the model's state_dict(keep_vars=True): tensors, not copies
    model: torch.nn.Module


def binding(traced: TracedModel, model: torch.nn.Module) -> _Binding:
    """What a plan needs of the model it runs: the traced graph, the model and its state."""
    state = model.state_dict(keep_vars=True)
    return _Binding(traced, set(state), state, model)


@dataclass(frozen=True)
class PlanRecord:
    """Every field of a :class:`partitioner.plan.plan.Plan`, and what can be read off them alone."""

    stages: tuple[StagePlan, ...]
    method: str
    schedule: str
    microbatches: int
    granularity: str
    bottleneck: float
    lower_bound: float
    predictions: tuple[Prediction, ...]
    cluster: Cluster
    state_bytes_per_param: float
    fingerprint: str
    trace_method: str
    input_names: tuple[str, ...]
    io: tuple[StageIO, ...]
    shared_params: tuple[tuple[str, tuple[int, ...]], ...] = ()
    param_aliases: tuple[tuple[str, tuple[str, ...]], ...] = ()
    candidates: tuple[Candidate, ...] = ()
    choice: str = ""
    precision: str = "fp32"
    output_structure: str = ""
    layout: Layout | None = None
    layouts: tuple[Layout, ...] = ()
    inference: InferenceSummary | None = None
    _binding: _Binding | None = field(default=None, compare=False, repr=False)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def output_treespec(self) -> TreeSpec | None:
        """The model's output structure (``output_structure`` read back), or ``None`` when the
        plan records none: the model returns one tensor (or the plan predates the field).

        The last stage's flat outputs are rebuilt with it (``torch.utils._pytree.tree_unflatten``),
        so the trainer's ``loss_fn`` gets what the model returns: a Hugging Face ``ModelOutput``
        (``out.logits``, ``out.loss``), a dict, a tuple.

        Raises:
            PlanFormatError: the structure names a type this process has not registered with
                ``torch.utils._pytree`` (import the library that defines it, e.g. transformers).
        """
        return structure_spec(self.output_structure)

    @property
    def bottleneck_stage(self) -> int:
        return max(range(len(self.stages)), key=lambda s: self.stages[s].time)

    def prediction(self, schedule: str) -> Prediction:
        """The prediction for ``schedule`` (``'gpipe'`` or ``'1f1b'``).

        Raises:
            MissingPredictionError: the plan has none for ``schedule`` (a ``KeyError``).
        """
        for pr in self.predictions:
            if pr.schedule == schedule:
                return pr
        known = ", ".join(pr.schedule for pr in self.predictions)
        raise MissingPredictionError(f"no prediction for schedule {schedule!r}; the plan has: {known}")

    @property
    def microbatch_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of one micro-batch of each graph input the stages read: what the costs are for."""
        return {
            v.name: v.shape for io in self.io for v in io.inputs if v.producer == GRAPH_INPUT and v.kind == "tensor"
        }

    @property
    def microbatch_size(self) -> int | None:
        """Rows (dimension 0) of the micro-batch the plan is costed for; ``None`` if no input says.

        A plan from the layout search is costed for its layout's micro-batch size (the example it
        was traced with may have had another)."""
        if self.layout is not None:
            return self.layout.microbatch_size
        sizes = [shape[0] for shape in self.microbatch_shapes.values() if shape]
        return sizes[0] if sizes else None

    def stage_of(self) -> dict[str, int]:
        """Stage of every compute node, by node name."""
        return {v: st.index for st in self.stages for v in st.nodes}


def structure_text(spec: TreeSpec) -> str:
    """``spec`` as the plan file keeps it (``treespec_dumps``); ``''`` for a single tensor, or for a
    structure with no text form (a type registered without a serialised name: in-process the
    trainer then gets the flat tuple, as before the field existed).

    Example:
        >>> import torch
        >>> from torch.utils import _pytree as pytree
        >>> _, spec = pytree.tree_flatten({"logits": torch.zeros(1), "aux": torch.zeros(1)})
        >>> structure_spec(structure_text(spec)) == spec, structure_text(pytree.tree_flatten(torch.zeros(1))[1])
        (True, '')
    """
    from torch.utils import _pytree as pytree

    if spec.is_leaf():
        return ""
    try:
        return pytree.treespec_dumps(spec)
    except Exception as e:  # a node type with no serialised name: kept in process only
        log.warning("the model's output structure %s has no text form (%s); the plan records none, and "
                    "loss_fn gets the flat tuple of its tensors", spec, e)
        return ""


def structure_spec(text: str) -> TreeSpec | None:
    """The TreeSpec of ``structure_text``'s output (``None`` for ``''``).

    A node type not registered in this process is imported from its module when that module's
    package is already imported (``transformers.models.mamba.modeling_mamba`` registers
    ``MambaCausalLMOutput`` once transformers is in use); nothing else is imported.

    Raises:
        PlanFormatError: the text is not a TreeSpec, or names a type still unknown.
    """
    from torch.utils import _pytree as pytree

    if not text:
        return None
    try:
        return pytree.treespec_loads(text)
    except Exception as e:
        err: Exception = e
    missing = _type_names(text) - set(pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE)
    if missing and _import_modules(missing):
        try:
            return pytree.treespec_loads(text)
        except Exception as e:
            err = e
        missing = _type_names(text) - set(pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE)
    raise PlanFormatError(
        f"the plan's output structure cannot be read back ({type(err).__name__}: {err}); it names "
        f"{sorted(missing) or 'no unknown type'}: import the library that defines the model's "
        "output type first (e.g. import transformers), or re-plan with this version"
    ) from err


def structure_leaves(text: str) -> int | None:
    """How many tensors (leaves) ``structure_text``'s output holds, read from the text alone (no
    type needs importing); ``None`` when the text is not a TreeSpec's."""
    return _walk(text)[1]


def _type_names(text: str) -> set[str]:
    return _walk(text)[0]


def _walk(text: str) -> tuple[set[str], int | None]:
    """The node type names and the leaf count of a ``treespec_dumps`` text."""
    import json

    names: set[str] = set()
    leaves = 0

    def walk(node: Any) -> bool:  # False: not a TreeSpec node
        nonlocal leaves
        if not isinstance(node, dict):
            return False
        if node.get("type") is None:
            leaves += 1
            return True
        names.add(str(node["type"]))
        children = node.get("children_spec") or []
        return isinstance(children, list) and all(walk(child) for child in children)

    try:
        body = json.loads(text)
    except ValueError:
        return names, None
    ok = walk(body[1] if isinstance(body, list) and len(body) == 2 else body)
    return names, leaves if ok else None


def _import_modules(type_names: set[str]) -> bool:
    """Import the modules of ``type_names`` whose top-level package is imported already."""
    imported = False
    for name in type_names:
        module = name.rpartition(".")[0]
        if module and module.split(".")[0] in sys.modules and module not in sys.modules:
            try:
                importlib.import_module(module)
                imported = True
            except ImportError:
                continue
    return imported
