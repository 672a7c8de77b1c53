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
``[T, K, dtype, H, B, kept, C, S]`` (``T = 0``: the group has ended, nothing follows), then the hidden
states (B, T, H) -- or (B, T, S, H) when ``S > 0``, the streams of a family with hyper-connections
(HY-V4) -- the position ids (B, T), the attention mask (B, K), when ``kept`` is 1 (some
sequences left at this step) the indices (B,) of the ones that stay among the step before's, and,
when the stage's last layer hands on ``C > 0`` values beside its hidden states (Zaya's router
states, HY-V4's top-k indices), a row ``[present, dtype, ndim, dims...]`` per value; the values
themselves follow as a third message (their shapes are known only once the second arrives). The
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
# A carried value's dtypes (router states, top-k indices), and the longest shape one may have.
_CARRIED_DTYPES = (*DTYPES, torch.int32, torch.int64, torch.bool)
_CARRIED_DIMS = 6
_CARRIED_META = 3 + _CARRIED_DIMS  # [present, dtype, ndim, dims...] per carried value
_HEADER = TensorMeta((8,), torch.long)
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
        if data.ndim not in (3, 4) or data.dtype not in DTYPES:
            raise GenerateError(
                f"rank {self.position} would send rank {self.position + 1} data of shape {tuple(data.shape)} and "
                f"dtype {data.dtype} for group {group}; between ranks only hidden states (B, T, H) or (B, T, S, H) of "
                f"{[str(d) for d in DTYPES]} travel: cut the plan so that one rank runs the head"
            )
        kept = hop.keep is not None
        streams = data.shape[2] if data.ndim == 4 else 0
        header = torch.tensor([data.shape[1], hop.attention_mask.shape[1], DTYPES.index(data.dtype), data.shape[-1],
                               data.shape[0], int(kept), len(hop.carried), streams], dtype=torch.long,
                              device=self.device)
        self.transport.send(key, [header])
        payload = [data.contiguous(), hop.position_ids.contiguous(), hop.attention_mask.contiguous()]
        if hop.keep is not None:
            payload.append(hop.keep.to(torch.long).contiguous())
        if hop.carried:
            payload.append(self._carried_header(group, hop.carried))
        self.transport.send(Key(self.position, self.position + 1, "act", 2 * slot + 1), payload)
        values = [c.contiguous() for c in hop.carried if c is not None]
        if values:
            self.transport.send(Key(self.position, self.position + 1, "act", 2 * slot + 1 + 2 * _CARRIED_OFFSET),
                                values)

    def _carried_header(self, group: int, carried: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        rows = []
        for c in carried:
            if c is None:
                rows.append([0] * _CARRIED_META)
                continue
            if c.dtype not in _CARRIED_DTYPES or c.ndim > _CARRIED_DIMS:
                raise GenerateError(
                    f"rank {self.position} would send rank {self.position + 1} a value its last layer hands on of "
                    f"shape {tuple(c.shape)} and dtype {c.dtype} for group {group}; between ranks such values of "
                    f"at most {_CARRIED_DIMS} dims and of {[str(d) for d in _CARRIED_DTYPES]} travel"
                )
            dims = [*c.shape, *[0] * (_CARRIED_DIMS - c.ndim)]
            rows.append([1, _CARRIED_DTYPES.index(c.dtype), c.ndim, *dims])
        return torch.tensor(rows, dtype=torch.long, device=self.device).flatten()

    def recv_hop(self, group: int, piece: int = 0) -> Hop | None:
        """Receive from the previous rank group ``g``'s step (``None``: the group has ended); ``piece`` as
        in :meth:`send_hop`."""
        src, slot = self.position - 1, group + PIECE_STRIDE * piece
        (header,) = self.transport.recv(Key(src, self.position, "act", 2 * slot), [_HEADER], self.device)
        t, k, dtype, h, rows, kept, n_carried, streams = (int(v) for v in header.tolist())
        if t == 0:
            return None
        shape = (rows, t, streams, h) if streams else (rows, t, h)
        metas = [TensorMeta(shape, DTYPES[dtype]), TensorMeta((rows, t), torch.long),
                 TensorMeta((rows, k), torch.long)]
        if kept:
            metas.append(TensorMeta((rows,), torch.long))
        if not n_carried:
            got = self.transport.recv(Key(src, self.position, "act", 2 * slot + 1), metas, self.device)
            return Hop(got[0], got[1], got[2], got[3] if kept else None)
        # The carried values' shapes ride in the same message, ahead of them: a transport that needs
        # every shape first (gloo) receives the fixed part, then the values as a second message.
        metas.append(TensorMeta((n_carried * _CARRIED_META,), torch.long))
        got = self.transport.recv(Key(src, self.position, "act", 2 * slot + 1), metas, self.device)
        return Hop(got[0], got[1], got[2], got[3] if kept else None, carried=self._recv_carried(src, slot, got[-1]))

    def _recv_carried(self, src: int, slot: int, header: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows = header.view(-1, _CARRIED_META).tolist()
        metas = [TensorMeta(tuple(int(d) for d in row[3:3 + row[2]]), _CARRIED_DTYPES[row[1]])
                 for row in rows if row[0]]
        values = iter(self.transport.recv(Key(src, self.position, "act", 2 * slot + 1 + 2 * _CARRIED_OFFSET), metas,
                                          self.device) if metas else [])
        return tuple(next(values) if row[0] else None for row in rows)

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
# Keys of a hop's carried values sit above every group's and prompt piece's hop keys.
_CARRIED_OFFSET = 1 << 24
