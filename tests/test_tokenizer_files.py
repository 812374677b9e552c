"""Reading inputs by path (omni/tokenizers/base.py open_regular_file): the audio and image tokenizers refuse a
directory, FIFO, device or socket at once, naming the path and what it is, instead of blocking on a FIFO
(open() waits for a writer) or reading a device; regular files still decode."""

from __future__ import annotations

import io
import os
import socket
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.base import NotARegularFileError, check_regular_file, open_regular_file
from omni.tokenizers.image import ImageTokenizer

ENCODERS = {"audio": AudioTokenizer().encode, "image": ImageTokenizer(patch_size=4).encode}


def special(kind: str, tmp_path: Path) -> tuple[Path, str]:
    """A path of ``kind`` and the words the error must use for it."""
    if kind == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
        return path, "a FIFO (named pipe)"
    if kind == "directory":
        path = tmp_path / "folder.wav"
        path.mkdir()
        return path, "a directory"
    if kind == "device":
        return Path(os.devnull), "a character device"
    path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()  # the socket file stays
    return path, "a socket"


def at_once(fn: Callable[[], Any], path: Path, seconds: float = 20.0) -> BaseException | None:
    """Run ``fn`` in a thread; the exception it raised. A regression that blocks in open() on a FIFO fails the
    test after ``seconds`` instead of hanging it: a writer end opened and closed lets the blocked open() return."""
    box: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            fn()
            box["exc"] = None
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            box["exc"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if path.is_fifo():
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(seconds)
        pytest.fail(f"reading {path} blocked for more than {seconds} s")
    return box["exc"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX special files")
@pytest.mark.parametrize("kind", ["fifo", "directory", "device", "socket"])
@pytest.mark.parametrize("modality", ["audio", "image"])
def test_tokenizers_refuse_special_files_at_once(modality, kind, tmp_path):
    path, words = special(kind, tmp_path)
    exc = at_once(lambda: ENCODERS[modality](str(path), key="sample-7"), path)
    assert isinstance(exc, ValueError), exc
    message = str(exc)
    assert "'sample-7'" in message and repr(str(path)) in message and f"is {words}, not an {modality} file" in message


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX special files")
def test_open_regular_file(tmp_path):
    path, _ = special("fifo", tmp_path)
    exc = at_once(lambda: open_regular_file(path), path)
    assert isinstance(exc, NotARegularFileError) and (exc.path, exc.kind) == (str(path), "a FIFO (named pipe)")
    assert str(exc) == f"{path}: is a FIFO (named pipe), not a regular file"
    with pytest.raises(FileNotFoundError):
        check_regular_file(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"abc")
    os.symlink(tmp_path / "file", tmp_path / "link")  # links are followed
    with open_regular_file(tmp_path / "link") as fh:
        assert fh.read() == b"abc"


def test_regular_files_still_decode_by_path(tmp_path):
    wave = (0.5 * np.sin(np.arange(8000) / 5)).astype(np.float32)
    for ext in ("wav", "flac", "ogg"):
        sf.write(tmp_path / f"clip.{ext}", wave, 16000)
        tok = AudioTokenizer()
        buf = io.BytesIO()
        sf.write(buf, wave, 16000, format=ext.upper())
        assert tok.encode(str(tmp_path / f"clip.{ext}")).tokens.equal(tok.encode(buf.getvalue()).tokens)
    Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8)).save(tmp_path / "img.png")
    image = ImageTokenizer(patch_size=4)
    assert image.encode(tmp_path / "img.png").tokens.equal(image.encode((tmp_path / "img.png").read_bytes()).tokens)
    with pytest.raises(ValueError, match=r"'k'.*cannot read image file .*missing\.png.*: no such file"):
        image.encode(str(tmp_path / "missing.png"), key="k")
