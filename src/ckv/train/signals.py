"""Stop requests: SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 (a SLURM pre-timeout signal; submitit asks for USR2) end a
run at the next step boundary, after a checkpoint. A second SIGINT interrupts at once."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class TrainingInterrupted(RuntimeError):
    """The run stopped on a signal after saving a checkpoint; it resumes from the run folder."""

    def __init__(self, signum: int, checkpoint: Any) -> None:
        self.signum = signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name}; checkpoint saved at {checkpoint}; "
            "run the same command again to resume"
        )


class StopRequest:
    """While entered (in the main thread), records the first stop signal in ``signum`` instead of dying.

    ``forward()`` hands the signal to the handler that was installed before (e.g. submitit's requeue on SIGUSR2)
    once the checkpoint is safe.
    """

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def forward(self) -> None:
        """Call the previously installed Python handler of the received signal, if there was one."""
        handler = self._previous.get(self.signum) if self.signum is not None else None
        if callable(handler) and handler is not signal.default_int_handler:
            handler(self.signum, None)
