"""A finished run is finished with its results: the Trainer writes train_results.json and curves.png BEFORE the
export (whose presence marks the run finished), so a kill as the export begins leaves them, and the re-run,
which finds no intact export, evaluates and exports. Before, they came after the export: a kill in between left a
run every re-run reported as finished with nan metrics (tests/test_vit_recipe.py and test_multimodal.py check
the recipes' side, and the re-evaluation of such a run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import _train_worker as W
from omni.train import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class Killed(BaseException):
    """A kill as the export begins (not an Exception: nothing may catch it on the way out)."""


def test_results_and_curves_come_before_the_export(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    x, y = W.mlp_data(16)
    eval_data = W.ListLoader(x, y, 8, 0, 1)
    straight, metrics = W.run_mlp(tmp_path / "straight", steps=4, n=40, checkpoint_every=2, eval_data=eval_data,
                                  report_to="none")
    seen = {}

    def export(self, directory=None):
        seen.update({name: (self.output_dir / name).is_file() for name in ("train_results.json", "curves.png")})
        raise Killed

    with monkeypatch.context() as mp:
        mp.setattr(Trainer, "export", export)
        with pytest.raises(Killed):
            W.run_mlp(tmp_path / "cut", steps=4, n=40, checkpoint_every=2, eval_data=eval_data, report_to="none")
    assert seen == {"train_results.json": True, "curves.png": True}
    recorded = json.loads((tmp_path / "cut" / "train_results.json").read_text())
    assert recorded["step"] == 4 and recorded["eval/loss"] == metrics["eval/loss"]
    _, again = W.run_mlp(tmp_path / "cut", steps=4, n=40, checkpoint_every=2, eval_data=eval_data, report_to="none")
    assert (tmp_path / "cut" / "final" / "model.safetensors").is_file()
    assert again["eval/loss"] == metrics["eval/loss"]
