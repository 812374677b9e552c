"""Issue 29: one reader for every text corpus (``omni data text``, the BPE fit, a recipe's ``text=``, synthesised
speech): UTF-8 text only, folders read as their text files, the janeaustenr folder as the novels, and an empty
``text=[]`` refused rather than read as the default corpus."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_janeaustenr

from omni.recipe_runtime import check_corpus
from omni.data.builders_speech import load_paragraphs
from omni.data.builders_text import build_text, expand_inputs, fit_tokenizer, read_text_file

ROOT = Path(__file__).resolve().parents[1]


def binary(path: Path) -> Path:
    path.write_bytes(bytes(range(256)) * 8)  # a NUL byte first: what an image or a model file looks like
    return path


def test_read_text_file_takes_utf8_text_and_refuses_binary(tmp_path):
    good = tmp_path / "good.txt"
    good.write_bytes("\ufeffOne line.\r\nTwo lines.\rThree.\n".encode())
    assert read_text_file(good) == "One line.\nTwo lines.\nThree.\n"  # as open() reads it, BOM dropped
    with pytest.raises(ValueError) as err:
        read_text_file(binary(tmp_path / "weights.bin"))
    assert str(err.value) == f"{tmp_path / 'weights.bin'}: not a text file (a NUL byte at offset 0: binary data); " \
                             "give UTF-8 text files"
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(ValueError) as err:
        read_text_file(latin1)
    assert str(err.value) == f"{latin1}: not UTF-8 text (byte 0xe9 at offset 3); give UTF-8 text files"


def test_a_binary_file_is_refused_alike_by_every_reader(tmp_path):
    """`omni data text` refused it, the recipes' corpus (load_paragraphs) trained on it as replacement
    characters: the same line from both now, and from the BPE fit."""
    bad = binary(tmp_path / "model.safetensors")
    message = f"{bad}: not a text file (a NUL byte at offset 0: binary data); give UTF-8 text files"
    for read in (lambda: build_text(tmp_path / "out", src=[bad], quiet=True), lambda: load_paragraphs([str(bad)]),
                 lambda: fit_tokenizer([bad], tmp_path / "tok")):
        with pytest.raises(ValueError) as err:
            read()
        assert str(err.value) == message
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_folder_of_text_files_is_read_as_its_files_and_the_r_package_as_the_novels(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("Second file, first paragraph.\n\nSecond paragraph\nover two lines.\n")
    (folder / "sub" / "a.md").write_text("Nested file.\n")
    (folder / "notes.bin").write_bytes(b"\0\1")  # not a text suffix: not read
    paragraphs, name = load_paragraphs([str(folder)])
    assert paragraphs == ["Second file, first paragraph.", "Second paragraph over two lines.", "Nested file."]
    assert name == "b.txt + a.md"
    r_lib = tmp_path / "site-library"
    write_janeaustenr(r_lib / "janeaustenr", {"emma": ["EMMA", "", "Emma Woodhouse, handsome,", "clever."]})
    paragraphs, name = load_paragraphs([str(r_lib)])
    assert paragraphs == ["EMMA", "Emma Woodhouse, handsome, clever."] and name.startswith("Jane Austen")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no \.txt/\.text/\.md files inside$"):
        load_paragraphs([str(empty)])


def test_check_corpus_refuses_an_empty_list_and_folders_without_text():
    with pytest.raises(ValueError, match=r"^text is an empty list: give text files or folders"):
        check_corpus([])
    with pytest.raises(FileNotFoundError, match=r"^text: /nowhere/x.txt: no such file or folder$"):
        check_corpus(["/nowhere/x.txt"])


def test_check_corpus_names_a_folder_without_text(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(b"\x89PNG")
    with pytest.raises(FileNotFoundError) as err:
        check_corpus([str(tmp_path / "images")])
    assert str(err.value) == f"text: {tmp_path / 'images'}: no .txt/.text/.md files inside"
    assert expand_inputs([tmp_path / "images" / "a.png"]) == [tmp_path / "images" / "a.png"]  # a file as given


def test_omni_data_text_refuses_a_bad_seed_in_one_line(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("Some text.\n")
    for seed in (-1, 2**31, True):
        with pytest.raises(ValueError, match=rf"^seed must be an integer in \[0, 2147483647\], got {seed!r}$"):
            build_text(tmp_path / "out", src=[src], seed=seed, quiet=True)


def test_the_lm_recipe_refuses_a_binary_corpus_in_one_line(tmp_path):
    """As a user runs it (text=[] is refused at parsing: tests/test_recipe_config.py)."""
    bad = binary(tmp_path / "photo.jpg")
    proc = subprocess.run([sys.executable, "recipes/lm.py", "--preset", "tiny", "--out", str(tmp_path / "run"),
                           "--set", f"text=[{str(bad)!r}]"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == \
        f"recipes/lm.py: error: {bad}: not a text file (a NUL byte at offset 0: binary data); give UTF-8 text files"
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
