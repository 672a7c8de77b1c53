"""The pure parts of `pipecut train`: settings, token files and batches, the learning rate, checkpoint folders."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from pipecut.train.checkpoints import complete, prune
from pipecut.train.config import TrainConfig, TrainConfigError, read_toml, resolve, to_toml
from pipecut.train.data import EVAL, DataError, open_tokens
from pipecut.train.loop import layout
from pipecut.train.lr import lr_at

REQUIRED = {"model": "m", "data": "d.bin", "out": "o"}


def test_flags_override_the_file_and_the_resolved_settings_round_trip(tmp_path: Path) -> None:
    cfg = resolve({**REQUIRED, "steps": 7, "lr": 1, "schedule": "zbh1"}, {"steps": 9, "seed": None})
    assert (cfg.steps, cfg.lr, cfg.schedule, cfg.seed) == (9, 1.0, "zbh1", 0)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert resolve(read_toml(path), {}) == cfg


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"stpes": 3}, "unknown setting 'stpes' in the flags; did you mean 'steps'?"),
        ({"steps": "3"}, "steps must be an integer, got '3'"),
        ({"steps": 0}, "steps must be at least 1, got 0"),
        ({"lr": -1.0}, "lr must be positive"),
        ({"precision": "fp8"}, "precision must be one of fp32, bf16, fp16, got 'fp8'"),
        ({"min_lr": 1.0}, "min_lr between 0 and lr"),
    ],
)
def test_bad_settings_name_the_key_and_the_value(values: dict[str, object], message: str) -> None:
    with pytest.raises(TrainConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        resolve(REQUIRED, values)


def test_missing_required_settings_say_which(tmp_path: Path) -> None:
    with pytest.raises(TrainConfigError, match="missing data, out: give --data --out"):
        resolve({"model": "m"}, {})
    bad = tmp_path / "run.toml"
    bad.write_text("[training]\nsteps = 3\n")
    with pytest.raises(TrainConfigError, match="top level, not in tables"):
        read_toml(bad)


def test_layout_splits_the_world_and_the_batch() -> None:
    cfg = TrainConfig(**REQUIRED, global_batch=16, micro_batch_size=2, pp=2)
    assert layout(cfg, 4, 2) == layout(TrainConfig(**REQUIRED, global_batch=16, micro_batch_size=2, dp=2), 4, 2)
    lay = layout(cfg, 4, 2)
    assert (lay.pp, lay.dp, lay.m, lay.dp_rank) == (2, 2, 4, 1)
    with pytest.raises(TrainConfigError, match="the job has 4 processes, which is not dp x pp"):
        layout(TrainConfig(**REQUIRED, pp=3), 4, 0)


def test_tp_takes_a_share_of_the_world_and_refuses_what_it_cannot_run_with() -> None:
    lay = layout(TrainConfig(**REQUIRED, global_batch=8, pp=2, tp=2), 8, 5)  # rank (d * pp + r) * tp + t
    assert (lay.dp, lay.pp, lay.tp, lay.dp_rank) == (2, 2, 2, 1)
    for cfg, world, words in [
        (TrainConfig(**REQUIRED, pp=2, tp=2), 1, r"--tp 2 .* the job has 1: .*torchrun --nproc-per-node 4"),
        (TrainConfig(**REQUIRED, pp=2, tp=4), 6, r"--tp 4 .* the job has 6"),
        (TrainConfig(**REQUIRED, pp=3, tp=2), 8, r"the job has 8 processes, which is not dp x pp x tp"),
        (TrainConfig(**REQUIRED, dp=2, tp=2, zero="fsdp"), 4, r"--zero fsdp with --tp 2: .*--zero zero1"),
    ]:
        with pytest.raises(TrainConfigError, match=words):
            layout(cfg, world, 0)
    # --tp is a layout key: with --layout auto or --plan it constrains the layout (test_train_layout.py).
    assert resolve(REQUIRED, {"tp": 2, "layout": "auto"}).tp == 2
    with pytest.raises(TrainConfigError, match="tp must be at least 1, got 0"):
        resolve(REQUIRED, {"tp": 0})


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    rates = [lr_at(k, lr=1.0, warmup=4, decay_end=20, floor=0.1) for k in range(25)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0] and rates[4] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(rates[4:])) and rates[20:] == [0.1] * 5


def test_batches_are_a_function_of_seed_step_and_replica(tmp_path: Path) -> None:
    ids = np.arange(1000, dtype=np.uint16) % 97
    (tmp_path / "t.bin").write_bytes(ids.tobytes())
    data = open_tokens(tmp_path / "t.bin")
    x, y = data.batch(seed=1, step=5, rows=4, seq_len=10)
    assert torch.equal(x, data.batch(seed=1, step=5, rows=4, seq_len=10)[0])
    assert not torch.equal(x, data.batch(seed=1, step=6, rows=4, seq_len=10)[0])
    assert not torch.equal(x, data.batch(seed=1, step=5, rows=4, seq_len=10, stream=EVAL)[0])
    halves = [data.batch(seed=1, step=5, rows=4, seq_len=10, replica=r, replicas=2) for r in (0, 1)]
    assert torch.equal(torch.cat([h[0] for h in halves]), x) and torch.equal(torch.cat([h[1] for h in halves]), y)
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(DataError, match=r"token id 96 .* not below the model's vocab_size 50"):
        data.batch(seed=1, step=5, rows=64, seq_len=10, vocab_size=50)
    with pytest.raises(DataError, match="fewer than one sequence"):
        data.batch(seed=1, step=0, rows=1, seq_len=1000)


def test_token_files_that_cannot_be_read_are_named(tmp_path: Path) -> None:
    np.save(tmp_path / "two_d.npy", np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(DataError, match="a token file is one 1-D integer array"):
        open_tokens(tmp_path / "two_d.npy")
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(DataError, match="not a multiple of uint16's 2"):
        open_tokens(tmp_path / "odd.bin")
    (tmp_path / "t.csv").write_text("1,2")
    with pytest.raises(DataError, match=r"a token file is \.npy, \.bin"):
        open_tokens(tmp_path / "t.csv")
    with pytest.raises(DataError, match="does not exist"):
        open_tokens(tmp_path / "missing.npy")


def test_only_complete_checkpoints_count_and_the_last_k_are_kept(tmp_path: Path) -> None:
    for n in (2, 4, 6):
        (tmp_path / f"step-{n}").mkdir()
        (tmp_path / f"step-{n}" / ".metadata").touch()
    (tmp_path / ".step-8.partial-step8").mkdir()  # a save that died
    (tmp_path / ".step-3.partial-step3").mkdir()  # one that died before step 6 was saved
    assert [n for n, _ in complete(tmp_path)] == [2, 4, 6]
    assert prune(tmp_path, keep=1) == ["step-2", "step-4", ".step-3.partial-step3"]
    assert [n for n, _ in complete(tmp_path)] == [6]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-8.partial-step8", "step-6"]


def test_text_files_are_tokenised_with_the_folders_tokenizer(llama_folder: Path, tmp_path: Path) -> None:
    from pipecut.folder import HFFolder

    folder = HFFolder(llama_folder)
    tok = folder.tokenizer()
    (tmp_path / "docs.jsonl").write_text('{"text": "the quick fox"}\n\n{"text": "the lazy dog"}\n')
    data = open_tokens(tmp_path / "docs.jsonl", tokenizer=folder.tokenizer)
    first, second = (tok(t, add_special_tokens=False)["input_ids"] for t in ("the quick fox", "the lazy dog"))
    assert data.tokens.tolist() == [*first, tok.eos_token_id, *second, tok.eos_token_id]
    (tmp_path / "bad.jsonl").write_text('{"txt": "x"}\n')
    with pytest.raises(DataError, match=r'bad\.jsonl:1: each line must be an object with a "text" string'):
        open_tokens(tmp_path / "bad.jsonl", tokenizer=folder.tokenizer)
    with pytest.raises(DataError, match="tokenising it needs the model folder's tokenizer"):
        open_tokens(tmp_path / "docs.jsonl")
