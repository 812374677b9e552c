"""Stopping a training run cleanly: the first Ctrl-C (SIGINT) or SIGTERM finishes the step, checkpoints and stops
(``TrainingInterrupted``); a second one stops at once; a signal the process ignores stays ignored."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import torch


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM stopped ``fit`` after a whole step, whose checkpoint was saved: running the
    same command again resumes there. ``signum`` is the signal (exit status 128 + signum, as a shell reports)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class StopOnSignal:
    """While entered, the first SIGINT or SIGTERM only records itself (``signum``), so the loop can finish its
    step, checkpoint and stop; a second one acts as it would have (KeyboardInterrupt, termination). A signal the
    process ignores stays ignored (SIGINT in a background job of a non-interactive shell, ``nohup``: a Ctrl-C
    meant for the foreground must not stop it). Handlers can only be installed from the main thread: elsewhere
    this records nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in self.SIGNALS
                              if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def _record(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
            # os.write, not print: the handler may run while the main thread is inside a write to stderr
            # (tqdm), and a buffered stream refuses that reentrant call
            os.write(2, f"\nomni.train: {signal.Signals(signum).name} received: stopping after this step with a "
                        "checkpoint (send it again to stop at once)\n".encode())
            return
        self.__exit__()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)  # the restored handler (by default: terminate)

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def agreed(self, accelerator: Any, step: int, every: int) -> int | None:
        """The stop signal this run has received, agreed by every rank: a rank alone may have got it, and the
        checkpoint that follows is collective. Several processes compare notes every ``every`` steps (a
        scalar all-reduce; every step would cost a device sync per step), one process every step."""
        if accelerator.num_processes == 1:
            return self.signum
        if step % max(every, 1):
            return None
        flag = torch.tensor([self.signum or 0], device=accelerator.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item()) or None


__all__ = ["StopOnSignal", "TrainingInterrupted"]
