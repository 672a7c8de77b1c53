"""Check a training batch against the plan before a step starts, so no stage fails on it.

Legend: ``m`` micro-batches, ``mb`` a micro-batch.

What is checked, in order, each failure an :class:`~partitioner.errors.InputError` naming the
input, what the plan expects, what came and the fix:

* the number of inputs, and that each is a tensor where the model took one;
* each tensor's dtype against the traced one (a float64 batch to a float32 model);
* each tensor's sizes: an export-traced graph fixes every dimension it did not make dynamic
  (``runtime.execute.shapes.check_fixed_dims``), and holds for the dynamic ones only where the
  guards torch.export recorded hold (:func:`check_guards`); a graph from torch.fx fixes none
  itself (every size the model reads is an op on its input; fx cannot trace Python code that
  branches on a size, which goes to torch.export), so a micro-batch of new sizes is run once on
  fake tensors
  (``runtime.execute.shapes.wire_shapes``, no memory, no FLOPs), and an op that rejects the sizes is
  reported as the input's error;
* the targets' rows against the inputs' rows, when the model's output is batch-major (its first
  dimension was the batch in the trace).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from partitioner.errors import InputError, InputShapeError, PlanMismatchError
from partitioner.tracing.failures import first_line
from partitioner.tracing.trace import TracedModel
from runtime.execute.shapes import check_fixed_dims, wire_shapes

__all__ = [
    "as_flat", "check_inputs", "check_sizes", "check_guards", "check_targets", "is_example_size", "shape_key",
]


def as_flat(names: Sequence[str], inputs: Any) -> list[Any]:
    """The model's inputs as a list in the plan's input order, however the batch was given.

    Args:
        names: the plan's input names (``plan.input_names``): the positional inputs, then the
            keyword inputs in the order ``partition(example_kwargs=...)`` got them.
        inputs: one tensor; a tuple or list, one entry per input in that order; or a mapping by
            input name (``{'input_ids': ids, 'attention_mask': mask}``, a tokenizer's batch),
            which must hold exactly the plan's inputs.

    Raises:
        InputError: a mapping lacks an input the plan reads or holds one it does not.

    Example:
        >>> as_flat(["input_ids", "attention_mask"], {"attention_mask": 1, "input_ids": 0})
        [0, 1]
    """
    if isinstance(inputs, Mapping):
        missing = [n for n in names if n not in inputs]
        extra = [k for k in inputs if k not in names]
        if missing or extra:
            raise InputError(
                f"the plan's inputs are {list(names)}, but the batch has keys {list(inputs)} (missing "
                f"{missing}, not an input of the plan {extra}); give exactly the inputs the plan was "
                "traced with (partition(model, args, example_kwargs={...}) names them), or re-plan "
                "with example_kwargs holding the new ones"
            )
        return [inputs[n] for n in names]
    return list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]


def check_inputs(traced: TracedModel, flat: Sequence[Any]) -> None:
    """Check the whole batch ``flat`` (one entry per model input): count, types and dtypes.

    Args:
        traced: the plan's traced model (``plan.traced``).
        flat: the inputs as given to the trainer.

    Raises:
        InputError: the number of inputs differs, an input is not a tensor where the model
            took one, or its dtype differs from the traced one.

    Example:
        >>> from torch import nn
        >>> from partitioner import trace
        >>> t = trace(nn.Linear(16, 4), (torch.randn(2, 16),))
        >>> check_inputs(t, [torch.randn(8, 16, dtype=torch.float64)])
        Traceback (most recent call last):
        ...
        partitioner.errors.InputError: input 'input_1' is float64 but the plan was traced with float32 ...
    """
    metas = traced.example_inputs
    names = [meta.name for meta in metas]
    if len(flat) != len(metas):
        how = (f"pass it as trainer.step({names[0]}, targets) (a tuple or list is read as one entry per input)"
               if len(names) == 1 else
               f"pass them as trainer.step(({', '.join(names)}), targets) in the plan's input order, or "
               f"as a dict by name, trainer.step({{{', '.join(repr(n) + ': ...' for n in names)}}}, targets)")
        raise InputError(f"the model takes {len(metas)} input(s) {names}, but the step got {len(flat)}; {how}")
    for meta, x in zip(metas, flat):
        want = meta.dtype.removeprefix("torch.")
        if not isinstance(x, torch.Tensor):
            raise InputError(
                f"input {meta.name!r} is a {type(x).__name__}, but the plan was traced with a tensor of "
                f"shape {meta.shape} and dtype {want} per micro-batch; pass a tensor"
            )
        got = str(x.dtype).removeprefix("torch.")
        if got != want:
            raise InputError(
                f"input {meta.name!r} is {got} but the plan was traced with {want} (every stage "
                f"computes and sends in the traced dtypes); convert it with x.to(torch.{want}), or "
                f"re-plan with {got} example inputs"
            )


def check_sizes(
    traced: TracedModel, mb_inputs: Mapping[str, Any],
    shape_cache: dict[tuple[tuple[int, ...], ...], dict[str, tuple[int, ...]]] | None = None,
) -> None:
    """Check one micro-batch's sizes against what the traced graph runs.

    Args:
        traced: the plan's traced model.
        mb_inputs: one micro-batch, by graph input name.
        shape_cache: wire shapes already found per micro-batch shape (``shape_key``); filled
            here when an fx graph is run on fake tensors of new sizes.

    Raises:
        InputShapeError: a size the graph keeps fixed (export) or whose ops reject it (fx).
    """
    metas = traced.example_inputs
    if is_example_size(traced, mb_inputs):
        return  # the sizes the graph was traced at: nothing to check on every step
    if traced.method == "export" or any(meta.dynamic is not None for meta in metas):
        check_fixed_dims(metas, mb_inputs)
        check_guards(traced, mb_inputs)
        return
    _check_fx_sizes(traced, mb_inputs, shape_cache)


def check_guards(traced: TracedModel, mb_inputs: Mapping[str, Any]) -> None:
    """Check one micro-batch's sizes against torch.export's guards on the free dimensions.

    An exported graph is valid only where the guards export recorded hold: a model whose code
    branches on the batch size, reshapes it into halves or checks it gets a guard, and at a size
    outside it the graph would compute what the model computes at the traced size, not at this one.

    Raises:
        InputShapeError: a guard fails; the message names the inputs' traced and given shapes, the
            guard, and the fix.

    Example:
        >>> from torch import nn
        >>> from partitioner import trace
        >>> class Halves(nn.Module):
        ...     def forward(self, x):
        ...         return x.view(x.shape[0] // 2, 2, -1).sum(1)
        >>> t = trace(Halves(), (torch.randn(8, 4),), method="export")
        >>> check_guards(t, {"x": torch.zeros(6, 4)})     # even: the graph holds
        >>> check_guards(t, {"x": torch.zeros(3, 4)})
        Traceback (most recent call last):
        ...
        partitioner.errors.InputShapeError: the plan's graph does not hold for micro-batches of these sizes ...
    """
    guards = traced.size_guards
    if guards is None:
        return
    failed = guards.failure(mb_inputs)
    if failed is None:
        return
    listing = "; ".join(
        f"input {m.name!r}: traced {m.shape}, got {tuple(mb_inputs[m.name].shape)}"
        for m in traced.example_inputs if isinstance(mb_inputs.get(m.name), torch.Tensor)
    )
    raise InputShapeError(
        f"the plan's graph does not hold for micro-batches of these sizes ({listing}): torch.export "
        f"found that the model's code depends on them and recorded the guard `{failed}`, which fails "
        "here (a branch, a reshape or a check on a size in the model's forward). Running it would "
        "silently compute what the model computes at the traced size. Use micro-batches whose sizes "
        "satisfy the guard (trainer microbatches=, or another batch size), or re-plan with example "
        "inputs of the size you train with (partition(model, example, ...))."
    )


def check_targets(traced: TracedModel, inputs: Sequence[Any], targets: Any) -> None:
    """Check the targets' rows against the inputs' when the model's output is batch-major.

    Raises:
        InputError: the first tensor of ``targets`` has another number of rows than the inputs.
    """
    target = _first_tensor(targets)
    x = _first_tensor(inputs)
    out = _first_tensor(_output_vals(traced))
    metas = traced.example_inputs
    if target is None or x is None or out is None or not metas or not metas[0].shape:
        return
    if not out.dim() or int(out.shape[0]) != metas[0].shape[0] or not target.dim():
        return  # the output's first dimension is not the batch: nothing to compare rows with
    if target.shape[0] != x.shape[0]:
        raise InputError(
            f"targets have {target.shape[0]} rows (shape {tuple(target.shape)}) but the inputs have "
            f"{x.shape[0]} (shape {tuple(x.shape)}); the model's output has one row per input row, "
            "so give one target row per input row"
        )


def _check_fx_sizes(
    traced: TracedModel, mb_inputs: Mapping[str, Any],
    cache: dict[tuple[tuple[int, ...], ...], dict[str, tuple[int, ...]]] | None,
) -> None:
    metas = traced.example_inputs
    key = shape_key(mb_inputs)
    changed = [
        meta for meta in metas
        if isinstance(mb_inputs.get(meta.name), torch.Tensor) and tuple(mb_inputs[meta.name].shape) != meta.shape
    ]
    if not changed or (cache is not None and key in cache):
        return  # the traced sizes, or sizes that ran before
    try:
        shapes = wire_shapes(traced.gm, mb_inputs, method=traced.method)
    except PlanMismatchError as e:
        listing = "; ".join(
            f"input {m.name!r}: traced {m.shape}, got {tuple(mb_inputs[m.name].shape)}" for m in changed
        )
        raise InputShapeError(
            f"the planned graph cannot run on these inputs ({listing}): "
            f"{type(e.__cause__).__name__}: {first_line(e.__cause__).rstrip('.')}. The model's own code "
            "rejects these sizes (a reshape or an op that needs other sizes): give inputs of sizes it "
            "takes, or re-plan with example inputs of the new sizes"
        ) from e.__cause__
    if cache is not None:
        cache[key] = shapes


def is_example_size(traced: TracedModel, mb_inputs: Mapping[str, Any]) -> bool:
    """Whether one micro-batch has exactly the traced example's sizes."""
    return shape_key(mb_inputs) == tuple(tuple(meta.shape) for meta in traced.example_inputs)


def shape_key(mb_inputs: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
    """One micro-batch's input shapes (``()`` for a non-tensor): the key of wire-shape caches."""
    return tuple(tuple(int(d) for d in x.shape) if isinstance(x, torch.Tensor) else () for x in mb_inputs.values())


def _output_vals(traced: TracedModel) -> Any:
    """The traced output values (fake tensors), as the trace recorded them."""
    out = traced.gm.graph.output_node()
    if "val" in out.meta:
        return out.meta["val"]
    args = out.args[0] if out.args else ()
    nodes = args if isinstance(args, (tuple, list)) else (args,)
    return [getattr(n, "meta", {}).get("val") for n in nodes]


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            t = _first_tensor(v)
            if t is not None:
                return t
    return None
