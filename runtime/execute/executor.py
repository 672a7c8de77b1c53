"""Run one rank's action list: forwards, backwards, the activation stash, and the messages between.

Legend: ``s`` a stage index, ``mb`` a micro-batch index, ``m`` micro-batches in a step.

Per action, for stage ``s`` of this rank:

* ``F`` (forward): gather inputs (graph inputs of ``mb``, or received from producer stages),
  run the stage with autograd, stash inputs and outputs, send outputs to consumer stages; on
  the last stage, compute the loss scaled by ``mb``'s share of the batch, so the gradients
  accumulated over the step equal those of the whole batch's (mean-reduced) loss.
* ``B`` (full backward): receive output gradients from every consumer stage (summing those of a
  value read by several stages), backpropagate, send input gradients to producer stages, and free
  the stash of ``mb`` at once.
* ``I`` / ``W`` (split backward, zero-bubble schedules): ``I`` computes and sends input
  gradients only, capturing the gradient at each node where a weight's branch leaves the
  input path; ``W`` then restarts autograd there for the weights only and frees the stash
  (``runtime.execute.split_backward``). Exact, and ``I + W`` costs about one fused ``B``.

On a stage that recomputes (``recompute=``, ``runtime.execute.recompute``), ``F`` runs without an
autograd graph and stashes only the inputs; ``B`` (or ``I``) first replays the forward with
autograd (the last stage's loss too), then backpropagates as above.

Which values travel in which message is fixed by the plan (``StageIO``): the message from stage
``a`` to stage ``b`` carries, in order, ``a``'s outputs that ``b`` reads; gradients travel back
for the floating-point ones only. Both ends derive the same lists, so nothing is negotiated.
They are derived once, when the executor is built; a step only looks them up.

While a torch profiler records, each action runs inside
``torch.profiler.record_function("pipecut <stage><kind><mb>")`` (e.g. ``pipecut 1F3``), so
profiler traces show the schedule; without a profiler the label is skipped.

``run`` also posts receives ahead of the actions reading them, on transports that ask for it
(``Transport.posts_receives``): a few messages ahead, in the order the actions read them, so
the order of receives per pair of ranks is unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from partitioner.plan.split import StageIO, decode_value
from runtime.errors import (
    ActionError,
    InconsistentScheduleError,
    LossError,
    MissingInputError,
    StageError,
    TrainerStateError,
    describe_value,
)
from runtime.execute.recompute import forward_again, forward_without_graph
from runtime.execute.records import ActionLike as ActionLike
from runtime.execute.records import ActionRecord as ActionRecord
from runtime.execute.records import RunResult as RunResult
from runtime.execute.records import StageRuntime as StageRuntime
from runtime.execute.records import Stash
from runtime.execute.records import StepState as StepState
from runtime.execute.split_backward import backward_input, backward_weight
from runtime.execute.wgrad_fusion import fused_params
from runtime.execute.wiring import dtype_of, message_values, model_output, on_wire, wire
from runtime.parallel.vocab import VocabLossError, plain_loss, sharded_loss, vocab_head, whole_outputs
from runtime.precision import MixedPrecision
from runtime.transport.p2p import Key, TensorMeta, Transport, TransportTimeout

__all__ = ["ActionLike", "StageRuntime", "Executor", "StepState", "RunResult", "ActionRecord", "message_values"]

log = logging.getLogger(__name__)


class Executor:
    """Runs the actions of one rank over a transport.

    Args:
        stages: this rank's stages, by stage index.
        ios: the wiring of every stage of the plan (all ranks), indexed by stage.
        transport: moves messages between stages.
        loss_fn: ``loss_fn(output, target) -> scalar``; ``output`` is what the model returns,
            rebuilt with ``out_spec`` (a Hugging Face ``ModelOutput``: ``output.logits``); without
            one, the model's single output, or the tuple of its outputs when it has several.
        rank: this rank (for records and messages).
        record: keep an ``ActionRecord`` per action.
        check_finite: raise ``LossError`` when a micro-batch's loss is NaN or infinite (one
            device sync per micro-batch on the last stage).
        precision: the mixed-precision policy (``runtime.precision``): forwards and the loss run
            under its autocast, and floating values travel in its wire dtype. Default fp32.
        loss_scale: multiplies the loss before backward (fp16 loss scaling); the losses
            reported stay unscaled.
        wire_dtypes: the dtype of each boundary value on the wire, by name, where it is not
            the plan's (``runtime.precision.wire_dtypes``); sent tensors are cast to it.
        recompute: the stages of this rank whose forward keeps only its inputs and whose
            backward recomputes it first (``runtime.execute.recompute``).
        out_spec: the model's output structure (``Plan.output_treespec()``), or ``None``.

    Raises (from ``run`` / ``execute``):
        StageError: an action raised; names the rank, stage, action, micro-batch and, for a
            forward, the model node; the original exception is its ``__cause__``.
        LossError: ``loss_fn`` did not return a scalar tensor that requires grad, or (with
            ``check_finite``) the loss is not finite.
        TransportTimeout: a message did not come (``PeerFailed``: a peer failed first).

    Example: see ``runtime.trainer.PipelineTrainer``, which builds one executor per rank.
    """

    # Receives ``run`` keeps posted ahead per peer stage (each holds one message's buffers).
    _AHEAD_PER_PEER = 2

    def __init__(
        self,
        stages: Mapping[int, StageRuntime],
        ios: Sequence[StageIO],
        transport: Transport,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        *,
        rank: int = 0,
        record: bool = False,
        check_finite: bool = False,
        precision: MixedPrecision | None = None,
        loss_scale: float = 1.0,
        wire_dtypes: Mapping[str, torch.dtype] | None = None,
        recompute: Collection[int] = (),
        out_spec: Any = None,
    ) -> None:
        self.stages = dict(stages)
        self.out_spec = out_spec
        self.precision = precision or MixedPrecision()
        self.loss_scale = loss_scale
        self.recompute = frozenset(recompute)
        self.check_finite = check_finite
        self.ios = list(ios)
        self.p = len(ios)
        self.transport = transport
        self.loss_fn = loss_fn
        self.rank = rank
        self.record = record
        self._waited = 0.0  # seconds the current action spent in receives
        self._wiring = {s: wire(self.ios, s) for s in self.stages}
        # Stages returning logits split over the vocabulary (runtime.parallel.vocab): their forward,
        # loss and backward run under loss_parallel; predict gathers their logits whole.
        self._vocab = frozenset(s for s, st in self.stages.items() if vocab_head(st.module))
        on_the_wire = dict(wire_dtypes or {})
        self._metas = {
            (a, b): [TensorMeta(v.shape, on_the_wire.get(v.name) or dtype_of(v.dtype))
                     for v in message_values(self.ios, a, b)]
            for s in self.stages
            for a, b in [(q, s) for q in range(self.p)] + [(s, c) for c in range(self.p)]
        }
        self._grad_metas = {
            (s, c): [mt for mt, f in zip(self._metas[(s, c)], w.grad_mask[c]) if f]
            for s, w in self._wiring.items()
            for c in w.consumers
        }

    # -- a step ---------------------------------------------------------------------------

    def run(
        self,
        actions: Sequence[ActionLike],
        inputs: Sequence[Mapping[str, Any]],
        targets: Sequence[Any] | None = None,
        scales: Sequence[float] | None = None,
        *,
        train: bool = True,
        mb_shapes: Mapping[int, Mapping[str, tuple[int, ...]]] | None = None,
        on_stage_done: Callable[[int], None] | None = None,
    ) -> RunResult:
        """Execute ``actions`` in order.

        Args:
            actions: this rank's action list.
            inputs: per micro-batch, graph inputs by name (only those this rank's stages read
                are used).
            targets: per micro-batch, the loss target (needed where the last stage lives).
            scales: per micro-batch, the loss weight (its share of the batch); default ``1/m``.
            train: build autograd graphs and run backward actions; ``False`` for inference.
            mb_shapes: per micro-batch, wire shapes by value name when they differ from the
                plan's (another micro-batch size); default: the plan's shapes.
            on_stage_done: called with ``s`` right after stage ``s``'s last backward action
                (``B``, ``I`` or ``W``) of the step, when its gradients are complete (data
                parallelism starts their all-reduce then).
        """
        state = self.start(inputs, targets, scales, train=train, mb_shapes=mb_shapes)
        if on_stage_done is not None and train:
            state.on_stage_done = on_stage_done
            state.last_backward = {
                act.stage: i for i, act in enumerate(actions) if _kind(act) in ("B", "I", "W")
            }
        try:
            if self.transport.posts_receives:
                self._run_ahead(state, actions)
            elif self.transport.groups_messages:
                self._run_grouped(state, actions)
            else:
                for act in actions:
                    self.execute(state, act)
        except BaseException:
            state.stash.clear()
            raise
        return self.finish(state)

    def _run_ahead(self, state: StepState, actions: Sequence[ActionLike]) -> None:
        """``execute`` each action, keeping the next receives posted before their actions run.

        A receive posted late costs a round trip on some transports (gloo sends only once the
        receiver has asked), and the sender cannot finish its message until then. Posting the
        next few receives early hides that. They are posted in the order the actions read them,
        the order the peer sends them in, so messages still pair up one to one.
        """
        per_action = [self.needs(act) if act.stage in self._wiring else [] for act in actions]
        peers = {key.src for keys in per_action for key in keys}
        depth = self._AHEAD_PER_PEER * max(1, len(peers))  # posted beyond the running action's
        ahead = state.ahead
        for keys in per_action:
            ahead += [self._receipt(state, key) for key in keys]
        done = 0  # receives read by the actions executed so far
        for act, keys in zip(actions, per_action):
            done += len(keys)
            self._post(state, min(len(ahead), done + depth))
            self.execute(state, act)

    def _run_grouped(self, state: StepState, actions: Sequence[ActionLike]) -> None:
        """``execute`` each action after posting the previous one's sends with its receives, as one group."""
        for act in actions:
            keys = self.needs(act) if act.stage in self._wiring else []
            self.transport.post_group([self._receipt(state, key) for key in keys])
            self.execute(state, act)

    def _receipt(self, state: StepState, key: Key) -> tuple[Key, list[TensorMeta], torch.device]:
        """What receiving ``key`` takes: the message's tensor metas and the device they land on."""
        s = key.dst
        metas = (self._shaped(key.src, s, key.mb, state.mb_shapes) if key.kind == "act"
                 else self._grad_shaped(s, key.src, key.mb, state.mb_shapes))
        return key, metas, self.stages[s].device

    def _post(self, state: StepState, upto: int) -> None:
        while state.posted < upto:
            key, metas, device = state.ahead[state.posted]
            self.transport.prefetch(key, metas, device)
            state.posted += 1

    def start(
        self,
        inputs: Sequence[Mapping[str, Any]],
        targets: Sequence[Any] | None = None,
        scales: Sequence[float] | None = None,
        *,
        train: bool = True,
        mb_shapes: Mapping[int, Mapping[str, tuple[int, ...]]] | None = None,
    ) -> StepState:
        """Begin a step; then ``execute`` each action and ``finish``. ``run`` does all three."""
        m = len(inputs)
        return StepState(
            inputs=inputs,
            targets=targets,
            scales=list(scales) if scales is not None else [1.0 / m] * m,
            train=train,
            mb_shapes=mb_shapes,
            result=RunResult(peak_inflight=dict.fromkeys(self.stages, 0)),
            held=dict.fromkeys(self.stages, 0),
        )

    def execute(self, state: StepState, act: ActionLike) -> None:
        """Run one action of this rank."""
        kind = _kind(act)
        s, mb = act.stage, act.mb
        if s not in self.stages:
            raise ActionError(f"rank {self.rank} was given action {s}{kind}{mb} for stage {s}, which it does not hold")
        t0 = time.perf_counter()
        self._waited = 0.0
        try:
            if _profiling():
                with torch.profiler.record_function(f"pipecut {s}{kind}{mb}"):
                    self._dispatch(state, s, kind, mb)
            else:
                self._dispatch(state, s, kind, mb)
        except (TransportTimeout, StageError, LossError):
            raise  # already say where and why (a peer's failure, or this stage's own)
        except Exception as e:
            raise StageError.wrap(e, rank=self.rank, stage=s, kind=kind, mb=mb, module=self.stages[s].module) from e
        end = time.perf_counter()
        state.result.busy += max(0.0, end - t0 - self._waited)
        if self.record:
            state.result.records.append(
                ActionRecord(self.rank, s, kind, mb, min(t0 + self._waited, end), end, self._waited)
            )
        if state.on_stage_done is not None and state.last_backward.get(s) == state.executed:
            state.on_stage_done(s)
        state.executed += 1

    def _recv(self, key: Key, metas: Sequence[TensorMeta], device: torch.device) -> list[torch.Tensor]:
        t = time.perf_counter()
        try:
            return self.transport.recv(key, metas, device)
        finally:
            self._waited += time.perf_counter() - t

    def _dispatch(self, state: StepState, s: int, kind: str, mb: int) -> None:
        if kind == "F":
            target = state.targets[mb] if state.targets is not None else None
            st = self._forward(s, mb, state.inputs[mb], target, state.scales[mb], state.train,
                               state.result, state.mb_shapes)
            if state.train:
                state.stash[(s, mb)] = st
                state.held[s] += 1
                state.result.peak_inflight[s] = max(state.result.peak_inflight[s], state.held[s])
        elif kind in ("B", "I"):
            self._backward(s, mb, state.stash[(s, mb)], split=(kind == "I"), mb_shapes=state.mb_shapes)
            if kind == "B":
                del state.stash[(s, mb)]
                state.held[s] -= 1
        elif kind == "W":
            with self._sharded_loss(s):
                self._weights(state.stash.pop((s, mb)))
            state.held[s] -= 1
        else:
            raise ActionError(f"unknown action kind {kind!r} (known: F, B, I, W)")

    def finish(self, state: StepState) -> RunResult:
        """End a step: check nothing is left stashed and wait for outstanding sends."""
        if state.stash:
            left = sorted(state.stash)
            state.stash.clear()
            raise InconsistentScheduleError(
                f"rank {self.rank}: activations of (stage, micro-batch) {left[:6]} were never "
                "backpropagated; the schedule lacks their backward actions"
            )
        self.transport.wait_sends()
        return state.result

    def needs(self, act: ActionLike) -> list[Key]:
        """The messages ``act`` waits for (to interleave several ranks in one thread)."""
        kind = _kind(act)
        s, mb = act.stage, act.mb
        w = self._wiring[s]
        if kind == "F":
            return [Key(q, s, "act", mb) for q in w.producers]
        if kind in ("B", "I") and s < self.p - 1:
            return [Key(c, s, "grad", mb) for c in w.consumers]
        return []

    # -- actions --------------------------------------------------------------------------

    def _forward(
        self, s: int, mb: int, inputs: Mapping[str, Any], target: Any, scale: float, train: bool,
        result: RunResult, mb_shapes: Mapping[int, Mapping[str, tuple[int, ...]]] | None,
    ) -> Stash:
        stage = self.stages[s]
        w = self._wiring[s]
        received: dict[str, Any] = {}
        for q in w.producers:
            tensors = self._recv(Key(q, s, "act", mb), self._shaped(q, s, mb, mb_shapes), stage.device)
            for v, grad, t in zip(w.recv_vals[q], w.recv_grad[q], tensors):
                if train and grad:
                    t.requires_grad_(True)
                received[v.name] = t
        args: list[Any] = []
        for name, graph_input in w.args:
            if graph_input:
                if name not in inputs:
                    raise MissingInputError(f"stage {s} reads graph input {name!r}, which was not given")
                x = inputs[name]
                args.append(x.to(stage.device) if isinstance(x, torch.Tensor) else x)
            else:
                args.append(received[name])
        replay = None
        # A vocabulary-split head's stage runs under loss_parallel too: a loss the model computes
        # itself (given labels) then splits as loss_fn's does, and its backward matches.
        with self.precision.autocast(stage.device), self._sharded_loss(s):
            if train and s in self.recompute:  # the replay re-enters this autocast state
                outputs, replay = forward_without_graph(stage.module, args, stage.device)
            elif torch.is_grad_enabled() == train:
                outputs = stage.module(*args)
            else:
                with torch.set_grad_enabled(train):
                    outputs = stage.module(*args)
        for c in w.consumers:
            sent = [outputs[i] for i in w.send_idx[c]]
            self.transport.send(Key(s, c, "act", mb), on_wire(sent, self._metas[(s, c)]))
        # A recomputing stage keeps its inputs only; the backward rebuilds the outputs.
        st = Stash(args, outputs if replay is None else (), replay=replay)
        if s == self.p - 1:
            if not train:
                whole = whole_outputs(outputs) if s in self._vocab else outputs
                result.outputs[mb] = tuple(decode_value(v, t) for v, t in zip(stage.io.outputs, whole))
            elif self.loss_fn is not None:
                st.target, st.scale = _to_device(target, stage.device), scale
                # Without a graph the loss is only the value reported; the replay differentiates it.
                loss = self._stage_loss(s, mb, st, outputs, check_grad=replay is None)
                st.loss = self._scaled(loss) if replay is None else None
                result.losses[mb] = loss.detach()
        return st

    def _stage_loss(self, s: int, mb: int, st: Stash, outputs: Sequence[Any], *, check_grad: bool) -> torch.Tensor:
        """The last stage's loss of ``outputs`` (under the precision's autocast), scaled by the
        micro-batch's share of the batch."""
        flat = tuple(decode_value(v, t) for v, t in zip(self.stages[s].io.outputs, outputs))
        out = model_output(flat, self.out_spec)
        # enable_grad for the scaling too: a step run under no_grad still trains.
        with torch.enable_grad(), self.precision.autocast(self.stages[s].device):
            return self._loss(s, mb, out, st.target, st.args, check_grad=check_grad) * st.scale

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward starts from: the loss times the fp16 loss scale (reported losses are not)."""
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    def _replay(self, s: int, mb: int, st: Stash) -> None:
        """Recompute a stage's forward (and, on the last stage, its loss) with autograd."""
        assert st.replay is not None
        outputs = forward_again(self.stages[s].module, st.args, st.replay)
        st.replay = None
        st.outputs = outputs
        if s == self.p - 1 and self.loss_fn is not None:
            st.loss = self._scaled(self._stage_loss(s, mb, st, outputs, check_grad=True))

    def _loss(
        self, s: int, mb: int, out: Any, target: Any, args: Sequence[Any], *, check_grad: bool = True
    ) -> torch.Tensor:
        """``loss_fn(out, target)``, held to its contract: a scalar tensor autograd can follow."""
        assert self.loss_fn is not None
        where = f"rank {self.rank}, stage {s}, micro-batch {mb}"
        try:
            with torch.enable_grad():  # a step run under no_grad still trains
                loss = (plain_loss(self.loss_fn, out, target, where) if s in self._vocab
                        else self.loss_fn(out, target))
        except VocabLossError:
            raise
        except Exception as e:
            detail = (f"loss_fn was called per micro-batch as loss_fn(output={describe_value(out)}, "
                      f"target={describe_value(target)}); the target's micro-batch must fit the output's")
            raise StageError.wrap(e, rank=self.rank, stage=s, kind="loss", mb=mb, detail=detail) from e
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise LossError(
                f"{where}: loss_fn returned {describe_value(loss)}, but it must return a scalar "
                "tensor, the mean loss of the micro-batch: def loss_fn(output, target) -> "
                "torch.Tensor, e.g. nn.functional.cross_entropy(output, target) (reduction='mean'); "
                "reduce a per-element loss with .mean()"
            )
        if check_grad and not loss.requires_grad and _tracks_grad(self.stages[s].module, args):
            raise LossError(
                f"{where}: loss_fn returned a loss that does not require grad, so nothing can be "
                "backpropagated: it was computed from detached values (.item(), .detach(), "
                "torch.no_grad(), numpy); compute it from the output with torch operations"
            )
        if self.check_finite and not bool(torch.isfinite(loss)):
            raise LossError(
                f"{where}: the loss is {loss.item()} (check_finite=True); inputs of that micro-batch "
                "or a too-large learning rate are the usual causes. No optimizer step was taken"
            )
        return loss

    def _backward(
        self, s: int, mb: int, st: Stash, *, split: bool,
        mb_shapes: Mapping[int, Mapping[str, tuple[int, ...]]] | None,
    ) -> None:
        stage = self.stages[s]
        if st.replay is not None:
            with self._sharded_loss(s):
                self._replay(s, mb, st)
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if s == self.p - 1:
            if st.loss is None:
                raise TrainerStateError("the last stage has no loss to backpropagate: give the trainer a loss_fn")
            roots, grads = [st.loss], [None]
        else:
            w = self._wiring[s]
            acc: dict[str, torch.Tensor] = {}
            for c in w.consumers:
                got = self._recv(Key(c, s, "grad", mb), self._grad_shaped(s, c, mb, mb_shapes), stage.device)
                for v, g in zip(w.grad_vals[c], got):
                    acc[v.name] = acc[v.name] + g if v.name in acc else g
            for v, out in zip(stage.io.outputs, st.outputs):
                if v.name in acc and isinstance(out, torch.Tensor) and out.requires_grad:
                    roots.append(out)
                    grads.append(acc[v.name])
        inputs = [a for a in st.args if isinstance(a, torch.Tensor) and a.requires_grad]
        if roots:
            with self._sharded_loss(s):
                self._autograd(stage.module, roots, grads, inputs, st, split=split)
        self._send_input_grads(s, mb, st)
        # W needs none of these: what it reads is in the pending weight work (and the graph).
        st.args, st.outputs, st.loss, st.target = [], (), None, None

    def _sharded_loss(self, s: int) -> Any:
        """The context of stage ``s``'s forward, loss and backward: ``loss_parallel`` where its logits
        are split over the vocabulary."""
        return sharded_loss() if s in self._vocab else contextlib.nullcontext()

    def _autograd(self, module: nn.Module, roots: list[torch.Tensor], grads: list[torch.Tensor | None],
                  inputs: list[torch.Tensor], st: Stash, *, split: bool) -> None:
        """Backward from ``roots``: whole, or the input gradients now and the weights' work kept for ``W``."""
        if split:
            params, fused = _autograd_params(module)
            in_grads, st.pending_w = backward_input(roots, grads, inputs, params, fused)
            for a, ig in zip(inputs, in_grads):
                if ig is not None:
                    a.grad = ig
        else:
            torch.autograd.backward(roots, grads)

    def _weights(self, st: Stash) -> None:
        if st.pending_w is not None:
            backward_weight(st.pending_w)
        st.pending_w = None
        st.args, st.outputs, st.loss = [], (), None

    def _send_input_grads(self, s: int, mb: int, st: Stash) -> None:
        w = self._wiring[s]
        for q in w.producers:
            out = []
            for i in w.grad_args[q]:
                a = st.args[i]
                g = a.grad if isinstance(a, torch.Tensor) else None
                out.append(g if g is not None else torch.zeros_like(a))
            metas = [mt for mt, f in zip(self._metas[(q, s)], w.recv_grad[q]) if f]
            self.transport.send(Key(s, q, "grad", mb), on_wire(out, metas))

    def _shaped(
        self, src: int, dst: int, mb: int, mb_shapes: Mapping[int, Mapping[str, tuple[int, ...]]] | None
    ) -> list[TensorMeta]:
        metas = self._metas[(src, dst)]
        if not mb_shapes or mb not in mb_shapes:
            return metas
        shapes = mb_shapes[mb]
        vals = message_values(self.ios, src, dst)
        return [TensorMeta(shapes.get(v.name, mt.shape), mt.dtype) for v, mt in zip(vals, metas)]

    def _grad_shaped(
        self, src: int, dst: int, mb: int, mb_shapes: Mapping[int, Mapping[str, tuple[int, ...]]] | None
    ) -> list[TensorMeta]:
        """Metas of the gradients ``dst`` returns for the message ``src`` -> ``dst``."""
        if not mb_shapes or mb not in mb_shapes:
            return self._grad_metas[(src, dst)]
        mask = self._wiring[src].grad_mask[dst]
        return [mt for mt, f in zip(self._shaped(src, dst, mb, mb_shapes), mask) if f]


# Private in torch, hence the fallback: without it every action is labelled (a few us each).
_profiler_enabled: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


def _kind(act: ActionLike) -> str:
    """An action's kind as its letter (``F``, ``B``, ``I``, ``W``), whatever type holds it."""
    return act.kind if type(act.kind) is str else str(getattr(act.kind, "value", act.kind))


def _profiling() -> bool:
    """Whether a torch profiler is recording (labelling an action costs ~5 us, checking ~0.1 us)."""
    return bool(_profiler_enabled())


def _autograd_params(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The parameters a stage's graph accumulates gradients into, and those of them whose layers
    add their own (``runtime.execute.wgrad_fusion``). A module sharded by FSDP names its gathered
    parameters itself (``pipecut_autograd_params``, ``runtime.parallel.fsdp``): its registered
    ones are shards the graph never sees."""
    own = getattr(module, "pipecut_autograd_params", None)
    if callable(own):
        params, fused = own()
        return list(params), list(fused)
    return ([p for p in module.parameters() if p.requires_grad],
            [w for w in fused_params(module) if w.requires_grad])


def _to_device(value: Any, device: torch.device) -> Any:
    """Targets to the last stage's device (tensors in tuples, lists and dicts too)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _tracks_grad(module: nn.Module, args: Sequence[Any]) -> bool:
    """Whether a loss computed from this stage's outputs should require grad."""
    return any(p.requires_grad for p in module.parameters()) or any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    )
