"""Integrity of what training writes: checksums on exports and checkpoints (a flipped byte is named, not
loaded), a corrupt newest checkpoint falls back to the previous one (none intact: an error, never a silent
fresh start), errors that name the file (truncated, invalid, missing, a run or checkpoint directory where an
export was expected), and a full disk that loses nothing already written."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import _train_worker as W
from omni.export import (CHECKSUMS_NAME, DiskFullError, IntegrityError, load_pretrained, resolve_export_dir,
                         save_pretrained, verify_checksums)
from omni.train import ResumeMismatchError, list_checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")
MLP_CONFIG = {"builder": "_train_worker:build_mlp", "dropout": 0.0}


def _flip_last_byte(path: Path) -> None:
    """One bit of the last tensor's data: the file still parses, only its contents changed."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ----------------------------------------------------------------------------------------------------
# Exports


def test_export_records_checksums_and_a_flipped_byte_is_named(tmp_path):
    save_pretrained(W.make_mlp(1), tmp_path / "m", MLP_CONFIG)
    manifest = json.loads((tmp_path / "m" / CHECKSUMS_NAME).read_text())
    assert manifest["algorithm"] == "sha256" and sorted(manifest["files"]) == ["config.json", "model.safetensors"]
    assert verify_checksums(tmp_path / "m") is True
    load_pretrained(tmp_path / "m")
    _flip_last_byte(tmp_path / "m" / "model.safetensors")
    with pytest.raises(IntegrityError, match=r"m/model.safetensors differs from the sha256 recorded"):
        load_pretrained(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\0" * 10)
    with pytest.raises(IntegrityError, match=r"m/model.safetensors has 10 bytes where \d+ were written"):
        load_pretrained(tmp_path / "m")


def test_export_without_checksums_loads_and_damaged_files_are_named(tmp_path):
    """Exports written before checksums load unchecked; a truncated or invalid file still names itself."""
    from safetensors.torch import save_model

    model = W.make_mlp(2)
    save_pretrained(model, tmp_path / "m", MLP_CONFIG)
    (tmp_path / "m" / CHECKSUMS_NAME).unlink()  # as written before checksums: no marker in the weights either
    save_model(model, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    assert verify_checksums(tmp_path / "m") is False
    back = load_pretrained(tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    weights, config = tmp_path / "m" / "model.safetensors", tmp_path / "m" / "config.json"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(IntegrityError, match=rf"{weights} is unreadable .*truncated or corrupt"):
        load_pretrained(tmp_path / "m")
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{weights} is missing"):
        load_pretrained(tmp_path / "m")
    weights.write_bytes(good)
    config.write_text(config.read_text()[:20])
    with pytest.raises(IntegrityError, match=rf"{config} is unreadable"):
        load_pretrained(tmp_path / "m")


def test_resolve_export_dir_and_errors_for_run_and_checkpoint_dirs(tmp_path):
    run, unfinished = tmp_path / "run", tmp_path / "unfinished"
    W.run_mlp(run, steps=2, checkpoint_every=2, report_to="none")
    W.run_mlp(unfinished, steps=2, checkpoint_every=2, report_to="none", export=False)
    ckpt = run / "checkpoints" / "step-000002"
    assert resolve_export_dir(run / "final") == run / "final"
    assert resolve_export_dir(run) == run / "final"
    with pytest.raises(FileNotFoundError, match=rf"{ckpt} is a training checkpoint .*not an export; its export is "
                                                rf"{run / 'final'}"):
        resolve_export_dir(ckpt)
    with pytest.raises(FileNotFoundError, match=rf"{run} is a run directory; its export is {run / 'final'}"):
        load_pretrained(run)
    with pytest.raises(FileNotFoundError, match=rf"{unfinished} is a run directory; the run {unfinished} has no "
                                                r"export yet .*not finished"):
        resolve_export_dir(unfinished)
    with pytest.raises(FileNotFoundError, match="training checkpoint.*has no export yet"):
        load_pretrained(unfinished / "checkpoints" / "step-000002")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_export_dir(tmp_path / "nowhere")


def test_disk_full_during_export_keeps_the_earlier_export(tmp_path, monkeypatch):
    import safetensors.torch

    earlier = W.make_mlp(3)
    save_pretrained(earlier, tmp_path / "m", MLP_CONFIG)

    def full(model, filename, **kwargs):
        Path(filename).write_bytes(b"\0" * 16)
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_model", full)
    with pytest.raises(DiskFullError, match=rf"disk full .*export {tmp_path / 'm'} .*the earlier export "
                                            rf"{tmp_path / 'm'} is unchanged") as err:
        save_pretrained(W.make_mlp(4), tmp_path / "m", MLP_CONFIG)
    assert err.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dir left behind
    back = load_pretrained(tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), earlier.state_dict().values()))


# ----------------------------------------------------------------------------------------------------
# Checkpoints


def _stopped_run(out: Path) -> None:
    """Steps 1-4 of a 6-step run (checkpoints 2 and 4), then the process 'stops'."""
    with pytest.raises(W.StopAfter.Stop):
        W.run_mlp(out, steps=6, checkpoint_every=2, dropout=0.2, report_to="none",
                  loss_fn=W.StopAfter(W.mlp_loss, 2 * 4))  # grad_accum 2: two calls per step
    assert [s for s, _ in list_checkpoints(out)] == [2, 4]


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    W.run_mlp(tmp_path / "straight", steps=6, checkpoint_every=2, dropout=0.2, report_to="none")
    out = tmp_path / "b"
    _stopped_run(out)
    bad = out / "checkpoints" / "step-000004"
    assert verify_checksums(bad) and "model.safetensors" in json.loads((bad / CHECKSUMS_NAME).read_text())["files"]
    _flip_last_byte(bad / "model.safetensors")
    with pytest.warns(UserWarning, match=rf"{bad}/model.safetensors differs from the sha256.*resuming from the "
                                         r"previous intact checkpoint .*step-000002.*kept as corrupt-step-000004"):
        W.run_mlp(out, steps=6, checkpoint_every=2, dropout=0.2, report_to="none", model_seed=5)
    _assert_same_weights(out / "final", tmp_path / "straight" / "final")  # steps 3-6 again, from step 2
    assert (out / "checkpoints" / "corrupt-step-000004" / "model.safetensors").is_file()
    assert [s for s, _ in list_checkpoints(out)] == [4, 6]


def test_checkpoint_from_before_checksums_with_truncated_weights_is_named(tmp_path):
    """No checksums.json (written before them): a damaged file is still caught when it is read, and named."""
    _stopped_run(tmp_path)
    for step in (2, 4):
        ckpt = tmp_path / "checkpoints" / f"step-{step:06d}"
        (ckpt / CHECKSUMS_NAME).unlink()
        (ckpt / "COMPLETE").write_text(json.dumps({"step": step}))
        state = json.loads((ckpt / "trainer_state.json").read_text())
        del state["omni_checksums"]
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
    weights = tmp_path / "checkpoints" / "step-000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.warns(UserWarning, match=rf"{weights} is unreadable .*resuming from the previous intact checkpoint"):
        _, results = W.run_mlp(tmp_path, steps=6, checkpoint_every=2, dropout=0.2, report_to="none")
    assert results["step"] == 6


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    _stopped_run(tmp_path)
    root = tmp_path / "checkpoints"
    _flip_last_byte(root / "step-000004" / "optimizer.bin")
    (root / "step-000002" / "model.safetensors").unlink()
    with pytest.raises(IntegrityError) as err:
        W.run_mlp(tmp_path, steps=6, checkpoint_every=2, dropout=0.2, report_to="none")
    msg = str(err.value)
    assert "no intact checkpoint to resume" in msg and "not training over them from scratch" in msg
    assert f"{root / 'step-000004' / 'optimizer.bin'} differs from the sha256" in msg
    assert f"{root / 'step-000002' / 'model.safetensors'} is missing" in msg
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000004"]  # untouched
    assert not (tmp_path / "final").exists()


def test_disk_full_during_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    from accelerate import Accelerator

    original = Accelerator.save_state

    def full_at_step_4(self, output_dir=None, **kwargs):
        if str(output_dir).endswith("step-000004"):
            Path(output_dir, "model.safetensors").write_bytes(b"\0" * 64)
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(output_dir, "optimizer.bin")))
        return original(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", full_at_step_4)
    root = tmp_path / "checkpoints"
    with pytest.raises(DiskFullError) as err:
        W.run_mlp(tmp_path, steps=6, checkpoint_every=2, report_to="none")
    msg = str(err.value)
    assert err.value.errno == errno.ENOSPC and msg.count("disk full") == 1
    assert f"checkpoint {root / 'step-000004'} (at {root / '.tmp-step-000004' / 'optimizer.bin'})" in msg
    assert f"the previous checkpoint {root / 'step-000002'} is intact" in msg
    assert [p.name for p in root.iterdir()] == ["step-000002"] and verify_checksums(root / "step-000002")
    monkeypatch.setattr(Accelerator, "save_state", original)  # space freed: the run resumes from step 2
    _, results = W.run_mlp(tmp_path, steps=6, checkpoint_every=2, report_to="none")
    assert results["step"] == 6


def test_a_run_without_checkpoints_is_held_to_its_recorded_config(tmp_path):
    """checkpoint_every=0 leaves nothing to resume, but the export is still work: another config is refused
    (its export untouched), the same config is reported finished (nothing retrained), force trains anew."""
    run = tmp_path / "r"
    W.run_mlp(run, steps=4, checkpoint_every=0)
    weights = (run / "final" / "model.safetensors").read_bytes()
    with pytest.raises(ResumeMismatchError, match=r"(?s)another config \(run_config.json.*replaces its export.*"
                                                  r"hparams.model.dropout: 0.0 -> 0.3"):
        W.run_mlp(run, steps=4, checkpoint_every=0, dropout=0.3)
    assert (run / "final" / "model.safetensors").read_bytes() == weights
    trainer, results = W.run_mlp(run, steps=4, checkpoint_every=0, model_seed=5)  # another init: would differ
    assert results["step"] == 4 and (run / "final" / "model.safetensors").read_bytes() == weights
    W.run_mlp(run, steps=4, checkpoint_every=0, dropout=0.3, resume="force")
    assert (run / "final" / "model.safetensors").read_bytes() != weights
