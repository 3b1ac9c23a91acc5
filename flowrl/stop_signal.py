"""SIGTERM, what schedulers send before killing a job, noted rather than obeyed at once: the trainer finishes the
current iteration, saves a checkpoint and stops (flowrl/trainer.py)."""

from __future__ import annotations

import signal
import threading


class SigtermNoted:
    """A context in which SIGTERM only sets :attr:`received`; the previous handler comes back on exit. Outside the
    main thread (where Python cannot install handlers) it does nothing."""

    def __init__(self):
        self.received: int | None = None
        self._previous = None

    def _note(self, signum, frame) -> None:
        self.received = signum

    def __enter__(self) -> "SigtermNoted":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
