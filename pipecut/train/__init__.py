"""The ``pipecut train`` job: settings, token data, learning rate, the run loop, the export.

Example:
    ``train(resolve(read_toml("run.toml"), {"steps": 10}))`` runs what
    ``pipecut train --config run.toml --steps 10`` runs (docs/train.md).
"""

from __future__ import annotations

from pipecut.train.config import TrainConfig, TrainConfigError, read_toml, resolve
from pipecut.train.data import DataError, TokenData, open_tokens
from pipecut.train.loop import TrainResult, train
from pipecut.train.report import StartReport

__all__ = [
    "train", "TrainResult", "TrainConfig", "TrainConfigError", "resolve", "read_toml", "TokenData", "open_tokens",
    "DataError", "StartReport",
]
