"""Training tokens from a flat file, and each step's batch as a pure function of (seed, step, replica).

Legend: ``B`` sequences per step over all replicas, ``dp`` replicas, ``L`` sequence length, ``N``
tokens in the file.

A token file is one long stream of ids: ``.npy`` (a 1-D integer array), ``.bin`` (raw ids of
``data_dtype``, nanoGPT's format: uint16, or uint32 for vocabularies above 65,536), both read
with a memory map, or ``.txt`` / ``.jsonl`` (one JSON object per line with a ``"text"`` field),
tokenised in memory with the model folder's tokenizer (pre-tokenise large corpora to ``.bin``).

A step's global batch is ``B`` windows of ``L + 1`` tokens at random offsets, drawn from a
generator seeded by ``(seed, stream, step)``; replica ``r`` reads rows ``r*B/dp .. (r+1)*B/dp``.
Nothing depends on what ran before, so a resumed run reads exactly the batches an uninterrupted
one would, and the global batch is the same whatever ``dp`` is.

Example:
    >>> import numpy as np
    >>> data = TokenData(np.arange(100), name="demo")
    >>> x, y = data.batch(seed=0, step=3, rows=4, seq_len=8)
    >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
    (torch.Size([4, 8]), True)
    >>> a, _ = data.batch(seed=0, step=3, rows=4, seq_len=8, replica=1, replicas=2)
    >>> bool((a == x[2:]).all())
    True
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partitioner.errors import PipecutError

__all__ = ["TokenData", "DataError", "open_tokens", "TRAIN", "EVAL"]

# Streams of the batch generator: training batches, and the fixed evaluation batches.
TRAIN, EVAL = 0, 1

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}


class DataError(PipecutError, ValueError):
    """A token file cannot be read as training data, or is too short, or holds ids out of range."""


@dataclass(frozen=True)
class TokenData:
    """A 1-D stream of token ids (a memory map for files) and where it came from."""

    tokens: Any
    """A 1-D integer ``numpy`` array or memory map, ``(N,)``."""
    name: str

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def batch(
        self, *, seed: int, step: int, rows: int, seq_len: int, replica: int = 0, replicas: int = 1,
        stream: int = TRAIN, vocab_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replica ``replica``'s share of step ``step``'s global batch of ``rows`` sequences.

        Returns:
            ``(inputs, targets)``, each ``(rows / replicas, seq_len)`` int64; targets are the
            inputs shifted by one token.

        Raises:
            DataError: the file holds fewer than ``seq_len + 1`` tokens, or an id is not below
                ``vocab_size``.
        """
        n = len(self)
        if n < seq_len + 1:
            raise DataError(
                f"{self.name} holds {n} tokens, fewer than one sequence of seq_len + 1 = {seq_len + 1}: "
                "use a smaller --seq-len or more data"
            )
        rng = np.random.default_rng([seed, stream, step])
        starts = rng.integers(0, n - seq_len, size=rows)  # (B,)
        share = rows // replicas
        mine = starts[replica * share : (replica + 1) * share]
        window = np.stack([np.asarray(self.tokens[s : s + seq_len + 1], dtype=np.int64) for s in mine])
        if window.size and int(window.min()) < 0:
            raise DataError(
                f"{self.name} holds token id {int(window.min())} (in step {step}'s batch): token ids are 0 or more; "
                "the file holds something else than token ids, or was written with another type (--data-dtype)"
            )
        if vocab_size is not None and window.size and int(window.max()) >= vocab_size:
            bad = int(window.max())
            raise DataError(
                f"{self.name} holds token id {bad} (in step {step}'s batch), not below the model's vocab_size "
                f"{vocab_size}: the data was tokenised for another model (or read with the wrong "
                "--data-dtype)"
            )
        ids = torch.from_numpy(window)  # (B / dp, L + 1)
        return ids[:, :-1], ids[:, 1:]


def open_tokens(path: str | os.PathLike[str], *, dtype: str = "uint16", tokenizer: Any = None) -> TokenData:
    """Open a token file (``.npy``, ``.bin``, ``.txt``, ``.jsonl``).

    Args:
        path: the file.
        dtype: the ids' type in a ``.bin`` (``uint16``, ``uint32``, ``int32``, ``int64``).
        tokenizer: a callable returning the folder's tokenizer, for ``.txt`` / ``.jsonl``.

    Raises:
        DataError: no such file, an empty one (no tokens), an unknown suffix, a ``.npy`` that is not a
            1-D integer array,
            a ``.bin`` whose size is not a multiple of ``dtype``'s, text without a tokenizer.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"token file {p} does not exist")
    suffix = p.suffix.lower()
    data = _open(p, suffix, dtype, tokenizer)
    if len(data) == 0:
        raise DataError(f"{p} holds no tokens: give a token file with at least --seq-len + 1 tokens")
    return data


def _open(p: Path, suffix: str, dtype: str, tokenizer: Any) -> TokenData:
    if suffix == ".npy":
        arr = np.load(p, mmap_mode="r")
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise DataError(
                f"{p} holds a {arr.ndim}-D {arr.dtype} array: a token file is one 1-D integer array "
                "(np.save(path, ids.reshape(-1)))"
            )
        return TokenData(arr, str(p))
    if suffix == ".bin":
        np_dtype = _DTYPES[dtype]
        size = p.stat().st_size
        width = np.dtype(np_dtype).itemsize
        if size % width:
            raise DataError(f"{p} has {size} bytes, not a multiple of {dtype}'s {width}: pass the right --data-dtype")
        if size == 0:  # np.memmap cannot map an empty file
            return TokenData(np.zeros(0, dtype=np_dtype), str(p))
        return TokenData(np.memmap(p, dtype=np_dtype, mode="r"), str(p))
    if suffix in (".txt", ".jsonl"):
        if tokenizer is None:
            raise DataError(f"{p} is text: tokenising it needs the model folder's tokenizer")
        tok = tokenizer()
        texts = _texts(p) if suffix == ".jsonl" else [p.read_text()]
        eos = getattr(tok, "eos_token_id", None)
        ids: list[int] = []
        for text in texts:
            ids.extend(tok(text, add_special_tokens=False)["input_ids"])
            if eos is not None and suffix == ".jsonl":  # documents separated as in pre-training
                ids.append(int(eos))
        return TokenData(np.asarray(ids, dtype=np.int64), str(p))
    raise DataError(f"{p}: a token file is .npy, .bin (raw {dtype}), .txt or .jsonl, not {suffix or 'no suffix'}")


def _texts(path: Path) -> list[str]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{i} is not JSON: {e}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{path}:{i}: each line must be an object with a "text" string')
        out.append(record["text"])
    return out
