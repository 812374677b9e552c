"""omni data librispeech: a LibriSpeech-layout tree -> (audio, transcript) shards; what cannot be used is skipped,
one warning line each, and counted in the manifest; nothing usable is a one-line error."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import webdataset as wds

from omni.cli import main as cli_main
from omni.data import shards as sh
from omni.data.builders_speech import audio_info, build_librispeech
from tests._librispeech import write_tree


def samples(out: Path, split: str) -> dict[str, dict]:
    return {s["__key__"]: s for s in wds.WebDataset(sh.shard_urls(out, split), shardshuffle=False, empty_check=False)}


def test_subsets_renamed_and_merged(tmp_path: Path) -> None:
    root = tmp_path / "LibriSpeech"
    expected = write_tree(root, {"train-clean-5": (19, 26), "train-other-5": (40,), "dev-clean-2": (84,)})
    m = build_librispeech(tmp_path / "out", src=root, rename={"train-clean-5": "train", "train-other-5": "train",
                                                              "dev-clean-2": "test"}, quiet=True)
    assert {k: v["count"] for k, v in m["splits"].items()} == {"train": 6, "test": 2}
    assert m["skipped"] == {} and m["skipped_files"] == []
    for split, subsets in (("train", {"train-clean-5", "train-other-5"}), ("test", {"dev-clean-2"})):
        got = samples(tmp_path / "out", split)
        assert {expected[k][0] for k in got} == subsets
        for key, s in got.items():
            assert s["txt"].decode() == expected[key][1]  # upper case, as written
            assert s["flac"] == next(root.rglob(f"{key}.flac")).read_bytes()
            assert json.loads(s["json"])["speaker"] == key.split("-")[0]
    with pytest.raises(ValueError, match=r"rename names subset folder\(s\) test-clean .*subsets: dev-clean-2"):
        build_librispeech(tmp_path / "bad", src=root, rename={"test-clean": "test"}, quiet=True)


def break_tree(root: Path) -> dict[str, str]:
    """Every problem the builder skips, once each, in one chapter of speaker 19; -> {path fragment: reason}."""
    chapter = root / "train-clean-5" / "19" / "121"
    trans = chapter / "19-121.trans.txt"
    (chapter / "19-121-0000.flac").unlink()  # named by line 1, missing
    (chapter / "19-121-0001.flac").write_bytes(b"this is not a flac file" * 20)
    flac = (root / "train-clean-5" / "26" / "121" / "26-121-0000.flac").read_bytes()
    (chapter / "19-121-0002.flac").write_bytes(flac[: len(flac) // 2])  # truncated: header intact
    (chapter / "19-121-0003.flac").write_bytes(flac)  # a file no line names
    (chapter / "19-121-0004.flac").write_bytes(flac)
    lines = trans.read_text().splitlines() + ["19-121-0002 A TRUNCATED CLIP", "19-121-0004", "19-121-0001 AGAIN"]
    trans.write_text("\n".join(lines) + "\n")
    return {"19-121.trans.txt:1": "audio .*19-121-0000.flac not found",
            "19-121-0001.flac": "not readable audio",
            "19-121-0002.flac": "the audio ends before its header says|not readable audio",
            "19-121-0003.flac": "no transcript line names it",
            "19-121.trans.txt:4": "utterance 19-121-0004 has an empty transcript",
            "19-121.trans.txt:5": "utterance id 19-121-0001 repeats in split 'train-clean-5'"}


def test_bad_items_skipped_one_line_each(tmp_path: Path) -> None:
    root = tmp_path / "LibriSpeech"
    expected = write_tree(root, {"train-clean-5": (19, 26)}, utterances=2)
    reasons = break_tree(root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = build_librispeech(tmp_path / "out", src=root, quiet=True)
    lines = [str(w.message) for w in caught]
    assert all("\n" not in line for line in lines)
    for where, reason in reasons.items():
        hits = [line for line in lines if where in line]
        assert len(hits) == 1, (where, lines)
        assert re.search(reason, hits[0]), (hits[0], reason)
    assert lines[-1].endswith("6 item(s) skipped (1 audio not found, 1 empty transcript, 1 no transcript, "
                              "1 repeated id, 2 unreadable audio), 2 utterances kept")
    assert m["skipped"] == {"audio not found": 1, "unreadable audio": 2, "no transcript": 1, "empty transcript": 1,
                            "repeated id": 1}
    assert len(m["skipped_files"]) == 6
    kept = samples(tmp_path / "out", "train-clean-5")
    assert set(kept) == {"26-121-0000", "26-121-0001"}
    assert all(kept[k]["txt"].decode() == expected[k][1] for k in kept)
    # the same input again: up to date, nothing re-read, nothing warned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build_librispeech(tmp_path / "out", src=root, quiet=True)["skipped"] == m["skipped"]
    assert not caught


def test_audio_info_checks_the_end_of_the_stream(tmp_path: Path) -> None:
    root = tmp_path / "LibriSpeech"
    write_tree(root, {"dev": (84,)}, utterances=1)
    flac = next(root.rglob("*.flac"))
    assert audio_info(flac).frames == int(0.4 * 16000)
    data = flac.read_bytes()
    (tmp_path / "half.flac").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not readable audio|ends before"):
        audio_info(tmp_path / "half.flac")


def test_cli_warns_per_item_and_fails_when_nothing_is_left(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "LibriSpeech"
    write_tree(root, {"train-clean-5": (19, 26)}, utterances=2)
    break_tree(root)
    out = tmp_path / "out"
    with warnings.catch_warnings(record=True) as caught:  # printed as "omni data librispeech: warning: ..."
        warnings.simplefilter("always")
        assert cli_main(["data", "librispeech", "--src", str(root), "--out", str(out), "--quiet",
                         "--rename", "train-clean-5=train"]) == 0
    lines = [str(w.message) for w in caught]
    assert len(lines) == 7 and all("\n" not in line and "skipped" in line for line in lines), lines
    assert sh.read_manifest(out)["splits"]["train"]["count"] == 2
    # nothing usable: one error line, exit 2
    for flac in (root / "train-clean-5" / "26").rglob("*.flac"):
        flac.write_bytes(b"junk")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli_main(["data", "librispeech", "--src", str(root), "--out", str(tmp_path / "none"), "--quiet"]) == 2
    assert len(caught) == 8  # each item still named before the error
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("omni data librispeech: error: ") and "no usable utterances (8 skipped" in err[-1]
    assert not (tmp_path / "none" / "manifest.json").exists()
    # a bad --rename is an argument error
    assert cli_main(["data", "librispeech", "--src", str(root), "--out", str(out), "--rename", "train-clean-5"]) == 2
    assert "expected SUBSET=SPLIT" in capsys.readouterr().err
