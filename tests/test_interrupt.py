"""Ctrl-C / SIGTERM while training: the step finishes, its checkpoint is saved, the run stops with status
128 + signal, and running it again resumes to the same weights as a run never interrupted."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import _train_worker as W
from omni.recipe_runtime import run_recipe
from omni.train import TrainingInterrupted, latest_checkpoint


class SignalAt:
    """loss_fn wrapper that sends this process ``signum`` during loss call number ``call`` (and again at
    ``again`` when given), as a user's Ctrl-C or a scheduler's SIGTERM would arrive mid-step."""

    def __init__(self, signum: int, call: int, again: int | None = None) -> None:
        self.signum, self.calls, self.n = signum, {call} | ({again} if again else set()), 0

    def __call__(self, model, batch):
        self.n += 1
        if self.n in self.calls:
            os.kill(os.getpid(), self.signum)
        return W.mlp_loss(model, batch)


@pytest.fixture(autouse=True)
def default_handlers():
    """Each test starts from Python's own handlers (SIGINT: KeyboardInterrupt, SIGTERM: terminate), whatever the
    suite was started with: a background job of a non-interactive shell (``pytest ... &``) starts with SIGINT
    ignored, and keeps ignoring it (test_an_ignored_sigint_stays_ignored). The suite's handlers are put back."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_checkpoints_the_step_and_a_rerun_resumes_exactly(tmp_path: Path, signum: int) -> None:
    previous = signal.getsignal(signum)
    W.run_mlp(tmp_path / "straight", steps=8, n=40, dropout=0.3, checkpoint_every=0)
    # grad_accum 2: loss call 7 is the first micro-batch of step 4, so the run stops after step 4
    with pytest.raises(TrainingInterrupted) as err:
        W.run_mlp(tmp_path / "cut", steps=8, n=40, dropout=0.3, checkpoint_every=0, loss_fn=SignalAt(signum, 7))
    assert err.value.signum == signum
    assert f"stopped by {signal.Signals(signum).name} at step 4 of 8" in str(err.value)
    assert latest_checkpoint(tmp_path / "cut").name == "step-000004"
    assert not (tmp_path / "cut" / "final").exists()
    assert signal.getsignal(signum) == previous  # the handler is the caller's again
    resumed, _ = W.run_mlp(tmp_path / "cut", steps=8, n=40, dropout=0.3, checkpoint_every=0, model_seed=7)
    assert resumed.step == 8
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt) as err:
        W.run_mlp(tmp_path / "r", steps=8, n=40, checkpoint_every=0, loss_fn=SignalAt(signal.SIGINT, 3, again=4))
    assert not isinstance(err.value, TrainingInterrupted)
    assert latest_checkpoint(tmp_path / "r") is None  # stopped inside step 2, before any checkpoint
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_ignored_signal_stays_ignored(tmp_path: Path, signum: int) -> None:
    """A process that ignores a signal (SIGINT in a background job ``... &`` of a script, ``nohup``) keeps
    ignoring it while it trains: two of them change nothing, the run trains to its end and exports, and the
    handler is still SIG_IGN after (a Ctrl-C meant for the foreground does not stop a background run)."""
    signal.signal(signum, signal.SIG_IGN)  # the fixture puts Python's default back
    try:
        trainer, _ = W.run_mlp(tmp_path / "r", steps=8, n=40, checkpoint_every=0, loss_fn=SignalAt(signum, 3, again=4))
    except KeyboardInterrupt as exc:  # (TrainingInterrupted too) not to pytest: it would end the whole session
        pytest.fail(f"an ignored {signal.Signals(signum).name} stopped the run: {exc!r}")
    assert trainer.step == 8 and (tmp_path / "r" / "final" / "model.safetensors").is_file()
    assert signal.getsignal(signum) is signal.SIG_IGN


def test_no_signal_after_the_last_step_is_needed(tmp_path: Path) -> None:
    """A signal during the last step lets the run finish (evaluation, checkpoint, export) as usual."""
    trainer, _ = W.run_mlp(tmp_path / "r", steps=3, n=40, loss_fn=SignalAt(signal.SIGTERM, 6))
    assert trainer.step == 3 and (tmp_path / "r" / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("exc, status, said", [
    (TrainingInterrupted("stopped by SIGTERM at step 4 of 8; ...", signal.SIGTERM), 143, "stopped by SIGTERM"),
    (KeyboardInterrupt(), 130, "interrupted"),
])
def test_recipes_exit_with_128_plus_the_signal(exc, status, said, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["recipes/x.py"])

    def main():
        raise exc

    with pytest.raises(SystemExit) as stop:
        run_recipe(main)
    err = capsys.readouterr().err
    assert stop.value.code == status and said in err and "Traceback" not in err and err.count("\n") == 1
