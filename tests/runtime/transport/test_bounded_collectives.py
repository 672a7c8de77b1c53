"""Every collective of a step is bounded by the trainer's ``timeout`` and a dead peer is named.

One rank of two stalls (sleeps past the timeout before entering one collective of the step) or
is killed there; the other must raise the transport's typed error within about the timeout,
naming the collective, its ranks and the seconds waited (``runtime.transport.collective``), or,
for a killed peer, a one-line ``PeerGone`` naming the rank that is gone.

The stalled rank sleeps until the survivor gave up (a file in ``tmp_path``), at most ``STALL``
seconds, then leaves without entering the collective, so no test waits for the stall. It puts the
real collective back before it returns, so the stalls run on the tests' pool of ranks; the killed
peer takes a fresh spawn.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from parity import case, make_trainer
from rank_pool import spawn as pool_spawn
from runtime.transport.launch import LaunchError, spawn  # a fresh spawn: a rank is killed

TIMEOUT = 2.0  # the trainer's timeout
STALL = 10.0  # how long the stalled rank would sleep before entering the collective
SURVIVOR, STALLER = 0, 1

# case -> (the collective that stalls, the function of ours it is called from, trainer options)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "loss broadcast": ("broadcast", "forward_backward", {}),
    "clipping all-reduce": ("all_reduce", "clip_grad_norm_", {}),
    "fp16 unscale all-reduce": ("all_reduce", "unscale_", {"precision": "fp16"}),
    "ZeRO broadcast": ("broadcast", "broadcast_from_owners", {"data_parallel": 2, "shard_optimizer": True}),
}


class _Stalled(Exception):
    """Raised on the stalled rank when it stops stalling: it never enters the collective."""


def _stall_in(name: str, caller: str, gave_up: Path, *, kill: bool = False) -> Callable[[], None]:
    """Make ``dist.<name>`` stall (or kill this process) when called under ``caller``; returns
    what puts the real one back."""
    import torch.distributed as dist

    real = getattr(dist, name)

    def stalling(*args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name != caller:
            frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return real(*args, **kwargs)
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        deadline = time.monotonic() + STALL
        while not gave_up.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise _Stalled

    setattr(dist, name, stalling)
    return lambda: setattr(dist, name, real)


def _one_step(rank: int, world: int, which: str, tmp: str, kill: bool) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    name, caller, options = CASES[which]
    gave_up = Path(tmp) / "gave-up"
    dp = options.get("data_parallel", 1)
    c = case("mlp", 2)
    trainer = make_trainer(c, world // dp, "1f1b", transport="dist", timeout=TIMEOUT,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), **options)
    # Building takes seconds and differs between ranks: start the step together, so that only
    # the stall can outlast the short timeout.
    dist.barrier()
    unpatch = _stall_in(name, caller, gave_up, kill=kill) if rank == STALLER else lambda: None
    x, y = trainer.local_batch(c["x"].repeat(dp, 1), c["y"].repeat(dp, 1))
    start = time.monotonic()
    try:
        trainer.step(x, y, max_norm=1.0)
        got = {"type": "", "message": "", "elapsed": time.monotonic() - start}
    except _Stalled:
        return {"type": "stalled"}
    except Exception as e:
        got = {"type": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - start}
    finally:
        unpatch()  # the next case on this pooled rank finds torch.distributed as it was
        if rank == SURVIVOR:
            gave_up.touch()
    (Path(tmp) / f"rank-{rank}.json").write_text(json.dumps(got))
    return got


@pytest.mark.multiprocess
@pytest.mark.parametrize("which", list(CASES))
def test_a_stalled_peer_times_out_at_the_trainers_timeout(which: str, tmp_path: Path) -> None:
    world = 2
    got, stalled = pool_spawn(_one_step, world, which, str(tmp_path), False, timeout=60)
    assert stalled == {"type": "stalled"}, stalled
    assert got["type"] == "TransportTimeout", got
    assert TIMEOUT <= got["elapsed"] < STALL - 3, got  # ended at the timeout, not after the stall
    assert f"did not complete within {TIMEOUT:g} s (the timeout; waited" in got["message"], got
    assert got["message"].startswith("rank 0: "), got
    assert "over ranks [0, 1]" in got["message"], got
    assert "raise timeout=" in got["message"], got


@pytest.mark.multiprocess
def test_a_killed_peer_is_named_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"rank\(s\) \[1\] of 2 failed; rank 1 failed first:\nprocess exited "
                                          r"with code -9"):
        spawn(_one_step, 2, "loss broadcast", str(tmp_path), True, timeout=60)
    got = json.loads((tmp_path / "rank-0.json").read_text())
    assert got["type"] == "PeerGone", got
    assert "\n" not in got["message"], got["message"]
    assert got["message"].startswith("rank 0: rank 1 (process "), got["message"]
    assert (") is gone (its process exited), so the broadcast of the loss from rank 1 over ranks [0, 1] "
            "failed after ") in got["message"], got["message"]
    assert got["elapsed"] < TIMEOUT, got  # at once, not at the timeout
