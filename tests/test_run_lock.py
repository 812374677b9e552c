"""One run per output directory: the Trainer holds the directory's lock from construction to close (fit
closes on success and on errors); a second run is refused naming the holder, a killed holder's lock is free,
and only the holder cleans the temp dirs that killed runs left."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import _train_worker as W
from omni.lock import LockedError
from omni.train import latest_checkpoint

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.usefixtures("one_thread")


def test_second_trainer_on_the_same_output_dir_is_refused_until_the_first_closes(tmp_path):
    first, _ = W.run_mlp(tmp_path, steps=2, fit=False, report_to="none")
    with pytest.raises(LockedError) as err:
        W.run_mlp(tmp_path, steps=2, fit=False, report_to="none")
    msg = str(err.value)
    assert f"output directory {tmp_path} is in use by pid {os.getpid()} on {socket.gethostname()}" in msg
    assert "pytest" in msg or sys.argv[0] in msg  # the holder's command line
    first.close()
    # Free again; and a fit that fails releases it too (fit closes the run on errors).
    with pytest.raises(W.StopAfter.Stop):
        W.run_mlp(tmp_path, steps=4, checkpoint_every=1, report_to="none", loss_fn=W.StopAfter(W.mlp_loss, 2))
    trainer, results = W.run_mlp(tmp_path, steps=4, checkpoint_every=1, report_to="none")
    assert results["step"] == 4 and latest_checkpoint(tmp_path).name == "step-000004"


def test_a_killed_runs_lock_is_free(tmp_path):
    out, ready = tmp_path / "run", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, str(HERE / "_integrity_hold_lock.py"), str(out), str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the holder never built its Trainer"
            time.sleep(0.05)
        with pytest.raises(LockedError, match=f"in use by pid {proc.pid} .*_integrity_hold_lock.py"):
            W.run_mlp(out, steps=2, fit=False, report_to="none")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    _, results = W.run_mlp(out, steps=2, report_to="none")  # no waiting, no manual clean-up
    assert results["step"] == 2


def test_stale_temp_dirs_are_cleaned_by_the_lock_holder_only(tmp_path):
    stale = [tmp_path / ".final.tmp-123-456", tmp_path / ".final.old-123-456",
             tmp_path / "checkpoints" / ".tmp-step-000008", tmp_path / "checkpoints" / ".trash-step-000002-1-2"]
    for d in stale:
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"\0" * 64)
    holder, _ = W.run_mlp(tmp_path, steps=2, fit=False, report_to="none")
    with pytest.raises(LockedError):  # a second run never gets to touch the holder's temp dirs
        W.run_mlp(tmp_path, steps=2, report_to="none")
    assert all(d.is_dir() for d in stale)
    holder.fit()
    assert not any(d.exists() for d in stale)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".omni.lock"]


def test_an_output_dir_that_is_a_file_is_named(tmp_path):
    from omni.lock import DirectoryLock

    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="output directory .*file exists and is not a directory"):
        DirectoryLock(tmp_path / "file", "output directory").acquire()
