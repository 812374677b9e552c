"""Builders for data users already hold: `omni data hf` (datasets save_to_disk folders, parquet / arrow files,
written here by the real `datasets` library) and `omni data audio` (audio + metadata.csv / Common Voice TSV /
NeMo JSONL). Shards read back by ShardLoader equal the source rows; bad rows are skipped one warning each and
counted; a wrong column is one line listing the columns; recipes/vit.py trains on an hf-built dataset."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omni.cli import main as cli_main
from omni.data.builders_hf import build_hf, find_source
from omni.data.builders_manifest import build_audio_manifest
from omni.data.reader import ShardLoader

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets.disable_progress_bars()  # its bars go to stderr, where the CLI's one error line is checked

ROOT = Path(__file__).resolve().parents[1]
RATE = 16000


def image_bytes(value: int, fmt: str = "PNG", size: int = 28) -> bytes:
    pixels = (np.arange(size * size).reshape(size, size) * 7 + value * 29) % 256
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), mode="L").save(buf, format=fmt)
    return buf.getvalue()


def tone(i: int, n: int = 800) -> np.ndarray:
    """int16 samples of a short tone, distinct per i (exact through 16-bit WAV / FLAC)."""
    t = np.arange(n) / RATE
    return (np.sin(2 * np.pi * (200 + 50 * i) * t) * 8000).astype(np.int16)


def audio_bytes(i: int, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, tone(i), RATE, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def _raw(sample: dict) -> dict:
    return sample


def read_back(out: Path, split: str) -> dict[str, dict]:
    """{source split/row or id: raw sample} of a split, read with ShardLoader as the recipes read it."""
    loader = ShardLoader(out, _raw, list, batch_size=1000, split=split, rank=0, world_size=1, shuffle=False)
    rows = [s for batch in loader for s in batch][: loader.num_samples]
    assert len(rows) == loader.num_samples
    return {json.loads(s["json"]).get("id") or f"{json.loads(s['json'])['split']}[{json.loads(s['json'])['row']}]": s
            for s in rows}


def warned(call) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught]


# -- omni data hf -----------------------------------------------------------------------------------
def image_dataset_dict(root: Path) -> tuple[Path, dict[str, list[tuple[bytes | None, int]]]]:
    """A DatasetDict (train + test) of Image + ClassLabel rows, saved with save_to_disk; train holds two bad
    rows: bytes that are no image, an unlabelled row (-1)."""
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["circle", "square", "star"])})
    rows = {
        "train": [(image_bytes(i, "JPEG" if i == 1 else "PNG"), i % 3) for i in range(6)]
                 + [(b"\x89PNG\r\n\x1a\n cut short", 0), (image_bytes(9), -1)],
        "test": [(image_bytes(10 + i), i % 3) for i in range(3)],
    }  # fmt: skip
    dd = datasets.DatasetDict({
        split: datasets.Dataset.from_dict(
            {"image": [{"bytes": b, "path": None} for b, _ in items],
             "label": [lbl for _, lbl in items]}, features=features)
        for split, items in rows.items()
    })  # fmt: skip
    dd.save_to_disk(str(root))
    return root, rows


def test_save_to_disk_dataset_dict_images(tmp_path: Path) -> None:
    src, rows = image_dataset_dict(tmp_path / "hf")
    out = tmp_path / "out"
    m, lines = warned(lambda: build_hf(out, src=src, quiet=True))
    assert m["kind"] == "images" and m["classes"] == ["circle", "square", "star"]
    assert {k: v["count"] for k, v in m["splits"].items()} == {"train": 6, "test": 3}
    assert m["skipped"] == {"unreadable image": 1, "no label": 1}
    assert [r["row"] for r in m["skipped_rows"]] == ["train[6]", "train[7]"]
    # one line per bad row, naming it, then the summary
    assert len(lines) == 3 and all("\n" not in line for line in lines)
    assert lines[0].startswith("train[6]: not a complete image") and lines[1].startswith("train[7]: label -1")
    assert lines[2] == f"{src}: 2 row(s) skipped (1 no label, 1 unreadable image), 9 kept"
    assert m["split_stats"]["train"]["class_counts"] == [2, 2, 2]
    for split, n in (("train", 6), ("test", 3)):
        got = read_back(out, split)
        assert sorted(got) == sorted(f"{split}[{i}]" for i in range(n))
        for i, (data, label) in enumerate(rows[split][:n]):
            s = got[f"{split}[{i}]"]
            ext = "jpg" if i == 1 and split == "train" else "png"  # by content: the JPEG row stays a JPEG
            assert s[ext] == data and int(s["cls"]) == label
    # the shards are in a seeded shuffled order, the same on a rebuild; unchanged source: up to date
    keys = list(read_back(out, "train"))
    assert keys != sorted(keys, key=lambda k: int(k.split("[")[1][:-1]))
    again, lines = warned(lambda: build_hf(out, src=src, quiet=True))
    assert again["created"] == m["created"] and not lines


def test_features_class_names_single_dataset_holdout_and_rename(tmp_path: Path) -> None:
    """A Dataset (not a dict) is one split; --val-fraction holds a seeded share out; class names come from the
    arrow schema's "huggingface" metadata when there is no dataset_info.json (parquet); string labels sort."""
    features = datasets.Features({"img": datasets.Image(), "labels": datasets.ClassLabel(names=["b", "a"])})
    ds = datasets.Dataset.from_dict({"img": [{"bytes": image_bytes(i, "BMP"), "path": None} for i in range(10)],
                                     "labels": [i % 2 for i in range(10)]}, features=features)
    ds.save_to_disk(str(tmp_path / "one"), num_shards=2)  # two arrow files, read as one split
    assert len(list((tmp_path / "one").glob("*.arrow"))) == 2
    m = build_hf(tmp_path / "o1", src=tmp_path / "one", val_fraction=0.3, quiet=True)
    assert m["classes"] == ["b", "a"] and {k: v["count"] for k, v in m["splits"].items()} == {"train": 7, "val": 3}
    both = {**read_back(tmp_path / "o1", "train"), **read_back(tmp_path / "o1", "val")}
    assert sorted(both, key=lambda k: int(k.split("[")[1][:-1])) == [f"train[{i}]" for i in range(10)]
    for key, s in both.items():  # BMP is re-encoded as PNG, pixel for pixel
        i = int(key.split("[")[1][:-1])
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(s["png"]))), np.asarray(Image.open(io.BytesIO(image_bytes(i, "BMP")))))
        assert int(s["cls"]) == i % 2

    ds.to_parquet(str(tmp_path / "pq" / "data" / "validation-00000-of-00001.parquet"))
    ds.to_parquet(str(tmp_path / "pq" / "data" / "train-00000-of-00001.parquet"))
    assert set(find_source(tmp_path / "pq").splits) == {"train", "validation"}
    m = build_hf(tmp_path / "o2", src=tmp_path / "pq", rename={"validation": "val"}, quiet=True)
    assert m["classes"] == ["b", "a"] and set(m["splits"]) == {"train", "val"}
    assert sorted(read_back(tmp_path / "o2", "val")) == sorted(f"validation[{i}]" for i in range(10))
    # a glob of parquet files written by another tool: string labels (classes: the sorted strings), images by
    # path relative to the parquet's folder, one of them missing
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(image_bytes(5))
    table = pa.table({"image": [{"bytes": image_bytes(i), "path": None} for i in range(4)]
                      + [{"bytes": None, "path": "imgs/a.png"}, {"bytes": None, "path": "imgs/gone.png"}],
                      "label": ["dog", "cat", "dog", "emu", "cat", "cat"]})  # fmt: skip
    pq.write_table(table, tmp_path / "plain-0.parquet", row_group_size=2)  # read a row group at a time
    m, lines = warned(lambda: build_hf(tmp_path / "o3", src=str(tmp_path / "plain-*.parquet"), quiet=True))
    assert m["classes"] == ["cat", "dog", "emu"] and m["skipped"] == {"image not found": 1}
    assert lines[0] == f"train[5]: image file {tmp_path / 'imgs' / 'gone.png'} not found; skipped"
    got = read_back(tmp_path / "o3", "train")
    assert sorted(int(s["cls"]) for s in got.values()) == [0, 0, 1, 1, 2]
    assert got["train[4]"]["png"] == image_bytes(5)
    # the parquet spilled to arrow went with the staging folder
    assert sorted(p.name for p in (tmp_path / "o3").iterdir()) == [".omni.lock", "manifest.json", "train-000000.tar"]


def test_parquet_and_arrow_speech(tmp_path: Path) -> None:
    """Audio + transcript rows: Audio-feature bytes (WAV kept as is), a decoded {array, sampling_rate} column
    (as 16-bit FLAC, exact for 16-bit samples); bad rows: empty transcript, undecodable audio, repeated id."""
    n = 5
    ds = datasets.Dataset.from_dict({
        "audio": [{"bytes": audio_bytes(i), "path": f"c{i}.wav"} for i in range(n)] + [{"bytes": b"RIFF junk", "path": "x.wav"}],
        "sentence": [f"clip number {i}" for i in range(n)] + ["broken"],
        "id": [f"u{i}" for i in range(n)] + ["u9"],
    }).cast_column("audio", datasets.Audio(sampling_rate=RATE))  # fmt: skip
    extra = datasets.Dataset.from_dict({"audio": [{"bytes": audio_bytes(0), "path": "d.wav"}] * 2,
                                        "sentence": ["   ", "again"], "id": ["u7", "u0"]}
                                       ).cast_column("audio", datasets.Audio(sampling_rate=RATE))  # fmt: skip
    datasets.concatenate_datasets([ds, extra]).to_parquet(str(tmp_path / "sp" / "train.parquet"))
    m, lines = warned(lambda: build_hf(tmp_path / "out", src=tmp_path / "sp", quiet=True))
    assert m["kind"] == "speech" and m["columns"] == {"audio": "audio", "text": "sentence", "id": "id"}
    assert m["skipped"] == {"unreadable audio": 1, "empty text": 1, "repeated id": 1}, m["skipped_rows"]
    assert [r["row"] for r in m["skipped_rows"]] == ["train[5]", "train[6]", "train[7]"] and len(lines) == 4
    assert "id 'u0' repeats" in lines[2]
    train = read_back(tmp_path / "out", "train")
    assert sorted(train) == [f"u{i}" for i in range(n)]
    for i in range(n):
        s = train[f"u{i}"]
        assert s["wav"] == audio_bytes(i) and s["txt"].decode() == f"clip number {i}"
        meta = json.loads(s["json"])
        assert meta["sample_rate"] == RATE and meta["duration"] == 0.05
    assert m["split_stats"]["train"]["hours"] == round(n * 0.05 / 3600, 4)


def test_decoded_arrays_as_flac(tmp_path: Path) -> None:
    arrays = pa.table({"audio": [{"array": (tone(7 + i) / 32768.0).tolist(), "sampling_rate": RATE} for i in range(2)],
                       "text": ["first test", "second test"]})  # fmt: skip
    pq.write_table(arrays, tmp_path / "test.parquet")
    m = build_hf(tmp_path / "out", src=tmp_path / "test.parquet", quiet=True)
    assert m["kind"] == "speech" and set(m["splits"]) == {"test"}
    got = read_back(tmp_path / "out", "test")
    for i in range(2):
        s = got[f"test[{i}]"]
        wave, rate = sf.read(io.BytesIO(s["flac"]), dtype="int16")
        assert rate == RATE and np.array_equal(wave, tone(7 + i))
        assert s["txt"].decode() == ["first test", "second test"][i]


def test_text_only_dataset_is_an_lm_corpus(tmp_path: Path) -> None:
    from omni.data.builders_text import iter_documents

    texts = ["A first paragraph of words.", "", "Second one,\n\nwith two paragraphs.", "Third."]
    datasets.Dataset.from_dict({"text": texts, "label": [0, 1, 0, 1]}).save_to_disk(str(tmp_path / "t"))
    m, lines = warned(lambda: build_hf(tmp_path / "out", src=tmp_path / "t", quiet=True))
    assert m["kind"] == "text" and "classes" not in m and m["skipped"] == {"empty text": 1} and len(lines) == 2
    docs = sorted(text for _, text in iter_documents([tmp_path / "out"]))
    assert docs == sorted(t for t in texts if t)


def test_wrong_column_is_one_line_listing_the_columns(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src, _ = image_dataset_dict(tmp_path / "hf")
    assert cli_main(["data", "hf", str(src), "--out", str(tmp_path / "o"), "--image-column", "picture", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"omni data hf: error: {src}: no column 'picture' (--image-column); its columns: image, label"]
    pq.write_table(pa.table({"pixels": [b"x"], "y": [1]}), tmp_path / "odd.parquet")
    assert cli_main(["data", "hf", str(tmp_path / "odd.parquet"), "--out", str(tmp_path / "o"), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("its columns: pixels, y") and "no image, audio or text column" in err[0]
    pq.write_table(pa.table({"image": [b"x"], "tags": [[1, 2]]}), tmp_path / "multi.parquet")
    assert cli_main(["data", "hf", str(tmp_path / "multi.parquet"), "--out", str(tmp_path / "o"), "--label-column",
                     "tags", "-q"]) == 2  # fmt: skip
    assert "label column 'tags' holds list<" in capsys.readouterr().err
    assert not (tmp_path / "o" / "manifest.json").exists()
    # the CLI builds what the function builds
    _, lines = warned(lambda: cli_main(["data", "hf", str(src), "--out", str(tmp_path / "cli"), "-q"]))
    assert lines[0] == "train[6]: not a complete image (UnidentifiedImageError: cannot identify image file the bytes); skipped"
    assert json.loads((tmp_path / "cli" / "manifest.json").read_text())["splits"]["train"]["count"] == 6


# -- omni data audio ----------------------------------------------------------------------------------
def test_audio_manifests_csv_tsv_jsonl(tmp_path: Path) -> None:
    # audiofolder: metadata.csv beside the files, file_name + transcription
    af = tmp_path / "af"
    (af / "sub").mkdir(parents=True)
    for i in range(4):
        (af / "sub" / f"{i}.wav").write_bytes(audio_bytes(i))
    (af / "bad.wav").write_bytes(b"RIFF....WAVEnot audio at all")
    (af / "metadata.csv").write_text(
        "file_name,transcription\n"
        + "".join(f'sub/{i}.wav,"hello, number {i}"\n' for i in range(4))
        + "missing.wav,gone\nsub/1.wav,again\nsub/2.wav,\nbad.wav,bad audio\n")
    m, lines = warned(lambda: build_audio_manifest(tmp_path / "o_af", manifest=[af / "metadata.csv"], val_fraction=0.25, quiet=True))
    assert {k: v["count"] for k, v in m["splits"].items()} == {"train": 3, "val": 1}
    assert m["skipped"] == {"audio not found": 1, "repeated id": 1, "empty text": 1, "unreadable audio": 1}
    assert [f["path"] for f in m["skipped_files"]][:3] == [f"{af / 'metadata.csv'}:{n}" for n in (6, 7, 8)]
    assert len(lines) == 5 and all("\n" not in line for line in lines)
    got = {**read_back(tmp_path / "o_af", "train"), **read_back(tmp_path / "o_af", "val")}
    assert sorted(got) == [f"sub/{i}.wav" for i in range(4)]
    for i in range(4):
        assert got[f"sub/{i}.wav"]["wav"] == audio_bytes(i)
        assert got[f"sub/{i}.wav"]["txt"].decode() == f"hello, number {i}"

    # audiofolder with split folders: train/metadata.csv + test/metadata.csv, --rename test=eval
    for split, n in (("train", 3), ("test", 2)):
        (af / split).mkdir()
        for i in range(n):
            (af / split / f"{i}.flac").write_bytes(audio_bytes(i, "FLAC"))
        (af / split / "metadata.csv").write_text("file_name,text\n" + "".join(f"{i}.flac,{split} {i}\n" for i in range(n)))
    m = build_audio_manifest(tmp_path / "o_split", manifest=[af / "train" / "metadata.csv", af / "test" / "metadata.csv"],
                             rename={"test": "eval"}, quiet=True)  # fmt: skip
    assert {k: v["count"] for k, v in m["splits"].items()} == {"train": 3, "eval": 2}
    assert {s["txt"].decode() for s in read_back(tmp_path / "o_split", "eval").values()} == {"test 0", "test 1"}

    # Common Voice: train.tsv + test.tsv, audio in clips/, a quote in a sentence that csv must not eat
    cv = tmp_path / "cv"
    (cv / "clips").mkdir(parents=True)
    for i in range(3):
        (cv / "clips" / f"common_voice_{i}.flac").write_bytes(audio_bytes(i, "FLAC"))
    head = "client_id\tpath\tsentence\tup_votes\n"
    (cv / "train.tsv").write_text(head + "".join(f'c\tcommon_voice_{i}.flac\tsaid "hi" {i}\t2\n' for i in range(2)))
    (cv / "test.tsv").write_text(head + "c\tcommon_voice_2.flac\tthe test\t2\nc\tcommon_voice_0.flac\tleak\t1\n")
    m, lines = warned(lambda: build_audio_manifest(tmp_path / "o_cv", manifest=[cv / "train.tsv", cv / "test.tsv"], quiet=True))
    assert {k: v["count"] for k, v in m["splits"].items()} == {"train": 2, "test": 1}
    assert m["skipped"] == {"repeated id": 1} and "already named at" in lines[0]
    train = read_back(tmp_path / "o_cv", "train")
    assert train["common_voice_1.flac"]["txt"].decode() == 'said "hi" 1'
    assert train["common_voice_1.flac"]["flac"] == audio_bytes(1, "FLAC")

    # NeMo JSONL: audio_filepath (absolute here) + text + duration
    nemo = tmp_path / "nemo.jsonl"
    nemo.write_text("".join(json.dumps({"audio_filepath": str(af / "sub" / f"{i}.wav"), "text": f"n {i}",
                                        "duration": 0.05}) + "\n" for i in range(2)))  # fmt: skip
    m = build_audio_manifest(tmp_path / "o_nemo", manifest=[nemo], split="dev", quiet=True)
    got = read_back(tmp_path / "o_nemo", "dev")
    assert m["kind"] == "speech" and len(got) == 2
    assert {s["txt"].decode() for s in got.values()} == {"n 0", "n 1"}


def test_audio_cli_wrong_column_and_nothing_left(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "m.csv").write_text("wav,words\na.wav,hi\n")
    assert cli_main(["data", "audio", "--manifest", str(tmp_path / "m.csv"), "--out", str(tmp_path / "o"), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [(f"omni data audio: error: {tmp_path / 'm.csv'}: no audio file column (looked for file_name, "
                    "audio_filepath, path, file, filename, audio, audio_path; name it with --audio-column); its "
                    "columns: wav, words")]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert cli_main(["data", "audio", "--manifest", str(tmp_path / "m.csv"), "--out", str(tmp_path / "o"), "-q",
                         "--audio-column", "wav", "--text-column", "words"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("omni data audio: error: ") and "no usable rows (1 skipped: 1 audio not found)" in err[-1]
    (tmp_path / "a.wav").write_bytes(audio_bytes(3))
    assert cli_main(["data", "audio", "--manifest", str(tmp_path / "m.csv"), "--out", str(tmp_path / "o"), "-q",
                     "--audio-column", "wav", "--text-column", "words"]) == 0  # fmt: skip
    assert read_back(tmp_path / "o", "train")["a.wav"]["txt"] == b"hi"


# -- a recipe trains on it ------------------------------------------------------------------------------
def test_vit_recipe_trains_on_an_hf_dataset(tmp_path: Path) -> None:
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["dark", "light"])})
    rows = {s: datasets.Dataset.from_dict({"image": [{"bytes": image_bytes(40 * (i % 2) + i, "PNG"), "path": None}
                                                     for i in range(n)], "label": [i % 2 for i in range(n)]},
                                          features=features) for s, n in (("train", 16), ("test", 8))}  # fmt: skip
    datasets.DatasetDict(rows).save_to_disk(str(tmp_path / "hf"))
    build_hf(tmp_path / "data", src=tmp_path / "hf", quiet=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "vit.py"), "--preset", "tiny", "--data", str(tmp_path / "data"),
         "--out", str(tmp_path / "run"), "--set", "steps=2", "batch_size=8", "progress=False", "workers=0"],
        check=False, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert "dark" in json.dumps(config) and "light" in json.dumps(config)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_whisper_recipe_trains_on_a_common_voice_layout(tmp_path: Path) -> None:
    cv = tmp_path / "cv"
    (cv / "clips").mkdir(parents=True)
    for split, n in (("train", 8), ("test", 4)):
        for i in range(n):
            (cv / "clips" / f"{split}{i}.flac").write_bytes(audio_bytes(i, "FLAC"))
        (cv / f"{split}.tsv").write_text("client_id\tpath\tsentence\n"
                                         + "".join(f"c\t{split}{i}.flac\thello number {i}\n" for i in range(n)))
    assert cli_main(["data", "audio", "--manifest", str(cv / "train.tsv"), str(cv / "test.tsv"), "--out",
                     str(tmp_path / "data"), "-q"]) == 0  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "whisper.py"), "--preset", "tiny", "--data", str(tmp_path / "data"),
         "--out", str(tmp_path / "run"), "--set", "steps=2", "batch_size=4", "progress=False"],
        check=False, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 steps (2 per epoch)" in proc.stdout and "test WER" in proc.stdout, proc.stdout
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
