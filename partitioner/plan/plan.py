"""The Plan: a frozen, printable, serialisable description of how a model is cut into stages.

Legend: ``p`` stages, ``s`` a stage index, ``m`` micro-batches.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partitioner.cost.devices import Cluster
from partitioner.cost.precision import check_precision
from partitioner.errors import MissingArgumentError, PlanFormatError, PlanMismatchError
from partitioner.plan.layout import Layout
from partitioner.plan.records import Candidate as Candidate
from partitioner.plan.records import InferenceSummary, PlanRecord, binding, structure_leaves, structure_text
from partitioner.plan.records import Prediction as Prediction
from partitioner.plan.records import StagePlan as StagePlan
from partitioner.plan.schema import PLAN_SCHEMA, check
from partitioner.plan.split import StagedModel, StageIO, ValueSpec, split_graph

if TYPE_CHECKING:
    import torch

    from partitioner.tracing.trace import InputMeta, TracedModel

# The records are re-exported: readers of plans import them from here, as before.
__all__ = ["FORMAT_VERSION", "Plan", "StagePlan", "Prediction", "Candidate"]

FORMAT = "pipecut-plan"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Plan(PlanRecord):
    """How a model is cut into pipeline stages, with the costs that justify it.

    ``print(plan)`` shows the stage table; ``plan.save(path)`` / ``Plan.load(path)`` round-trip
    through JSON; ``plan.build_stages()`` returns one ``nn.Module`` per stage.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from partitioner import partition, Cluster
        >>> model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU())
        >>> plan = partition(model, (torch.randn(4, 16),), num_stages=2,
        ...                  cluster=Cluster.uniform(2, "cpu"), microbatches=4)
        >>> len(plan.stages), plan.method
        (2, 'exact')
        >>> staged = plan.build_stages()
        >>> x = torch.randn(4, 16)
        >>> torch.allclose(staged(x)[0], model(x))
        True
    """

    def __str__(self) -> str:
        from partitioner.plan.render import render_text

        return render_text(self)

    # -- stages ---------------------------------------------------------------------------

    @property
    def is_bound(self) -> bool:
        """Whether the plan holds the traced graph it was made from (``build_stages`` needs it)."""
        return self._binding is not None

    @property
    def traced(self) -> TracedModel:
        """The traced graph the plan was made from or bound to.

        Raises:
            PlanMismatchError: the plan was loaded from a file and not bound yet.
        """
        if self._binding is None:
            raise PlanMismatchError(
                "this plan holds no model: it was loaded from a file. Call "
                "plan = plan.bind(model, example_inputs) first."
            )
        return self._binding.traced

    @property
    def inputs(self) -> tuple[InputMeta, ...]:
        """The sizes the plan is valid for: each input's traced micro-batch shape and dtype, and the
        dimensions proven free (``InputMeta.dynamic``: torch.export's dynamic ones, valid where
        ``traced.size_guards`` hold; ``None`` for an fx graph, whose ops read every size).

        Raises:
            PlanMismatchError: the plan was loaded from a file and not bound yet.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from partitioner import partition
            >>> plan = partition(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),), num_stages=1)
            >>> [(i.name, i.shape, i.dtype) for i in plan.inputs]
            [('input_1', (2, 4), 'torch.float32')]
        """
        return self.traced.example_inputs

    @property
    def model(self) -> torch.nn.Module:
        """The model the plan was made from or bound to (its stages hold that model's tensors).

        Raises:
            PlanMismatchError: the plan was loaded from a file and not bound yet.
        """
        self.traced  # noqa: B018 - raises the unbound plan's error
        assert self._binding is not None
        return self._binding.model

    def refresh_binding(self) -> None:
        """Re-read the bound model's tensors after some were replaced (a meta model made real),
        so that later ``build_stages()`` calls hold the new ones."""
        b = self._binding
        if b is not None:
            b.state.clear()
            b.state.update(b.model.state_dict(keep_vars=True))

    def bind(self, model: torch.nn.Module, example_inputs: Sequence[Any], **trace_kwargs: Any) -> Plan:
        """Attach a model to a loaded plan, checking it is the model the plan was made for.

        Args:
            model: the model (on any device, ``meta`` included).
            example_inputs: one micro-batch of inputs, or the whole batch of the plan's
                ``microbatches`` (told apart by the micro-batch size the plan records).
            trace_kwargs: forwarded to ``partitioner.tracing.trace.trace`` (``leaf_modules``,
                ``example_kwargs``: the keyword inputs the plan was made with, e.g. a Hugging
                Face model's ``attention_mask``).

        Raises:
            PlanMismatchError: the model's traced graph differs from the plan's.
        """
        from partitioner.tracing.trace import trace

        trace_kwargs.setdefault("example_microbatches", self._microbatches_in(example_inputs))
        traced = trace(model, tuple(example_inputs), **trace_kwargs)
        got = traced.fingerprint()
        if got != self.fingerprint:
            raise PlanMismatchError(
                f"this plan was made for a different graph (plan fingerprint {self.fingerprint[:12]}, "
                f"model fingerprint {got[:12]}): the model, its example input shapes or dtypes, or "
                "the trace options changed. Re-plan with partitioner.partition(model, ...)."
            )
        # A plan saved before the output structure was recorded learns it from the trace.
        structure = self.output_structure or structure_text(traced.out_spec)
        return replace(self, _binding=binding(traced, model), output_structure=structure)

    def _microbatches_in(self, example_inputs: Sequence[Any]) -> int:
        """1 for a micro-batch example; ``microbatches`` for a whole-batch one."""
        size, m = self.microbatch_size, self.microbatches
        rows = [int(x.shape[0]) for x in example_inputs if hasattr(x, "shape") and len(x.shape)]
        if size and m > 1 and rows and all(r == size * m for r in rows):
            return m
        return 1

    def build_stages(self) -> StagedModel:
        """One ``fx.GraphModule`` per stage, named with the original model's parameter names.

        The stages share parameters with the model the plan was made from (or bound to), so
        training the stages trains that model.

        Raises:
            PlanMismatchError: the plan was loaded from a file and not bound to a model yet.
        """
        traced = self.traced
        assert self._binding is not None
        return split_graph(
            traced.gm,
            self.stage_of(),
            self.num_stages,
            param_aliases=dict(self.param_aliases),
            persistent_buffers=self._binding.persistent,
            model_state=self._binding.state,
        )

    # -- files ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``Plan.from_dict`` reads it back."""
        body = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "trace_method": self.trace_method,
            "method": self.method,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "granularity": self.granularity,
            "bottleneck": self.bottleneck,
            "lower_bound": self.lower_bound,
            "state_bytes_per_param": self.state_bytes_per_param,
            "input_names": list(self.input_names),
            "cluster": self.cluster.to_dict(),
            "stages": [_finite(asdict(st)) for st in self.stages],
            "predictions": [asdict(pr) for pr in self.predictions],
            "io": [
                {"stage": io.stage, "inputs": [asdict(v) for v in io.inputs],
                 "outputs": [asdict(v) for v in io.outputs]}
                for io in self.io
            ],
            "shared_params": {k: list(v) for k, v in self.shared_params},
            "param_aliases": {k: list(v) for k, v in self.param_aliases},
            "candidates": [_finite(asdict(c)) for c in self.candidates],
            "choice": self.choice,
        }
        if self.precision != "fp32":  # plans saved before mixed precision (fp32) keep their bytes
            body["precision"] = self.precision
        if self.output_structure:  # a model returning one tensor records none, as before
            body["output_structure"] = self.output_structure
        if self.layout is not None:  # a plan from the layout search: its layout and the ranking
            body["layout"] = _finite(asdict(self.layout))
            body["layouts"] = [_finite(asdict(r)) for r in self.layouts]
        if self.inference is not None:  # a plan for generation: what it is priced for and concludes
            body["inference"] = asdict(self.inference)
        body["checksum"] = _checksum(body)
        return body

    @staticmethod
    def from_dict(data: Any) -> Plan:
        """Rebuild a plan from ``to_dict`` output, validating every field.

        Raises:
            PlanFormatError: a field is missing, of the wrong type, inconsistent, or the checksum
                does not match (the file was edited after it was saved).
        """
        return _parse(data)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON (format version ``FORMAT_VERSION``, with a checksum)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(
        path: str | Path,
        model: torch.nn.Module | None = None,
        example_inputs: Sequence[Any] | None = None,
        **trace_kwargs: Any,
    ) -> Plan:
        """Read a plan saved with ``save``; with ``model`` and ``example_inputs``, bind it too.

        Raises:
            PlanFormatError: the file is not UTF-8 text, not valid JSON, not a JSON object, or
                not a valid plan.
            OSError: the file cannot be read (missing, a directory, no permission).
            PlanMismatchError: ``model`` is not the model the plan was made for.
            MissingArgumentError: ``model`` without ``example_inputs`` (a ``TypeError``).
        """
        fix = "re-create it with plan.save(...) or `pipecut plan ... --json`"
        raw = Path(path).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PlanFormatError(
                f"{path} is not a text file (byte 0x{raw[e.start]:02x} at offset {e.start} is not UTF-8), "
                f"so not a saved plan; {fix}"
            ) from e
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            where = f"line {e.lineno}, column {e.colno}"
            raise PlanFormatError(f"{path} is not valid JSON ({e.msg} at {where}); {fix}") from e
        except RecursionError as e:  # nested deeper than the parser goes: not something save() writes
            raise PlanFormatError(f"{path} nests JSON too deeply to be a saved plan; {fix}") from e
        plan = _parse(data, str(path))
        if model is not None:
            if example_inputs is None:
                raise MissingArgumentError(
                    "Plan.load(path, model, example_inputs): example_inputs is needed with model"
                )
            plan = plan.bind(model, example_inputs, **trace_kwargs)
        return plan

    def to_dot(self, path: str | Path | None = None) -> str:
        """Graphviz DOT of the stage graph (and of the nodes in each stage when bound)."""
        from partitioner.plan.render import render_dot

        text = render_dot(self)
        if path is not None:
            Path(path).write_text(text)
        return text


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    # JSON has no infinity: an unlimited capacity is written as null.
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}


def _infinite(d: dict[str, Any], keys: Collection[str] | None = None) -> dict[str, Any]:
    # The inverse of _finite: null read back as infinity (in ``keys`` only, if given).
    return {k: (math.inf if v is None and (keys is None or k in keys) else v) for k, v in d.items()}


def _checksum(body: dict[str, Any]) -> str:
    blob = json.dumps({k: v for k, v in body.items() if k != "checksum"}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _parse(data: Any, where: str = "plan") -> Plan:
    def fail(msg: str) -> PlanFormatError:
        return PlanFormatError(
            f"{where}: {msg}. The file is corrupt or was edited by hand; re-create it with "
            "plan.save(...) or `pipecut plan ... --json`."
        )

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise fail(f"not a pipecut plan (expected 'format': {FORMAT!r})")
    if data.get("version") != FORMAT_VERSION:
        raise PlanFormatError(
            f"{where}: plan format version {data.get('version')!r} is not supported by this pipecut "
            f"(it reads version {FORMAT_VERSION}); re-create the plan with this version"
        )
    if data.get("checksum") != _checksum(data):
        raise fail("checksum mismatch: the content changed after the plan was saved")
    # Every field's type and range first: what is built below may then trust them.
    check(data, PLAN_SCHEMA, where)
    try:
        cluster = Cluster.from_dict(data["cluster"])
        stages = []
        for raw in data["stages"]:
            st = _infinite(raw, ("capacity",))
            st["nodes"] = tuple(st["nodes"])
            stages.append(StagePlan(**st))
        io = tuple(
            StageIO(int(r["stage"]), tuple(_value(v) for v in r["inputs"]), tuple(_value(v) for v in r["outputs"]))
            for r in data["io"]
        )
        plan = Plan(
            stages=tuple(stages),
            method=str(data["method"]),
            schedule=str(data["schedule"]),
            microbatches=int(data["microbatches"]),
            granularity=str(data["granularity"]),
            bottleneck=float(data["bottleneck"]),
            lower_bound=float(data["lower_bound"]),
            predictions=tuple(Prediction(**pr) for pr in data["predictions"]),
            cluster=cluster,
            state_bytes_per_param=float(data["state_bytes_per_param"]),
            fingerprint=str(data["fingerprint"]),
            trace_method=str(data["trace_method"]),
            input_names=tuple(data["input_names"]),
            io=io,
            shared_params=tuple((k, tuple(v)) for k, v in data["shared_params"].items()),
            param_aliases=tuple((k, tuple(v)) for k, v in data["param_aliases"].items()),
            candidates=tuple(Candidate(**_infinite(c)) for c in data["candidates"]),
            choice=str(data["choice"]),
            precision=check_precision(str(data.get("precision", "fp32"))),
            output_structure=str(data.get("output_structure", "")),
            layout=Layout(**_infinite(data["layout"])) if data.get("layout") is not None else None,
            layouts=tuple(Layout(**_infinite(r)) for r in data.get("layouts", ())),
            inference=InferenceSummary(**data["inference"]) if data.get("inference") is not None else None,
        )
    except PlanFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise fail(f"bad or missing field ({type(e).__name__}: {e})") from e
    _check_consistent(plan, fail)
    return plan


def _value(raw: dict[str, Any]) -> ValueSpec:
    return ValueSpec(
        name=str(raw["name"]), producer=int(raw["producer"]), consumers=tuple(raw["consumers"]),
        kind=str(raw["kind"]), shape=tuple(raw["shape"]), dtype=str(raw["dtype"]),
    )


def _check_consistent(plan: Plan, fail: Any) -> None:
    p = len(plan.stages)
    if p == 0:
        raise fail("the plan has no stages")
    if [st.index for st in plan.stages] != list(range(p)):
        raise fail(f"stage indices {[st.index for st in plan.stages]} are not 0..{p - 1}")
    if len(plan.cluster) != p or len(plan.io) != p:
        raise fail(f"{p} stages but {len(plan.cluster)} devices and {len(plan.io)} stage wirings")
    seen: dict[str, int] = {}
    for st in plan.stages:
        if not st.nodes:
            raise fail(f"stage {st.index} has no nodes")
        for v in st.nodes:
            if v in seen:
                raise fail(f"node {v!r} is in stage {seen[v]} and stage {st.index}")
            seen[v] = st.index
    if plan.microbatches < 1:
        raise fail(f"microbatches must be at least 1, got {plan.microbatches}")
    if plan.output_structure:
        leaves, outputs = structure_leaves(plan.output_structure), len(plan.io[-1].outputs)
        if leaves != outputs:
            raise fail(f"the output structure holds {leaves} tensors but the last stage returns {outputs}")
