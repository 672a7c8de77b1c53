"""The messages of a generating pipeline: each step's :class:`Hop` forward, the chosen tokens back to the first rank.

Legend: ``p`` pipeline ranks, ``r`` a rank's position in the pipeline (0 embeds, ``p - 1`` runs the
head), ``g`` a group of sequences, ``B`` the group's sequences, ``T`` new positions, ``K``
positions seen so far, ``H`` hidden size, ``V`` vocabulary.

The messages ride on the trainer's transports (``runtime.transport.p2p``): ``LocalTransport``
between threads, ``DistTransport`` between processes (gloo, NCCL). Those need every receive's
shapes ahead of time, and here a step's shapes are known to both ends except two things: whether
the group still runs (its sequences' stops are only known to the first rank, which reads the
tokens), the positions sent (the padded prompt at prefill, one at each later step) and which
sequences still run (stopped ones leave the group). So each hop is a small header,
``[T, K, dtype, H, B, kept]`` (``T = 0``: the group has ended, nothing follows), then the hidden
states (B, T, H), the position ids (B, T), the attention mask (B, K) and, when ``kept`` is 1 (some
sequences left at this step), the indices (B,) of the ones that stay among the step before's. The
last rank sends the first the group's chosen tokens (B,), and only with ``output_logits`` a header
``[V, dtype]`` and the logits (B, V) too.

Each message has its own key: ``mb`` is ``2 g`` for a header and ``2 g + 1`` for what follows,
so gloo pairs them by tag whatever order the groups arrive in, and two steps of one group (the
same keys) can never be in flight at once: the first rank only sends a group's next step after
its tokens came back. A prompt sent in pieces (``Batch.prefill_chunk``) is the exception: its
pieces follow each other with no token between, so piece ``c`` adds ``PIECE_STRIDE * c`` to
``g`` (piece 0 and every later step keep the plain keys: a step after the prefill is sent only
once the last piece's tokens are back, so piece 0 was received long before).
"""

from __future__ import annotations

import logging

import torch

from runtime.generate.errors import GenerateError
from runtime.generate.stage import Hop
from runtime.transport.p2p import Key, TensorMeta, Transport

__all__ = ["Ring", "DTYPES", "PIECE_STRIDE"]

log = logging.getLogger(__name__)

# The dtypes a hop or the logits may have on the wire, by their index in the header.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = TensorMeta((6,), torch.long)
_LOGITS_HEADER = TensorMeta((2,), torch.long)
PIECE_STRIDE = 1 << 12  # the key distance between two prompt pieces of one group (groups are fewer)


class Ring:
    """One pipeline rank's end of the messages of a generating pipeline.

    Args:
        transport: moves the messages; its stage indices are pipeline positions ``0 .. p - 1``.
        position: this rank's position ``r``.
        ranks: the pipeline's rank count ``p``.
        device: where received tensors go.
    """

    def __init__(self, transport: Transport, position: int, ranks: int, device: torch.device) -> None:
        self.transport = transport
        self.position = position
        self.ranks = ranks
        self.device = device

    @property
    def first(self) -> bool:
        return self.position == 0

    @property
    def last(self) -> bool:
        return self.position == self.ranks - 1

    def send_hop(self, group: int, hop: Hop | None, piece: int = 0) -> None:
        """Send the next rank group ``g``'s step (``None``: the group has ended); ``piece``: which piece
        of the prompt it carries (0 for a whole prompt and every step after the prefill)."""
        slot = group + PIECE_STRIDE * piece
        key = Key(self.position, self.position + 1, "act", 2 * slot)
        if hop is None:
            self.transport.send(key, [torch.zeros(_HEADER.shape, dtype=torch.long, device=self.device)])
            return
        data = hop.data
        if data.ndim != 3 or data.dtype not in DTYPES:
            raise GenerateError(
                f"rank {self.position} would send rank {self.position + 1} data of shape {tuple(data.shape)} and "
                f"dtype {data.dtype} for group {group}; between ranks only hidden states (B, T, H) of "
                f"{[str(d) for d in DTYPES]} travel: cut the plan so that one rank runs the head"
            )
        kept = hop.keep is not None
        header = torch.tensor([data.shape[1], hop.attention_mask.shape[1], DTYPES.index(data.dtype), data.shape[2],
                               data.shape[0], int(kept)], dtype=torch.long, device=self.device)
        self.transport.send(key, [header])
        payload = [data.contiguous(), hop.position_ids.contiguous(), hop.attention_mask.contiguous()]
        if hop.keep is not None:
            payload.append(hop.keep.to(torch.long).contiguous())
        self.transport.send(Key(self.position, self.position + 1, "act", 2 * slot + 1), payload)

    def recv_hop(self, group: int, piece: int = 0) -> Hop | None:
        """Receive from the previous rank group ``g``'s step (``None``: the group has ended); ``piece`` as
        in :meth:`send_hop`."""
        src, slot = self.position - 1, group + PIECE_STRIDE * piece
        (header,) = self.transport.recv(Key(src, self.position, "act", 2 * slot), [_HEADER], self.device)
        t, k, dtype, h, rows, kept = (int(v) for v in header.tolist())
        if t == 0:
            return None
        metas = [TensorMeta((rows, t, h), DTYPES[dtype]), TensorMeta((rows, t), torch.long),
                 TensorMeta((rows, k), torch.long)]
        if kept:
            metas.append(TensorMeta((rows,), torch.long))
        got = self.transport.recv(Key(src, self.position, "act", 2 * slot + 1), metas, self.device)
        return Hop(got[0], got[1], got[2], got[3] if kept else None)

    def send_tokens(self, group: int, tokens: torch.Tensor, logits: torch.Tensor | None) -> None:
        """From the last rank, send the first group ``g``'s chosen tokens (B,), and its logits (B, V) if asked."""
        key = Key(self.position, 0, "grad", 2 * group)
        self.transport.send(key, [tokens.contiguous()])
        if logits is not None:
            header = torch.tensor([logits.shape[1], DTYPES.index(logits.dtype)], dtype=torch.long, device=self.device)
            self.transport.send(Key(self.position, 0, "grad", 2 * group + 1), [header])
            self.transport.send(Key(self.position, 0, "grad", 2 * group + 1 + 2 * _LOGITS_OFFSET),
                                [logits.contiguous()])

    def recv_tokens(self, group: int, rows: int, logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On the first rank, receive group ``g``'s chosen tokens (B,), and its logits (B, V) when ``logits``."""
        src = self.ranks - 1
        (tokens,) = self.transport.recv(Key(src, 0, "grad", 2 * group), [TensorMeta((rows,), torch.long)],
                                        self.device)
        if not logits:
            return tokens, None
        (header,) = self.transport.recv(Key(src, 0, "grad", 2 * group + 1), [_LOGITS_HEADER], self.device)
        v, dtype = (int(x) for x in header.tolist())
        (values,) = self.transport.recv(Key(src, 0, "grad", 2 * group + 1 + 2 * _LOGITS_OFFSET),
                                        [TensorMeta((rows, v), DTYPES[dtype])], self.device)
        return tokens, values


# Keys of the logits themselves sit above every group's header keys (groups are fewer than this).
_LOGITS_OFFSET = 1 << 16
