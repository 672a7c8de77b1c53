"""``pipecut train --tp`` is checked against the model's config.json before any model is built: a family
without a tensor-parallel plan, or heads, kv heads or hidden units that ``--tp`` does not divide, are
refused in one line in flag words (kv heads fewer than ``--tp`` are fine when ``--tp`` is a multiple)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import write_llama
from pipecut.folder import HFFolder
from pipecut.train import TrainConfig, TrainConfigError
from pipecut.train.loop import check_tp_fits

pytest.importorskip("transformers")


def _cfg(tp: int) -> TrainConfig:
    return TrainConfig(model="m", data="d.bin", out="o", tp=tp)


def test_tp_that_does_not_divide_the_heads_is_refused_in_flag_words(tmp_path: Path) -> None:
    config = HFFolder(str(write_llama(tmp_path / "llama", weights=False, tokenizer=False))).config  # 4 heads, 2 kv
    check_tp_fits(_cfg(2), config)
    check_tp_fits(_cfg(4), config)  # 2 kv heads for 4 ranks: kept whole, each rank takes its queries' heads
    with pytest.raises(TrainConfigError) as refused:
        check_tp_fits(_cfg(3), config)
    said = str(refused.value)
    assert "\\n" not in said and said.startswith("--tp 3 does not fit llama's config.json: ")
    assert "num_attention_heads = 4 does not divide by 3" in said and "Pick --tp from 1, 2, 4" in said


def test_a_family_without_a_plan_is_told_to_drop_tp(tmp_path: Path) -> None:
    from transformers import BloomConfig

    BloomConfig(hidden_size=16, n_layer=2, n_head=2, vocab_size=64).save_pretrained(tmp_path / "bloom")
    config = HFFolder(str(tmp_path / "bloom")).config
    with pytest.raises(TrainConfigError, match=r"^--tp 2: bloom has no tensor-parallel plan: drop --tp, or use "
                                               r"--pp/--dp$"):
        check_tp_fits(_cfg(2), config)
    check_tp_fits(_cfg(1), config)


def test_a_plan_splitting_only_the_embedding_is_run_and_its_vocabulary_checked() -> None:
    from transformers import Lfm2Config  # its plan: {"embed_tokens": "embedding_rowwise"}

    config = Lfm2Config(vocab_size=96, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    check_tp_fits(_cfg(2), config)  # the vocabulary splits (TensorParallel(vocab=None) follows the plan)
    odd = Lfm2Config(vocab_size=97, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    with pytest.raises(TrainConfigError, match=r"^--tp 2 does not fit lfm2's config.json: vocab_size = 97 does "
                                               r"not divide by 2"):
        check_tp_fits(_cfg(2), odd)
