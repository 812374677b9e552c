"""Nothing needs system data or the network: the default corpora (Debian dataset-fashion-mnist and
r-cran-janeaustenr) are found through OMNI_FASHION_MNIST_DIR / OMNI_AUSTEN_DIR, read at call time; their
absence is one error naming the folder, the variable and the package; Fashion-MNIST is downloaded only when
asked (--download); and CI runs the suite with those variables pointing at empty folders."""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path

import pytest

from omni.cli import main as cli_main
from omni.data import builders_vision
from omni.data.builders_speech import load_paragraphs
from omni.data.builders_text import build_text
from omni.data.builders_vision import build_fashion_mnist, locate_fashion_mnist
from omni.data.shards import read_manifest
from omni.data.corpora import austen_novels

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """urlopen recorded and refused: the URLs something tried to fetch."""
    import urllib.error

    tried: list[str] = []

    def refuse(url: str, *args: object, **kwargs: object) -> None:
        tried.append(url)
        raise urllib.error.URLError("no network in tests")

    monkeypatch.setattr(builders_vision.urllib.request, "urlopen", refuse)
    return tried


def error_line(capsys: pytest.CaptureFixture, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"omni {command}: error: ") and "Traceback" not in err, err
    return err


def test_fashion_mnist_folder_comes_from_the_environment(tmp_path, monkeypatch, tiny_corpora, no_network):
    monkeypatch.setenv("OMNI_FASHION_MNIST_DIR", str(tiny_corpora.fashion_mnist))
    m = build_fashion_mnist(tmp_path / "fm", quiet=True)  # no --source: the variable, read now
    assert m["source_dir"] == str(tiny_corpora.fashion_mnist.resolve())
    assert {k: s["count"] for k, s in m["splits"].items()} == {"train": 1000, "test": 256}
    assert no_network == []


def test_missing_fashion_mnist_is_one_error_and_never_a_download(tmp_path, monkeypatch, capsys, no_network):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("OMNI_FASHION_MNIST_DIR", str(empty))
    with pytest.raises(FileNotFoundError) as err:
        build_fashion_mnist(tmp_path / "fm")
    with pytest.raises(FileNotFoundError):
        locate_fashion_mnist(None, tmp_path / "cache")  # what recipes/multimodal.py calls
    message = str(err.value)
    assert "\n" not in message
    for part in (str(empty), "OMNI_FASHION_MNIST_DIR", "apt-get install dataset-fashion-mnist", "--source DIR",
                 "omni data fashion-mnist --download"):
        assert part in message, (part, message)
    assert cli_main(["data", "fashion-mnist", "--out", str(tmp_path / "fm")]) == 2
    assert str(empty) in error_line(capsys, "data fashion-mnist")
    assert no_network == []  # nothing was fetched unasked
    assert not (tmp_path / "fm" / "download").exists()


def test_download_only_when_asked(tmp_path, monkeypatch, tiny_corpora):
    """--download fetches the four files (here from the fixture, not the internet) and builds from them."""
    monkeypatch.setenv("OMNI_FASHION_MNIST_DIR", str(tmp_path / "none"))
    fetched: list[str] = []

    def serve(url: str, timeout: float) -> io.BytesIO:
        fetched.append(url)
        return io.BytesIO((tiny_corpora.fashion_mnist / url.rsplit("/", 1)[1]).read_bytes())

    monkeypatch.setattr(builders_vision.urllib.request, "urlopen", serve)
    assert cli_main(["data", "fashion-mnist", "--out", str(tmp_path / "fm"), "-q", "--download"]) == 0
    assert len(fetched) == 4 and read_manifest(tmp_path / "fm")["splits"]["test"]["count"] == 256
    assert cli_main(["data", "fashion-mnist", "--out", str(tmp_path / "fm"), "-q"]) == 0  # reuses OUT/download
    assert len(fetched) == 4


def test_austen_folder_comes_from_the_environment(tmp_path, monkeypatch, tiny_corpora):
    monkeypatch.setenv("OMNI_AUSTEN_DIR", str(tiny_corpora.austen))
    novels = austen_novels()
    assert sorted(novels) == ["emma", "persuasion"] and len(novels["emma"]) == 151
    paragraphs, corpus = load_paragraphs(None)  # speech-synth's default corpus
    assert len(paragraphs) == 302 and "Austen" in corpus
    m = build_text(tmp_path / "text", quiet=True)  # `omni data text` without --src
    assert m["source"]["inputs"] == [str(tiny_corpora.austen.resolve())] and m["splits"]["train"]["count"] > 10
    # the plain-text form of the same corpus, through the builders' file inputs
    assert load_paragraphs([str(p) for p in sorted(tiny_corpora.text.glob("*.txt"))])[0] == paragraphs


@pytest.mark.parametrize("argv", [["data", "text"], ["data", "speech-synth", "--train", "1", "--test", "1"],
                                  ["tokenizer", "fit"]])
def test_missing_austen_is_one_error_naming_folder_variable_and_package(tmp_path, monkeypatch, capsys, argv):
    empty = tmp_path / "empty"
    empty.mkdir()
    for where in (tmp_path / "nowhere", empty):  # unset folder, and an empty one (as in CI)
        monkeypatch.setenv("OMNI_AUSTEN_DIR", str(where))
        assert cli_main([*argv, "--out", str(tmp_path / "out")]) == 2
        line = error_line(capsys, " ".join(argv[:2]))
        for part in (str(where), "OMNI_AUSTEN_DIR", "r-cran-janeaustenr"):
            assert part in line, (part, line)


def test_ci_runs_the_readme_command_with_the_system_data_folders_empty():
    script = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    command = 'python3 -m venv .venv && .venv/bin/pip install -q -e ".[dev]" && .venv/bin/python -m pytest -q'
    assert command in readme and command in script
    assert re.search(r"^set -euo pipefail$", script, re.M)  # pytest's exit 5 (no tests) fails CI too
    before = script[: script.index(command)]
    exported = {}
    for line in before.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            exported.update(w.split("=", 1) for w in words[1:] if "=" in w)
    for name in ("OMNI_FASHION_MNIST_DIR", "OMNI_AUSTEN_DIR", "MINARI_DATASETS_PATH"):
        assert name in exported and "mktemp -d" in before, name
