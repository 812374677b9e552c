"""Builds a Trainer on OUT (so it holds OUT's run lock), touches READY and sleeps until killed.

    python tests/_integrity_hold_lock.py OUT READY          # tests/test_run_lock.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import _train_worker as W  # this file's directory is sys.path[0]; it puts the repository on the path

if __name__ == "__main__":
    out, ready = Path(sys.argv[1]), Path(sys.argv[2])
    trainer, _ = W.run_mlp(out, steps=2, fit=False, report_to="none")
    ready.touch()
    time.sleep(600)
