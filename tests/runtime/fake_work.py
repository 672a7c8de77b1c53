"""A stand-in for ``torch.distributed``'s ``Work``, for tests of how a failed or slow wait is reported."""

from __future__ import annotations

import time


class FailingWork:
    """A ``dist.Work`` whose wait fails as a backend's would (or returns False), after ``delay`` s."""

    def __init__(self, text: str | None, delay: float = 0.0) -> None:
        self.text, self.delay = text, delay

    def wait(self, timeout: object = None) -> bool:
        time.sleep(self.delay)
        if self.text is None:
            return False
        raise RuntimeError(self.text)
