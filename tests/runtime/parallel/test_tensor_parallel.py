"""Tensor parallelism of a stage graph (runtime.parallel.tensor): plans mapped onto parameter names
(pure), and on 2 gloo processes a Llama (grouped-query attention), a Qwen2 (q/k/v biases), a GPT-2
(Conv1D layers, q, k and v packed in c_attn, the embedding tied to the LM head) and a Mixtral (its
experts kept whole: the way out of the MoE refusal) stage sharded over tp=2 that computes the
unsharded stage's output and every gradient, with two all-reduces per block forward and two
backward; and the refusals."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

from rank_pool import Cases
from runtime.parallel.tensor import TensorParallelError, config_patterns, plan_for, plan_from_config
from tests.runtime.parity import TOL

LLAMA_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}


def test_a_plan_maps_onto_the_names_under_any_prefix_and_biases_follow_their_weights() -> None:
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.self_attn.q_proj.bias", "model.layers.11.mlp.down_proj.weight",
             "layers.2.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight",
             "model.layers.0.self_attn.q_proj_extra.weight"]
    assert plan_for(LLAMA_PLAN, names) == {
        "model.layers.0.self_attn.q_proj.weight": "colwise", "model.layers.0.self_attn.q_proj.bias": "colwise",
        "model.layers.11.mlp.down_proj.weight": "rowwise", "layers.2.mlp.up_proj.weight": "colwise",
    }


def test_a_style_not_implemented_is_refused_only_where_it_matches() -> None:
    # transformers' MoE plans: the experts (and every entry under them) stay whole, the rest is split.
    moe = {**LLAMA_PLAN, "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
           "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts",
           "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce", "embed_tokens": "embedding_rowwise",
           "layers.*.self_attn.k_norm": "replicate"}
    dense = ["model.layers.0.self_attn.o_proj.weight"]
    experts = [f"model.layers.{i}.mlp.experts.{w}" for i in range(3) for w in ("gate_up_proj", "down_proj")]
    whole = ["model.layers.0.self_attn.q_norm.weight", "model.embed_tokens.weight",
             "model.layers.0.self_attn.k_norm.weight"]
    assert plan_for(moe, [*dense, *experts, *whole]) == {dense[0]: "rowwise"}
    local = {**LLAMA_PLAN, "layers.*.self_attn.sinks": "local_params"}
    assert plan_for(local, dense) == {dense[0]: "rowwise"}  # no such weight in this stage: nothing to refuse
    sinks = [f"model.layers.{i}.self_attn.sinks.weight" for i in range(6)]
    with pytest.raises(TensorParallelError) as refused:
        plan_for(local, [*dense, *sinks])
    # The message names the entry, the weights it matches (how many, the first few) and the way out.
    said = str(refused.value)
    assert ("'layers.*.self_attn.sinks': 'local_params' matches 6 weights" in said
            and "'model.layers.0.self_attn.sinks.weight', 'model.layers.1.self_attn.sinks.weight'" in said
            and "and 2 more" in said and "without the entry 'layers.*.self_attn.sinks' to keep those weights whole"
            in said and "tp=1" in said), said


def test_the_plans_of_hugging_face_configs() -> None:
    transformers = pytest.importorskip("transformers")
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    got = plan_from_config(transformers.LlamaConfig(), names)
    assert got == dict(zip(names, ("colwise", "rowwise")))
    # GPT-2's config has no plan: pipecut's own, with q, k and v packed in c_attn.
    gpt2 = [f"transformer.h.0.{w}" for w in ("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                                             "mlp.c_fc.weight", "mlp.c_proj.bias")] + ["transformer.wte.weight"]
    assert plan_from_config(transformers.GPT2Config(), gpt2) == dict(
        zip(gpt2[:5], ("packed_colwise", "packed_colwise", "rowwise", "colwise", "rowwise")))
    # GPT-Neo's and CTRL's (exact at 2 pp x 2 tp in the family sweep's long profile): Megatron's split.
    neo = [f"transformer.h.0.{w}.weight" for w in ("attn.attention.q_proj", "attn.attention.out_proj", "mlp.c_fc",
                                                   "mlp.c_proj")]
    assert plan_from_config(transformers.GPTNeoConfig(), neo) == dict(zip(neo, ("colwise", "rowwise", "colwise",
                                                                                 "rowwise")))
    ctrl = [f"transformer.h.0.{w}.weight" for w in ("multi_head_attention.Wk", "multi_head_attention.dense", "ffn.0",
                                                    "ffn.2")]
    assert plan_from_config(transformers.CTRLConfig(), ctrl) == dict(zip(ctrl, ("colwise", "rowwise", "colwise",
                                                                                "rowwise")))
    with pytest.raises(TensorParallelError, match=r"BertConfig has no base_model_tp_plan \(and pipecut derives.*plan="):
        plan_from_config(transformers.BertConfig(), ["encoder.layer.0.attention.self.query.weight"])
    for moe in (transformers.MixtralConfig(), transformers.Qwen2MoeConfig()):  # experts whole, attention split
        names = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.self_attn.q_proj.weight"]
        assert plan_from_config(moe, names) == {names[1]: "colwise"}
    # Qwen3's per-head norms: whole, their gradients all-reduced where split heads read them.
    qwen3 = ["model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.o_proj.weight"]
    assert plan_from_config(transformers.Qwen3Config(), qwen3) == {qwen3[1]: "rowwise"}


# ---- 2 gloo processes ------------------------------------------------------------------------


def _stage(family: str, heads: int = 4, kv: int = 2, stages: int = 1) -> tuple[Any, Any, torch.Tensor]:
    """(plan, config, batch) of a 2-layer model of ``family`` from transformers, dropout 0."""
    import transformers as T

    from partitioner import partition

    torch.manual_seed(0)
    x = torch.randint(0, 96, (2, 8))
    if family == "mixtral":  # 4 experts, 2 per token: the experts are one fused weight per block
        moe = T.MixtralConfig(hidden_size=8 * heads, intermediate_size=64, num_attention_heads=heads,
                              num_key_value_heads=kv, num_hidden_layers=2, vocab_size=96, max_position_embeddings=32,
                              num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.0)
        return partition(T.MixtralForCausalLM(moe), (x,), stages, microbatches=1), moe, x
    if family == "gpt2":  # its embedding is tied to the LM head: one stage reads it twice
        gpt2 = T.GPT2Config(n_layer=2, n_embd=8 * heads, n_head=heads, vocab_size=96, n_positions=32,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return partition(T.GPT2LMHeadModel(gpt2), (x,), stages, microbatches=1), gpt2, x
    config, model = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM)}[family]
    cfg = config(hidden_size=8 * heads, intermediate_size=64, num_attention_heads=heads, num_key_value_heads=kv,
                 num_hidden_layers=2, vocab_size=96, max_position_embeddings=32, attention_dropout=0.0)
    return partition(model(cfg), (x,), stages, microbatches=1), cfg, x


def _count_all_reduces(fn: Any) -> int:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        fn()
    return int(sum(comm.get_comm_counts().values()))


def _parity(family: str, outline: bool, kv: int = 2) -> dict[str, Any]:
    """The stage sharded over the world (tp=2) against its unsharded copy: output, every gradient."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from runtime.parallel.blocks import outline_blocks
    from runtime.parallel.tensor import parallelize_stage

    plan, cfg, x = _stage(family, kv=kv)
    (stage,) = plan.build_stages().stages
    ref = copy.deepcopy(stage)
    blocks = outline_blocks(stage) if outline else []
    names = [n for n, _ in stage.named_parameters()]
    if family == "mixtral":  # the way out the refusal of its expert style gives: the plan without that entry
        patterns = {k: v for k, v in config_patterns(cfg).items() if not k.startswith("layers.*.mlp.experts")}
        tp_plan = plan_for(patterns, names)
    else:
        tp_plan = plan_from_config(cfg, names)
    layout = parallelize_stage(stage, tp_plan, dist.group.WORLD)
    out: list[torch.Tensor] = []
    fwd = _count_all_reduces(lambda: out.append(stage(x)[0]))
    want = ref(x)[0]
    torch.testing.assert_close(out[0], want, **TOL)
    loss = out[0].pow(2).mean()
    bwd = _count_all_reduces(loss.backward)
    want.pow(2).mean().backward()
    grads = dict(ref.named_parameters())
    whole: dict[str, torch.Tensor] = {}
    for n, prm in stage.named_parameters():
        assert prm.grad is not None, n
        g = prm.grad.full_tensor() if isinstance(prm.grad, DTensor) else prm.grad
        torch.testing.assert_close(g, grads[n].grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")
        if not isinstance(prm, DTensor):
            whole[n] = prm.grad
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, whole)
    same = all(torch.equal(every[0][n], every[1][n]) for n in whole)
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else 0 for p in stage.parameters())
    sharded_whole = sum(grads[n].numel() for n in layout.sharded)
    return {"fwd": fwd, "bwd": bwd, "layout": layout, "checked": len(names), "replicated_same": same,
            "whole_grads": len(whole), "local": local, "sharded_whole": sharded_whole, "blocks": blocks}


def _refusals(family: str) -> dict[str, str]:
    """Each refusal's message, by case: a Llama's (``family`` 'llama') or a GPT-2's ('gpt2')."""
    import torch.distributed as dist

    from runtime.parallel.tensor import parallelize_stage

    got: dict[str, str] = {}

    def refused(case: str, stage: Any, tp_plan: dict[str, str]) -> None:
        try:
            parallelize_stage(stage, tp_plan, dist.group.WORLD)
        except TensorParallelError as e:
            got[case] = str(e)

    if family == "gpt2":
        _gpt2_refusals(refused, got)
        return got
    plan, cfg, _ = _stage("llama", heads=3, kv=3)  # 3 heads over tp=2
    (stage,) = plan.build_stages().stages
    refused("heads", stage, plan_from_config(cfg, [n for n, _ in stage.named_parameters()]))
    plan, cfg, _ = _stage("llama", stages=2)
    gm, stage_of = plan.traced.gm, plan.stage_of()
    nodes = [n.name for n in gm.graph.nodes if n.name in stage_of]
    # Cut right after block 1's q_proj: its column-parallel output would leave the first stage.
    q = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "model.layers.1.self_attn.q_proj.weight")
    k = nodes.index(next(iter(q.users)).name) + 1
    first, second = plan.stages
    cut = dataclasses.replace(plan, stages=(dataclasses.replace(first, nodes=tuple(nodes[:k])),
                                            dataclasses.replace(second, nodes=tuple(nodes[k:]))))
    head = cut.build_stages().stages[0]
    refused("cut", head, plan_from_config(cfg, [n for n, _ in head.named_parameters()]))
    return got


def _gpt2_refusals(refused: Any, got: dict[str, str]) -> None:
    """GPT-2's refusals (packed weights, a tied weight in the plan), into ``got`` (``refused`` puts
    parallelize_stage's there)."""
    import torch.distributed as dist

    from partitioner.zoo import gpt2

    model, (x,) = gpt2(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, batch=2, seq=8)
    from partitioner import partition

    g2plan = partition(model, (x,), 1, microbatches=1)
    (g2,) = g2plan.build_stages().stages
    names = [n for n, _ in g2.named_parameters()]
    # c_attn packs q, k and v: as one 'colwise' output, rank 0 would hold q and half of k.
    refused("packed as colwise", g2, plan_for({"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise"}, names))
    (g2,) = g2plan.build_stages().stages
    refused("not packed", g2, plan_for({"h.*.mlp.c_fc": "packed_colwise", "h.*.mlp.c_proj": "rowwise"}, names))
    from torch.distributed.device_mesh import DeviceMesh

    from runtime.parallel.tensor_stages import split_stages

    plan, _, _ = _stage("gpt2")
    (g2,) = plan.build_stages().stages
    try:  # a weight tied between stages (as the trainer names it) that the plan would split
        split_stages({0: g2}, {"lm_head": "colwise"}, model, DeviceMesh.from_group(dist.group.WORLD, "cpu"),
                     tied={"lm_head.weight"})
    except TensorParallelError as e:
        got["tied"] = str(e)


def _packed_state(rank: int, tmp: str) -> dict[str, Any]:
    """A packed weight (GPT-2's c_attn over tp=2) read from a whole tensor, as Init(weights=...)
    reads it (the torch and safetensors readers); saved through DCP as its parts and read back
    whole and into each rank's slice, and read into the slices from a whole tensor's checkpoint;
    a packed weight on a 2-D mesh refused on both ranks."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    from runtime.parallel.tensor import parallelize_stage
    from runtime.state import safe_dcp
    from runtime.state.weight_errors import CheckpointError
    from runtime.state.weight_sources import copy_part, local_part, open_source

    plan, cfg, _ = _stage("gpt2")
    (stage,) = plan.build_stages().stages
    name = "transformer.h.0.attn.c_attn.weight"  # (32, 96): q, k and v side by side
    whole = stage.get_parameter(name).detach().clone()
    parallelize_stage(stage, plan_from_config(cfg, [n for n, _ in stage.named_parameters()]), dist.group.WORLD)
    prm = stage.get_parameter(name)
    mine = torch.cat([part.chunk(2, dim=1)[rank] for part in whole.chunk(3, dim=1)], dim=1)  # its heads of each
    got: dict[str, Any] = {}
    with torch.no_grad():
        local_part(prm)[0].zero_()
        copy_part(prm, whole)  # the torch file reader's and the Hugging Face conversion's path
        got["copied"] = torch.equal(prm.to_local(), mine)
        local_part(prm)[0].zero_()
        save_file({name: whole}, f"{tmp}/rank{rank}.safetensors")
        with open_source(f"{tmp}/rank{rank}.safetensors") as source:
            source.read({name: [prm]}, lambda key: None)
        got["safetensors"] = torch.equal(prm.to_local(), mine) and torch.equal(prm.full_tensor(), whole)
    # DCP: each rank writes its slice of q, of k and of v as 3 chunks at their own columns.
    safe_dcp.save({name: prm.detach()}, f"{tmp}/dcp", collective=True)
    chunks = safe_dcp.read_metadata(f"{tmp}/dcp").state_dict_metadata[name].chunks
    got["chunks"] = sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks)
    plain = torch.zeros_like(whole)
    safe_dcp.load({name: plain}, f"{tmp}/dcp", collective=False)  # tp 1, the plain model: whole
    state = {name: torch.zeros_like(prm)}  # another trainer of this layout: each rank its slices
    safe_dcp.load(state, f"{tmp}/dcp", collective=True)
    got["dcp"] = torch.equal(plain, whole) and torch.equal(state[name].to_local(), mine)
    if rank == 0:  # saved whole (tp 1): each rank reads its slice of each part from the one chunk
        safe_dcp.save({name: whole}, f"{tmp}/whole", collective=False)
    dist.barrier()
    state = {name: torch.zeros_like(prm)}
    safe_dcp.load(state, f"{tmp}/whole", collective=True)
    got["from whole"] = torch.equal(state[name].to_local(), mine)
    mesh = DeviceMesh("cpu", torch.arange(2).reshape(1, 2), mesh_dim_names=("dp", "tp"))
    on_2d = DTensor.from_local(prm.to_local().detach(), mesh, [Replicate(), prm.placements[0]], run_check=False)
    try:  # FSDP2 x tp would place it so (refused before today); DCP cannot take it as parts
        safe_dcp.save({name: on_2d}, f"{tmp}/never", collective=True)
    except CheckpointError as e:
        got["save refused"] = str(e)
    return got


# Each case of the file on 2 ranks of the pool, run when a test first asks for it: key -> the
# function of the case and its arguments.
_CASES: dict[str, tuple[Any, ...]] = {
    "llama": (_parity, "llama", False), "llama outlined": (_parity, "llama", True),
    "qwen2 outlined": (_parity, "qwen2", True), "gpt2": (_parity, "gpt2", False),
    "mixtral, experts whole": (_parity, "mixtral", False), "llama, 1 kv head": (_parity, "llama", False, 1),
    "llama refusals": (_refusals, "llama"), "gpt2 refusals": (_refusals, "gpt2"),
}


def _part(rank: int, world: int, key: str, tmp: str) -> Any:
    if key == "packed state":
        return _packed_state(rank, tmp)
    fn, *args = _CASES[key]
    return fn(*args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Cases:
    pytest.importorskip("transformers")
    return Cases(_part, 2, str(tmp_path_factory.mktemp("tp")), timeout=300)


# The long profile adds the plain Llama (GPT-2 runs the blocks inlined, Llama outlined) and Qwen2's biases.
@pytest.mark.parametrize("case", [pytest.param("llama", marks=pytest.mark.long), "llama outlined",
                                  pytest.param("qwen2 outlined", marks=pytest.mark.long), "gpt2",
                                  "mixtral, experts whole", "llama, 1 kv head"])
def test_a_stage_over_tp_2_computes_the_unsharded_stage_with_two_all_reduces_a_block(runs: Cases, case: str) -> None:
    for got in runs(case):
        # 2 blocks: one all-reduce after each attention's o_proj and each MLP's down_proj forward,
        # one before each attention's q/k/v and each MLP's gate/up backward (the inputs' gradients).
        # (Mixtral with its experts whole: the attention's only. One kv head for 2 ranks: k and v
        # stay whole, each rank takes its queries' head, whose gradient is all-reduced backward.)
        fwd, bwd = {"mixtral, experts whole": (2, 2), "llama, 1 kv head": (4, 8)}.get(case, (4, 4))
        assert (got["fwd"], got["bwd"]) == (fwd, bwd) == (got["layout"].forward_all_reduces,
                                                          got["layout"].backward_all_reduces)
        kept = [f"model.layers.{i}.self_attn.{w}_proj.weight" for i in range(2) for w in "kv"]
        assert list(got["layout"].kept_whole) == (kept if case == "llama, 1 kv head" else [])
        # Per block: q, k, v, o, gate, up, down (+ the q, k, v biases in Qwen2); GPT-2's c_attn
        # (weight and bias, q, k and v packed), attn.c_proj, c_fc (weight and bias), mlp.c_proj.
        split = {"qwen2 outlined": 20, "gpt2": 12, "mixtral, experts whole": 8, "llama, 1 kv head": 10}.get(case, 14)
        assert len(got["layout"].sharded) == split
        packed = {f"transformer.h.{i}.attn.c_attn.{w}": 3 for i in range(2) for w in ("weight", "bias")}
        assert got["layout"].packed == (packed if case == "gpt2" else {})
        assert got["local"] * 2 == got["sharded_whole"]  # each rank holds half of every sharded weight
        assert got["replicated_same"] and got["whole_grads"] == got["checked"] - split
        assert got["blocks"] == ([] if "outlined" not in case else ["model.layers.0", "model.layers.1"])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_what_tensor_parallelism_cannot_split_is_refused_with_the_fix(runs: Cases, family: str) -> None:
    got = runs(f"{family} refusals")[0]
    if family == "llama":
        assert "splits a tp-split dim into 3 (heads?), not divisible by tp=2" in got["heads"]
        assert "leaves the graph split over tp" in got["cut"] and "cut the pipeline between blocks" in got["cut"]
        return
    assert "splits the split dim 2" in got["packed as colwise"] and "'packed_colwise'" in got["packed as colwise"]
    assert "stage 0: 'lm_head.weight' is tied between stages and in the tp plan (colwise)" in got["tied"]
    assert "drop its pattern from TensorParallel(plan=...)" in got["tied"]
    assert ("transformer.h.0.mlp.c_fc.weight' is packed_colwise but its output" in got["not packed"]
            and "mark it 'colwise'" in got["not packed"])


def test_a_packed_weight_loads_its_heads_of_each_part_and_checkpoints_as_its_parts(runs: Cases) -> None:
    for got in runs("packed state"):
        # Each rank holds columns [16 r, 16 r + 16) of q, of k and of v: not one range of the whole.
        assert got["copied"] and got["safetensors"]
        # In DCP: 6 chunks of 16 columns, q's, k's and v's of each rank, read back whole and sliced.
        assert got["chunks"] == [((0, 16 * i), (32, 16)) for i in range(6)] and got["dcp"] and got["from whole"]
        assert "'transformer.h.0.attn.c_attn.weight' is a packed tensor-parallel weight" in got["save refused"]
        refused = got["save refused"]
        assert "mesh of shape (1, 2)" in refused and "export_safetensors writes it whole" in refused
