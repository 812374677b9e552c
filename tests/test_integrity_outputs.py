"""Issue #29's output folders: `omni predict --attention`, `omni transcribe --output-dir / --alignment` and a
recipe's `--out` on read-only or full disks are one line naming the option and the folder (exit 2), never a
traceback or an error blamed on the export; every atomic write (omni.files.write_atomic) and the run lock say
which file could not be written and why. Full disks are simulated by making the write raise ENOSPC, read-only
ones by EROFS (tests run as root here, which chmod does not stop)."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest

from omni import files as F
from omni.files import DiskFullError, NotWritableError, write_atomic
from omni.lock import DirectoryLock
# vit / whisper: test_cli's module fixtures (tiny random-weight exports), used by name below
from test_cli import cli, noise, one_line, png, vit, wav, whisper  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def _fail_writes_under(monkeypatch, folder: Path, code: int) -> None:
    """Every write_atomic below ``folder`` fails with ``code`` (as the disk filling up between files would)."""
    original = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and folder in (Path(dir), *Path(dir).parents):
            raise OSError(code, os.strerror(code), str(dir))
        return original(*args, dir=dir, **kwargs)

    monkeypatch.setattr(F.tempfile, "mkstemp", mkstemp)


def _refuse_probe(monkeypatch, folder: Path, code: int) -> None:
    original = tempfile.TemporaryFile

    def temporary_file(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == folder:
            raise OSError(code, os.strerror(code), str(dir))
        return original(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", temporary_file)


# ----------------------------------------------------------------------------------------------------
# omni.files and the run lock


def test_write_atomic_on_a_full_or_read_only_folder_names_the_file(tmp_path, monkeypatch):
    target = tmp_path / "out" / "results.json"
    target.parent.mkdir()
    target.write_text("old")
    _fail_writes_under(monkeypatch, tmp_path / "out", errno.ENOSPC)
    with pytest.raises(DiskFullError) as err:
        write_atomic(target, "new")
    assert str(err.value) == (f"disk full (no space left on device) while writing {target}; it was not written (the "
                              f"earlier results.json is unchanged): free space on {target.parent}")
    assert err.value.errno == errno.ENOSPC and target.read_text() == "old"
    _fail_writes_under(monkeypatch, tmp_path / "out", errno.EROFS)
    with pytest.raises(NotWritableError, match=rf"^cannot write {target}: {target.parent} is not writable \(a "
                                               r"read-only file system\)$"):
        write_atomic(target, "new")
    assert sorted(p.name for p in target.parent.iterdir()) == ["results.json"]


def test_write_atomic_full_after_the_temp_file_removes_it(tmp_path, monkeypatch):
    target = tmp_path / "a.txt"

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(F.os, "fsync", full)
    with pytest.raises(DiskFullError, match=rf"while writing {target}; it was not written: free space on {tmp_path}"):
        write_atomic(target, "x" * 100)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "disk full"), (errno.EROFS, "read-only file system")])
def test_the_run_lock_on_a_full_or_read_only_out_is_one_line(tmp_path, monkeypatch, code, words):
    out = tmp_path / "run"
    real_open = os.open

    def refuse(path, *args, **kwargs):
        if str(path).startswith(str(out)):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises((DiskFullError, NotWritableError)) as err:
        DirectoryLock(out, "output directory").acquire()
    assert f"the lock file of the output directory {out}" in str(err.value) and words in str(err.value)
    assert "\n" not in str(err.value) and isinstance(err.value, OSError)


# ----------------------------------------------------------------------------------------------------
# The CLI's output folders


def test_predict_attention_on_a_read_only_folder_is_one_line(vit, tmp_path, capsys):  # noqa: F811
    pictures = tmp_path / "pics"
    pictures.mkdir()
    image = png(tmp_path / "a.png")
    with pytest.MonkeyPatch.context() as m:
        _refuse_probe(m, pictures, errno.EROFS)
        status, out, err = cli(["predict", "--checkpoint", str(vit), "--attention", str(pictures), str(image)], capsys)
    assert status == 2 and out == ""
    assert one_line(err) == f"omni predict: error: --attention {pictures}: cannot write there: it is on a read-only " \
                            "file system"


def test_predict_attention_on_a_disk_that_fills_up_blames_the_folder_not_the_export(vit, tmp_path, capsys,  # noqa: F811
                                                                                     monkeypatch):
    pytest.importorskip("matplotlib")
    pictures = tmp_path / "pics"
    _fail_writes_under(monkeypatch, pictures, errno.ENOSPC)  # the probe passes; the first picture does not fit
    status, out, err = cli(["predict", "--checkpoint", str(vit), "--attention", str(pictures),
                            str(png(tmp_path / "a.png"))], capsys)
    assert status == 2 and "export" not in err
    assert one_line(err) == f"omni predict: error: --attention {pictures}: cannot write there: the disk is full " \
                            "(no space left on device)"


@pytest.mark.parametrize("option", ["--output-dir", "--alignment"])
def test_transcribe_output_folders_on_a_full_disk_are_one_line(option, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "out"
    _refuse_probe(monkeypatch, folder, errno.ENOSPC)
    status, out, err = cli(["transcribe", "--checkpoint", str(tmp_path / "no-export"), option, str(folder),
                            str(tmp_path / "a.wav")], capsys)
    assert status == 2 and one_line(err) == (f"omni transcribe: error: {option} {folder}: cannot write there: the "
                                             "disk is full (no space left on device)")


def test_transcribe_output_dir_filling_up_names_the_folder_and_keeps_what_was_written(whisper, tmp_path, capsys,  # noqa: F811
                                                                                      monkeypatch):
    folder = tmp_path / "out"
    a, b = wav(tmp_path / "a.wav", noise(0.5, 1)), wav(tmp_path / "b.wav", noise(0.5, 2))
    original = F.tempfile.mkstemp
    calls = []

    def second_fails(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == folder:
            calls.append(dir)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args, dir=dir, **kwargs)

    monkeypatch.setattr(F.tempfile, "mkstemp", second_fails)
    status, out, err = cli(["transcribe", "--checkpoint", str(whisper), "--device", "cpu", "--max-new-tokens", "3",
                            "--output-dir", str(folder), str(a), str(b)], capsys)
    assert status == 2 and out == f"{folder / 'a.txt'}\n"
    assert one_line(err) == f"omni transcribe: error: --output-dir {folder}: cannot write there: the disk is full " \
                            "(no space left on device)"
    assert sorted(p.name for p in folder.iterdir()) == ["a.txt"]
