"""Issue #29's integrity and disk cases: a deleted checksums.json is refused where the folder says it had one,
a forged RNG state is named (Accelerate swallows it), a rebuilt dataset under a resumed run is refused naming
both, an export never makes load_pretrained import a module, and a full or read-only disk while checkpointing
or exporting is one line naming the folder, with nothing lost (the partial write removed, the previous
checkpoint intact, a finished run's weights rescued to another file system)."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import pytest
import torch

import _train_worker as W
from omni import export as E
from omni.export import (CHECKSUMS_NAME, DiskFullError, IntegrityError, NotWritableError, get_builder,
                         load_pretrained, save_pretrained, write_checksums)
from omni.train import ResumeMismatchError

pytestmark = pytest.mark.usefixtures("one_thread")
MLP_CONFIG = {"builder": "_train_worker:build_mlp", "dropout": 0.0}
# What torch.save raised on a real 200 KiB tmpfs that filled up (no errno, no "No space left" anywhere)
TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------------------------------
# checksums.json deleted


def test_an_export_that_lost_its_checksums_is_refused_not_loaded_unchecked(tmp_path):
    save_pretrained(W.make_mlp(1), tmp_path / "m", MLP_CONFIG)
    weights = tmp_path / "m" / "model.safetensors"
    _flip_last_byte(weights)
    (tmp_path / "m" / CHECKSUMS_NAME).unlink()  # what hid the flipped bit before
    with pytest.raises(IntegrityError, match=rf"{tmp_path / 'm' / CHECKSUMS_NAME} is missing, but {weights} says "
                                             r".*write_checksums"):
        load_pretrained(tmp_path / "m")
    write_checksums(tmp_path / "m")  # the explicit opt-out: the files as they are now are the export
    assert isinstance(load_pretrained(tmp_path / "m"), torch.nn.Module)


def test_a_checkpoint_that_lost_its_checksums_is_set_aside(tmp_path):
    with pytest.raises(W.StopAfter.Stop):
        W.run_mlp(tmp_path, steps=6, checkpoint_every=2, report_to="none", loss_fn=W.StopAfter(W.mlp_loss, 8))
    newest = tmp_path / "checkpoints" / "step-000004"
    (newest / CHECKSUMS_NAME).unlink()
    _flip_last_byte(newest / "model.safetensors")
    with pytest.warns(UserWarning, match=rf"{newest / CHECKSUMS_NAME} is missing, but {newest / 'COMPLETE'} says.*"
                                         r"resuming from the previous intact checkpoint .*step-000002"):
        _, results = W.run_mlp(tmp_path, steps=6, checkpoint_every=2, report_to="none")
    assert results["step"] == 6 and (tmp_path / "checkpoints" / "corrupt-step-000004").is_dir()


# ----------------------------------------------------------------------------------------------------
# A forged RNG state


def test_a_forged_rng_state_is_named_not_swallowed(tmp_path):
    with pytest.raises(W.StopAfter.Stop):
        W.run_mlp(tmp_path, steps=6, checkpoint_every=2, report_to="none", loss_fn=W.StopAfter(W.mlp_loss, 8))
    newest = tmp_path / "checkpoints" / "step-000004"
    rng = newest / "random_states_0.pkl"
    torch.save({"random_state": "not a state", "numpy_random_seed": 0, "torch_manual_seed": torch.zeros(3)}, rng)
    write_checksums(newest)  # checksums that agree: only reading the state can tell
    with pytest.warns(UserWarning, match=rf"{rng} is not an RNG state this run can restore.*resuming from the "
                                         r"previous intact checkpoint"):
        _, results = W.run_mlp(tmp_path, steps=6, checkpoint_every=2, report_to="none")
    assert results["step"] == 6 and (tmp_path / "checkpoints" / "corrupt-step-000004" / rng.name).is_file()
    from omni.checkpointing import _check_rng_states

    state = torch.get_rng_state()
    _check_rng_states(tmp_path / "checkpoints" / "step-000006")  # an intact one passes, this process's streams kept
    assert torch.equal(torch.get_rng_state(), state)


# ----------------------------------------------------------------------------------------------------
# A rebuilt dataset under a resumed run


def _dataset(path: Path, labels: list[int]) -> Path:
    from omni.data.shards import Build

    build = Build(path, "reader-test", {"labels": labels}, shard_size=4, quiet=True, force=True)
    with build:
        build.start()
        with build.split("train") as w:
            for i, y in enumerate(labels):
                w.write({"__key__": f"k{i:02d}", "cls": y})
        build.finish()
    return path


def _run_on(out: Path, data: Path, **kw):
    trainer, _ = W.run_mlp(out, fit=False, checkpoint_every=2, report_to="none", **kw)
    trainer.checkpointer.run_config["hparams.data"] = str(data)  # as a recipe's --data is recorded
    return trainer.fit()


def test_a_rebuilt_dataset_of_the_same_size_is_not_resumed(tmp_path):
    data = _dataset(tmp_path / "ds", [0, 1, 2, 0, 1, 2])
    with pytest.raises(W.StopAfter.Stop):
        _run_on(tmp_path / "run", data, steps=6, loss_fn=W.StopAfter(W.mlp_loss, 8))
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    recorded = state["datasets"]["hparams.data"]
    assert recorded["path"] == str(data.resolve()) and len(recorded["content"]) == 64
    _dataset(data, [2, 1, 0, 2, 1, 0])  # same size, same path, other labels
    with pytest.raises(ResumeMismatchError, match=rf"trained on another dataset .*hparams.data: the checkpoint was "
                                                  rf"trained on {data.resolve()} .*content {recorded['content'][:12]}"
                                                  r"\), which now holds .*content [0-9a-f]{12}\).*rebuilt or replaced"):
        _run_on(tmp_path / "run", data, steps=6)
    _dataset(data, [0, 1, 2, 0, 1, 2])  # the same samples rebuilt: the same dataset, resumed
    assert _run_on(tmp_path / "run", data, steps=6)["step"] == 6


# ----------------------------------------------------------------------------------------------------
# Builders: load_pretrained imports no module an export names


def test_an_export_cannot_make_load_pretrained_import_a_module(tmp_path, monkeypatch):
    (tmp_path / "planted_builder_mod.py").write_text(
        f"open({str(tmp_path / 'ran')!r}, 'w').close()\ndef build(config, tokenizers):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    save_pretrained(W.make_mlp(1), tmp_path / "m", {"builder": "planted_builder_mod:build"})
    with pytest.raises(KeyError, match=r"'planted_builder_mod' is not imported here.*imports no module"):
        load_pretrained(tmp_path / "m")
    assert not (tmp_path / "ran").exists() and "planted_builder_mod" not in sys.modules
    for name in ("subprocess:run", "os:system", "builtins:exec"):  # imported, but the standard library's
        with pytest.raises(KeyError, match="is not imported here"):
            get_builder(name)
    with pytest.raises(KeyError, match="not a function defined in '_train_worker'"):
        get_builder("_train_worker:torch")  # a module the worker imported, not a builder of its own
    assert get_builder("_train_worker:build_mlp") is W.build_mlp  # a module the program imported itself
    from omni.vision import build_image_classifier

    assert get_builder("omni.vision:build_image_classifier") is build_image_classifier


# ----------------------------------------------------------------------------------------------------
# Full and read-only disks


def _fail_at_step_4(monkeypatch, error: Exception) -> None:
    from accelerate import Accelerator

    original = Accelerator.save_state

    def save_state(self, output_dir=None, **kwargs):
        if str(output_dir).endswith("step-000004"):
            Path(output_dir, "optimizer.bin").write_bytes(b"\0" * 4096)  # the partial file the disk filled with
            raise error
        return original(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", save_state)


def test_disk_full_in_torch_save_is_one_line_and_the_partial_checkpoint_is_removed(tmp_path, monkeypatch):
    """torch.save on a full disk raises RuntimeError with no errno: recognised by the free space left."""
    error = RuntimeError(TORCH_FULL)
    error.__context__ = RuntimeError("basic_ios::clear: iostream error")
    _fail_at_step_4(monkeypatch, error)
    monkeypatch.setattr(E, "free_bytes", lambda path: 1000)
    root = tmp_path / "checkpoints"
    with pytest.raises(DiskFullError) as err:
        W.run_mlp(tmp_path, steps=6, checkpoint_every=2, report_to="none")
    msg = str(err.value)
    assert "\n" not in msg and f"checkpoint {root / 'step-000004'}" in msg and f"on {root}" in msg
    assert f"the previous checkpoint {root / 'step-000002'} is intact" in msg
    size = sum(p.stat().st_size for p in (root / "step-000002").rglob("*") if p.is_file())
    assert f"takes about {size / 2**10:.1f} KiB, 1.0 KiB are free" in msg
    assert [p.name for p in root.iterdir()] == ["step-000002"]  # no .tmp-step-000004 left filling the disk
    assert E.verify_checksums(root / "step-000002")


def test_a_failed_checkpoint_write_that_is_no_full_disk_still_removes_the_partial_one(tmp_path, monkeypatch):
    _fail_at_step_4(monkeypatch, RuntimeError(TORCH_FULL))
    monkeypatch.setattr(E, "free_bytes", lambda path: 10 * 2**30)  # plenty of room: not a full disk
    with pytest.raises(RuntimeError, match="unexpected pos"):
        W.run_mlp(tmp_path, steps=6, checkpoint_every=2, report_to="none")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000002"]


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_a_read_only_checkpoint_folder_is_one_line_naming_it(tmp_path, monkeypatch, code):
    _fail_at_step_4(monkeypatch, OSError(code, "Read-only file system"))
    with pytest.raises(NotWritableError) as err:
        W.run_mlp(tmp_path, steps=6, checkpoint_every=2, report_to="none")
    root = tmp_path / "checkpoints"
    assert str(err.value).startswith(f"cannot write checkpoint {root / 'step-000004'}: {root} is not writable")
    assert isinstance(err.value, PermissionError)  # a user error for the recipes (omni.recipe_runtime.user_errors)
    assert [p.name for p in root.iterdir()] == ["step-000002"]


def test_a_read_only_export_folder_is_one_line_naming_it(tmp_path, monkeypatch):
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if tmp_path / "ro" in (self, *self.parents):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(NotWritableError, match=rf"^cannot write the export {tmp_path / 'ro' / 'm'}: "
                                               rf"{tmp_path} is not writable \(Read-only file system\)$"):
        save_pretrained(W.make_mlp(1), tmp_path / "ro" / "m", MLP_CONFIG)


def test_full_disk_at_the_final_export_of_a_run_without_checkpoints_rescues_the_model(tmp_path, monkeypatch):
    import safetensors.torch

    run, elsewhere = tmp_path / "run", tmp_path / "other-disk"
    elsewhere.mkdir()
    original = safetensors.torch.save_model

    def save_model(model, filename, **kwargs):
        if str(filename).startswith(str(run)):
            Path(filename).write_bytes(b"\0" * 16)
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return original(model, filename, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_model", save_model)
    monkeypatch.setattr(E, "_rescue_places", lambda: [run, elsewhere])  # the first is on the full disk
    monkeypatch.setattr(E, "_file_system", lambda p: 1 if str(p).startswith(str(elsewhere)) else 0)
    with pytest.raises(DiskFullError) as err:
        W.run_mlp(run, steps=4, checkpoint_every=0, report_to="none")
    msg = str(err.value)
    assert f"while writing the export {run / 'final'}" in msg and "\n" not in msg
    rescued = [p for p in elsewhere.iterdir() if p.name.startswith("omni-rescued-final-")]
    assert len(rescued) == 1 and f"the trained model was saved to {rescued[0]} instead" in msg
    assert f"{run} is on the same file system" not in msg  # it went to the first place with room
    assert not (run / "final").exists() and not [p for p in run.iterdir() if ".final.tmp" in p.name]
    monkeypatch.setattr(safetensors.torch, "save_model", original)
    model = load_pretrained(rescued[0])  # verified by its checksums, and it is the trained model
    W.run_mlp(tmp_path / "same", steps=4, checkpoint_every=0, report_to="none")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 load_pretrained(tmp_path / "same" / "final").state_dict().values()))


def test_rescue_says_when_no_place_has_room(tmp_path, monkeypatch):
    import safetensors.torch

    def full(model, filename, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_model", full)
    monkeypatch.setattr(E, "_rescue_places", lambda: [tmp_path])
    with pytest.raises(DiskFullError, match=rf"no other file system had room for the trained model either "
                                            rf"\({tmp_path} is on the same file system\): it is lost"):
        save_pretrained(W.make_mlp(1), tmp_path / "m", MLP_CONFIG, rescue=True)
    with pytest.raises(DiskFullError, match=r"needs about \d+\.\d KiB, [\d.]+ [MG]iB are free on") as err:
        save_pretrained(W.make_mlp(1), tmp_path / "m", MLP_CONFIG)  # no rescue: a library caller keeps its model
    assert "other file system" not in str(err.value) and list(tmp_path.iterdir()) == []
