"""Multi-process test launches: a clean gloo environment and a process group killed whole on timeout."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence

import pytest

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU")


def gloo_env(**extra: str) -> dict[str, str]:
    """os.environ without inherited rank variables, one OpenMP thread per rank and gloo on loopback (as
    accelerate's debug_launcher: the hostname-based interface choice is flaky), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    return {**env, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **extra}


def run_group(cmd: Sequence[str], env: dict[str, str], timeout: float, what: str,
              cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session so a hang is killed whole (no orphaned ranks); on timeout fail the
    test with the tails of its output."""
    proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what} timed out after {timeout}s\n{out[-3000:]}\n{err[-5000:]}")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
