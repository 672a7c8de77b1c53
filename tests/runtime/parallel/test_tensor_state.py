"""State under tensor parallelism, on 4 gloo processes (a Llama and a GPT-2, 2 pp x tp 2, as
test_tensor_trainer's; GPT-2's c_attn packed, its embedding tied): a DCP checkpoint saved after a
step holds each split weight as its two shards (a packed one as its 3 parts' 6), each whole one
once; a fresh trainer of the same layout loads it and continues bitwise as the saved one does; it
loads exactly into 2 dp x 2 pp (tp 1) and into the plain model; the safetensors export is the
whole weights (``from_pretrained`` reads it); ``Init(weights=...)`` gives each rank its shard
(its slice of each part), from the DCP checkpoint and from the export (which it reads in part)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rank_pool import Cases
from tests.runtime.parallel.test_tensor_trainer import _FAMILIES, _batch, _loss
from tests.runtime.parity import TOL

EXACT = {"rtol": 0.0, "atol": 0.0}


def _opt(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, eps=1e-5, foreach=True)


def _trainer(family: str, tp: int, dp: int = 1, weights: Any = None) -> Any:
    from partitioner import partition
    from runtime.options import DataParallel, Init
    from runtime.trainer import PipelineTrainer

    build, block = _FAMILIES[family]
    model = build()
    x, _ = _batch(torch.Generator().manual_seed(5))
    plan = partition(model, (x[:2],), 2, microbatches=4, schedule="1f1b", split_points=[block.format(2)])
    return PipelineTrainer(plan, _loss, _opt, schedule="1f1b", transport="dist", tensor_parallel=tp,
                           data_parallel=DataParallel(size=dp), init=Init(weights=weights))


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _everything(mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's tensors by name (each rank holds its stages')."""
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {n: t for part in parts for n, t in part.items()}


def _mine(whole: torch.Tensor, placement: Any, t: int) -> torch.Tensor:
    """Tp rank ``t``'s part of ``whole``: its chunk; a packed weight's (``_StridedShard``) chunk of each part."""
    if placement.is_replicate():
        return whole
    k = getattr(placement, "split_factor", 1)
    return torch.cat([part.chunk(2, placement.dim)[t] for part in whole.chunk(k, placement.dim)], placement.dim)


def _shards_equal(trainer: Any, whole: dict[str, torch.Tensor]) -> int:
    """Each parameter of ``trainer`` (tp 2) is exactly its rank's part of ``whole``'s; returns their bytes."""
    from torch.distributed.tensor import DTensor

    nbytes = 0
    for n, p in trainer.named_parameters():
        assert isinstance(p, DTensor), n
        (placement,) = p.placements
        torch.testing.assert_close(p.to_local(), _mine(whole[n], placement, trainer.mesh.tp_rank), **EXACT,
                                   msg=lambda m, n=n: f"{n}: {m}")
        nbytes += p.to_local().numel() * p.to_local().element_size()
    return nbytes


def _spoil(trainer: Any) -> None:
    with torch.no_grad():
        for p in trainer.parameters():
            p.zero_()


def _case(family: str, rank: int, folder: Path) -> dict[str, Any]:
    import torch.distributed as dist
    import transformers as T
    from torch.distributed.tensor import DTensor

    from runtime.state.checkpoint import load_model
    from runtime.state.safe_dcp import read_metadata
    from runtime.state.weights import Weights

    started, out = time.perf_counter(), {}
    ckpt, hf = folder / family / "ckpt", folder / family / "hf"
    gen = torch.Generator().manual_seed(6)
    batches = [_batch(gen) for _ in range(3)]
    a = _trainer(family, tp=2)
    a.step(*batches[0], max_norm=0.5)
    a.save(ckpt)
    a.export_safetensors(hf)  # the split weights gathered, written by tp rank 0 of each stage
    if rank == 0:
        a.plan.model.config.save_pretrained(hf)
    saved = _everything({n: _whole(p.detach()) for n, p in a.named_parameters()})
    moments = _everything({n: _whole(a.optimizer.state[p]["exp_avg"]) for n, p in a.named_parameters()})
    # name -> parts per rank: 1 for a Shard, k for a packed weight (_StridedShard); whole ones absent
    split = {n: getattr(p.placements[0], "split_factor", 1) for n, p in a.named_parameters()
             if not p.placements[0].is_replicate()}
    packed = {n: p.to_local().numel() * p.to_local().element_size()  # its bytes on this rank
              for n, p in a.named_parameters() if split.get(n, 1) > 1}
    want = [float(a.step(*b, max_norm=0.5)) for b in batches[1:]]
    after = {n: _whole(p.detach()) for n, p in a.named_parameters()}

    # The checkpoint: each split weight (and its moments) in two chunks (a packed one: its k parts'
    # 2 k), each whole one in one.
    meta = read_metadata(ckpt)
    for n, k in split.items():
        for key in (f"model.{n}", f"optim.state.{n}.exp_avg"):
            assert len(meta.state_dict_metadata[key].chunks) == 2 * k, key
    for n in set(dict(a.named_parameters())) - set(split):
        assert len(meta.state_dict_metadata[f"model.{n}"].chunks) == 1, n
    out["split"], out["packed"] = len(split), len(packed)

    # Init(weights=<the DCP checkpoint>) under tp: DCP reads each rank's part (its optimizer entries
    # are not weights: strict=False).
    b = _trainer(family, tp=2, weights=Weights(ckpt, strict=False))
    local_bytes = _shards_equal(b, saved)
    _spoil(b)  # from the export: each rank reads its shard of the split weights (a packed one whole)
    report = b.load_weights(hf)
    _shards_equal(b, saved)
    whole_bytes = sum(saved[n].numel() * saved[n].element_size() for n, _ in b.named_parameters())
    # A packed weight's part is not one range: safetensors may read it whole (2 x its part) for it.
    extra = sum(packed.values())
    assert local_bytes <= report.bytes_read <= local_bytes + extra < whole_bytes, (report.bytes_read, extra)
    assert report.bytes_read == local_bytes or packed
    out["bytes"] = (report.bytes_read, whole_bytes)

    # Resume: the same layout, its weights spoiled first, continues bitwise.
    _spoil(b)
    b.load(ckpt)
    assert b.step_count == 1
    got = [float(b.step(*x, max_norm=0.5)) for x in batches[1:]]
    assert got == want, (got, want)
    mine = dict(b.named_parameters())
    for n, t in after.items():
        torch.testing.assert_close(_whole(mine[n].detach()), t, **EXACT, msg=lambda m, n=n: f"{n}: {m}")
    del a, b

    # Another layout, tp 1 (2 replicas x 2 pipeline ranks): the same values, whole.
    c = _trainer(family, tp=1, dp=2)
    c.load(ckpt)
    for n, p in c.named_parameters():
        assert not isinstance(p, DTensor), n
        torch.testing.assert_close(p.detach(), saved[n], **EXACT, msg=lambda m, n=n: f"{n}: {m}")
        torch.testing.assert_close(c.optimizer.state[p]["exp_avg"], moments[n], **EXACT)
    x, y = batches[1]
    loss = c.step(*c.local_batch(x, y), max_norm=0.5)  # each replica half the batch, averaged
    torch.testing.assert_close(float(loss), want[0], **TOL)
    out["checked"] = len(saved)

    if rank == 0:  # the plain model, from the checkpoint and from the export
        plain = _FAMILIES[family][0]()
        load_model(plain, ckpt)
        pretrained = getattr(T, type(plain).__name__).from_pretrained(hf)
        for model in (plain, pretrained):
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.detach(), saved[n], **EXACT, msg=lambda m, n=n: f"{n}: {m}")
    dist.barrier()
    out["seconds"] = time.perf_counter() - started
    return out


def _part(rank: int, world: int, family: str, folder: str) -> dict[str, Any]:
    return _case(family, rank, Path(folder))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Cases:
    """Each family's case on 4 ranks of the pool, run when its test asks for it."""
    pytest.importorskip("transformers")
    return Cases(_part, 4, str(tmp_path_factory.mktemp("tp-state")), timeout=420)


@pytest.mark.multiprocess
# GPT-2's packed and tied weights in the long profile (a packed weight's checkpoint by default:
# test_tensor_parallel.py's test_a_packed_weight_loads_its_heads_of_each_part_and_checkpoints_as_its_parts).
@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.long)])
def test_tp_checkpoints_resume_bitwise_reshard_to_tp_1_and_export_whole(runs: Cases, family: str) -> None:
    for got in runs(family):
        if family == "llama":
            # Each rank's stage 2 blocks of 7 split weights; the model 4 blocks of 9 tensors,
            # embedding, norm and head. Each rank read its stage's shards (and whole weights): under 60%.
            assert got["split"] == 14 and got["packed"] == 0 and got["checked"] == 4 * 9 + 3
            read, whole = got["bytes"]
            assert read < 0.6 * whole, (read, whole)
        else:
            # 2 blocks of 6 split weights (c_attn's weight and bias packed); the model 4 blocks of
            # 12 tensors, wte and wpe, ln_f's 2, and the tied copy (lm_head.weight on the first stage).
            assert got["split"] == 12 and got["packed"] == 4 and got["checked"] == 4 * 12 + 5
