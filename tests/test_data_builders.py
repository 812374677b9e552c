"""Dataset builders: tiny inputs made in the test -> shards + manifest, read back with webdataset."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from omni.data import shards as sh
from omni.data.builders_rl import build_gym, build_minari, episode_npz, mix_counts, parse_mix
from omni.data.builders_speech import build_librispeech, build_speech_synth
from omni.data.builders_text import build_text, chunk_text
from omni.data.builders_vision import FASHION_MNIST_CLASSES, build_fashion_mnist, build_images
from omni.cli import main as cli_main
from omni.lock import LOCK_NAME, DirectoryLock, LockedError
from omni.data.speech import clean_sentence, extract_sentences, resample, sentence_key, split_sentences


# -- helpers ----------------------------------------------------------------------------------------
def read_split(out: Path, split: str) -> list[dict]:
    urls = sh.shard_urls(out, split)
    return list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))


def check_manifest(out: Path, counts: dict[str, int]) -> dict:
    m = sh.read_manifest(out)
    assert m["format_version"] == sh.FORMAT_VERSION
    assert {k: v["count"] for k, v in m["splits"].items()} == counts
    for split in m["splits"].values():
        assert sum(s["count"] for s in split["shards"]) == split["count"]
        for s in split["shards"]:
            data = (out / s["name"]).read_bytes()
            assert len(data) == s["bytes"]
            assert hashlib.sha256(data).hexdigest() == s["sha256"]
    assert not list(out.glob("*.tmp"))
    return m


def mtimes(out: Path) -> dict[str, int]:
    """Modification times of the dataset's files (the build lock's holder record changes on every run)."""
    return {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != LOCK_NAME}


def write_idx(path: Path, arr: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    path.write_bytes(gzip.compress(header + arr.astype(np.uint8).tobytes()))


@pytest.fixture
def idx_dir(tmp_path: Path) -> Path:
    d = tmp_path / "idx"
    d.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 7), ("t10k", 3)):
        write_idx(d / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(d / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    return d


# -- shards -----------------------------------------------------------------------------------------
def test_shard_writer_splits_and_validates(tmp_path: Path) -> None:
    build = sh.Build(tmp_path / "ds", "unit", {"a": 1}, shard_size=2, quiet=True)
    build.start()
    with build.split("train", total=5) as w:
        for i in range(5):
            w.write({"__key__": f"s{i}", "txt": f"hello {i}", "cls": i, "json": {"i": i}})
        with pytest.raises(ValueError, match="no dots"):
            w.write({"__key__": "a.b", "txt": "x"})
        with pytest.raises(ValueError, match="repeats"):
            w.write({"__key__": "s4", "txt": "x"})
    m = build.finish(extra_field=[1, 2])
    check_manifest(tmp_path / "ds", {"train": 5})
    assert [s["count"] for s in m["splits"]["train"]["shards"]] == [2, 2, 1]
    assert m["extra_field"] == [1, 2] and m["args"] == {"a": 1, "shard_size": 2}
    got = read_split(tmp_path / "ds", "train")
    assert [g["__key__"] for g in got] == [f"s{i}" for i in range(5)]
    assert [int(g["cls"]) for g in got] == list(range(5))
    assert json.loads(got[3]["json"]) == {"i": 3}
    # fixed tar metadata: identical content gives identical bytes
    with tarfile.open(tmp_path / "ds" / "train-000000.tar") as t:
        assert {m.mtime for m in t.getmembers()} == {0}


def test_readers_only_trust_the_manifest(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    with pytest.raises(sh.DatasetError, match="manifest.json not found"):
        sh.read_manifest(out)
    build = sh.Build(out, "unit", {}, shard_size=10, quiet=True)
    build.start()
    with build.split("train") as w:
        w.write({"__key__": "k", "txt": "x"})
    build.finish()
    with pytest.raises(sh.DatasetError, match="no split 'test'; available: train"):
        sh.shard_urls(out, "test")
    shard = out / "train-000000.tar"
    shard.write_bytes(shard.read_bytes() + b"\0" * 512)
    with pytest.raises(sh.DatasetError, match=r"train-000000\.tar has \d+ bytes but the manifest says \d+"):
        sh.shard_urls(out, "train")
    shard.unlink()
    with pytest.raises(sh.DatasetError, match=r"train-000000\.tar is listed in the manifest but missing"):
        sh.shard_urls(out, "train")


def test_writer_exception_leaves_no_temp(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with sh.Build(tmp_path, "unit", {}, shard_size=10, quiet=True) as build:
            build.start()
            with build.split("train") as w:
                w.write({"__key__": "a", "txt": "x"})
                raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]  # no shard, temp file or staging folder


# -- fashion-mnist ----------------------------------------------------------------------------------
def test_fashion_mnist_png_idempotent_and_rebuilt_after_interruption(
    idx_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "fm"
    m = build_fashion_mnist(out, source=idx_dir, shard_size=3)
    check_manifest(out, {"train": 7, "test": 3})
    assert m["classes"] == list(FASHION_MNIST_CLASSES) and m["classes"][9] == "Ankle boot"
    assert [s["name"] for s in m["splits"]["train"]["shards"]] == ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    images = gzip.decompress((idx_dir / "train-images-idx3-ubyte.gz").read_bytes())[16:]
    expected = np.frombuffer(images, np.uint8).reshape(7, 28, 28)
    from PIL import Image

    got = read_split(out, "train")
    for i, s in enumerate(got):
        assert s["__key__"] == f"train_{i:06d}"
        assert int(s["cls"]) == i % 10
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(s["png"]))), expected[i])

    before = mtimes(out)
    capsys.readouterr()
    build_fashion_mnist(out, source=idx_dir, shard_size=3)
    assert "up to date" in capsys.readouterr().out
    assert mtimes(out) == before

    # interrupted build: a temp shard and no manifest -> cleaned and rebuilt
    (out / "manifest.json").unlink()
    (out / "train-000003.tar.tmp").write_bytes(b"partial")
    build_fashion_mnist(out, source=idx_dir, shard_size=3)
    check_manifest(out, {"train": 7, "test": 3})
    assert not (out / "train-000003.tar.tmp").exists()

    # other arguments -> rebuilt with the new layout, old shards removed
    build_fashion_mnist(out, source=idx_dir, shard_size=5, format="raw")
    m = check_manifest(out, {"train": 7, "test": 3})
    assert sorted(p.name for p in out.glob("*.tar")) == ["test-000000.tar", "train-000000.tar", "train-000001.tar"]
    raw = read_split(out, "train")[2]["u8"]
    assert len(raw) == 784 and raw == expected[2].tobytes()


def test_fashion_mnist_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.error

    from omni.data import builders_vision

    with pytest.raises(FileNotFoundError, match="lacks the Fashion-MNIST IDX files"):
        build_fashion_mnist(tmp_path / "o", source=tmp_path)
    with pytest.raises(ValueError, match="format must be"):
        build_fashion_mnist(tmp_path / "o", source=tmp_path, format="jpeg")
    # no Debian package, no network, a download asked for: the message says what to install instead
    monkeypatch.setenv("OMNI_FASHION_MNIST_DIR", str(tmp_path / "nowhere"))

    def offline(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(builders_vision.urllib.request, "urlopen", offline)
    with pytest.raises(FileNotFoundError, match=r"download failed .*nowhere.*apt-get install dataset-fashion-mnist"
                                                r".*OMNI_FASHION_MNIST_DIR.*--source DIR"):
        build_fashion_mnist(tmp_path / "o", download=True)
    # a damaged IDX file is the user's data: a ValueError naming it (one `error:` line in the CLI)
    (tmp_path / "bad").mkdir()
    for pair in builders_vision.FASHION_MNIST_FILES.values():
        for stem in pair:
            (tmp_path / "bad" / f"{stem}.gz").write_bytes(gzip.compress(b"\0\0\x08\x03" + b"\0" * 40)[:-9])
    with pytest.raises(ValueError, match="not a valid gzip file"):
        build_fashion_mnist(tmp_path / "o", source=tmp_path / "bad")


# -- images -----------------------------------------------------------------------------------------
def _img(mode: str, size: tuple[int, int], fmt: str, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"L": 1, "RGB": 3, "RGBA": 4, "P": 1}[mode]
    arr = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8).squeeze(-1 if channels == 1 else ())
    buf = io.BytesIO()
    Image.fromarray(arr, mode="L" if mode == "P" else None).convert(mode).save(buf, format=fmt)
    return buf.getvalue()


def test_images_holdout_keeps_original_bytes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = {
        "cat/a.jpg": _img("RGB", (13, 7), "JPEG", 0),
        "cat/b.PNG": _img("RGBA", (5, 31), "PNG", 1),
        "cat/c.jpeg": _img("L", (9, 9), "JPEG", 2),
        "cat/d.jpg": _img("P", (3, 4), "PNG", 3),  # a PNG named .jpg: stored as .png
        "ant/e.png": _img("L", (17, 2), "PNG", 4),
        "ant/f.jpg": _img("RGB", (1, 1), "JPEG", 5),
    }
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    (src / "cat" / "notes.txt").write_text("ignored")
    out = tmp_path / "out"
    m = build_images(out, src=src, val_fraction=0.5, seed=3, shard_size=2)
    assert m["classes"] == ["ant", "cat"]
    check_manifest(out, {"train": 3, "val": 3})
    assert m["class_counts"] == {"train": [1, 2], "val": [1, 2]}
    seen = {}
    for split in ("train", "val"):
        for s in read_split(out, split):
            meta = json.loads(s["json"])
            ext = "png" if "png" in s else "jpg"
            assert s[ext] == files[meta["path"]]
            assert int(s["cls"]) == m["classes"].index(meta["path"].split("/")[0])
            seen[meta["path"]] = ext
    assert seen == {"cat/a.jpg": "jpg", "cat/b.PNG": "png", "cat/c.jpeg": "jpg", "cat/d.jpg": "png",
                    "ant/e.png": "png", "ant/f.jpg": "jpg"}  # fmt: skip
    before = mtimes(out)
    build_images(out, src=src, val_fraction=0.5, seed=3, shard_size=2, quiet=True)
    assert mtimes(out) == before
    (src / "ant" / "g.jpg").write_bytes(b"not an image")
    with pytest.raises(ValueError, match=r"g\.jpg: not a JPEG or PNG"):
        build_images(out, src=src, val_fraction=0.5, seed=3, quiet=True)
    with pytest.warns(UserWarning, match="skipped"):
        m = build_images(out, src=src, val_fraction=0.5, seed=3, skip_bad=True, quiet=True)
    assert m["skipped"] == ["ant/g.jpg"]


def test_images_split_folders(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for split, n in (("train", 3), ("val", 1)):
        for c in ("b", "a"):
            for i in range(n):
                (src / split / c).mkdir(parents=True, exist_ok=True)
                (src / split / c / f"{i}.png").write_bytes(_img("RGB", (4 + i, 3), "PNG", i))
    m = build_images(tmp_path / "out", src=src, quiet=True)
    assert m["classes"] == ["a", "b"]
    check_manifest(tmp_path / "out", {"train": 6, "val": 2})


# -- LibriSpeech ------------------------------------------------------------------------------------
def test_librispeech_folder(tmp_path: Path) -> None:
    import soundfile as sf

    root = tmp_path / "LibriSpeech"
    expected = {}
    for subset, speakers in (("train-clean-5", ("19", "26")), ("dev-clean-2", ("84",))):
        for spk in speakers:
            chapter = root / subset / spk / "121"
            chapter.mkdir(parents=True)
            lines = []
            for u in range(2):
                uid = f"{spk}-121-{u:04d}"
                wave = (0.1 * np.sin(np.arange(1600 * (u + 1)) * 0.05)).astype(np.float32)
                sf.write(chapter / f"{uid}.flac", wave, 16000)
                lines.append(f"{uid} SPEAKER {spk} SAYS {u}")
                expected[uid] = (subset, (chapter / f"{uid}.flac").read_bytes(), lines[-1].split(" ", 1)[1], 0.1 * (u + 1))
            (chapter / f"{spk}-121.trans.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    m = build_librispeech(out, src=root, quiet=True)
    check_manifest(out, {"train-clean-5": 4, "dev-clean-2": 2})
    for split in ("train-clean-5", "dev-clean-2"):
        for s in read_split(out, split):
            subset, flac, text, dur = expected[s["__key__"]]
            assert subset == split and s["flac"] == flac and s["txt"].decode() == text
            meta = json.loads(s["json"])
            assert meta["duration"] == pytest.approx(dur) and meta["speaker"] == s["__key__"].split("-")[0]
    assert m["split_stats"]["dev-clean-2"]["hours"] == pytest.approx(0.3 / 3600, abs=1e-4)
    # one subset folder alone -> the --split name
    m = build_librispeech(tmp_path / "one", src=root / "dev-clean-2", split="dev", quiet=True)
    assert {k: v["count"] for k, v in m["splits"].items()} == {"dev": 2}
    (root / "dev-clean-2" / "84" / "121" / "84-121-0001.flac").unlink()
    with pytest.warns(UserWarning, match=r"84-121\.trans\.txt:2: audio .*84-121-0001\.flac not found; skipped"):
        m = build_librispeech(tmp_path / "bad", src=root, quiet=True)  # more: tests/test_data_librispeech.py
    assert m["splits"]["dev-clean-2"]["count"] == 1 and m["skipped"] == {"audio not found": 1}


# -- speech synthesis -------------------------------------------------------------------------------
def test_sentence_extraction() -> None:
    para = 'Mr. Knightley said "It is late." She laughed -- and left. Oh! There were 12 apples. Yes. "Well, my dear Emma," said he.'
    assert split_sentences(para) == [
        'Mr. Knightley said "It is late."',
        "She laughed -- and left.",
        "Oh!",
        "There were 12 apples.",
        "Yes.",
        '"Well, my dear Emma," said he.',
    ]
    assert clean_sentence('"Well, my dear _Emma_," said he.') == "Well, my dear Emma, said he."
    assert clean_sentence("She laughed -- and left.") == "She laughed - and left."
    assert clean_sentence("There were 12 apples.") is None  # digits
    assert clean_sentence("Yes.") is None  # < 3 words
    assert clean_sentence("CHAPTER THE FIRST ONE.") is None
    assert clean_sentence(" ".join(["word"] * 26).capitalize() + ".") is None
    assert extract_sentences([para, "Mr. Knightley said: it is late!"]) == [
        "Mr. Knightley said It is late.",
        "She laughed - and left.",
        "Well, my dear Emma, said he.",
    ]  # the last paragraph's sentence is a duplicate up to punctuation and case


def test_resample_sine() -> None:
    sr = 22050
    x = np.sin(2 * np.pi * 440.0 * np.arange(sr) / sr)
    y = resample(x, sr, 16000)
    assert len(y) == 16000
    ideal = np.sin(2 * np.pi * 440.0 * np.arange(16000) / 16000)
    assert np.abs(y - ideal)[40:-40].max() < 1e-3
    alias = resample(np.sin(2 * np.pi * 10000.0 * np.arange(sr) / sr), sr, 16000)  # above the new Nyquist
    assert np.sqrt(np.mean(alias[40:-40] ** 2)) < 1e-3


SENTENCES = [
    "The first sentence is about a cat.",
    "A second one talks about the weather today.",
    "Here is the third sentence of the story.",
    "Four friends walked down to the river.",
    "The fifth line mentions a quiet evening.",
    "Nobody expected the sixth sentence at all.",
    "Seven small birds sang in the garden.",
    "The eighth sentence ends this little text.",
]


def test_speech_synth_disjoint_and_worker_independent(tmp_path: Path) -> None:
    pytest.importorskip("espeakng_loader")
    import soundfile as sf

    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(SENTENCES[:4]) + "\n\n" + " ".join(SENTENCES[4:]) + "\n")
    kw = dict(train=8, test=3, test_sentences=3, per_sentence=2, text=[text], voices=["en-us", "en"],
              variants=["", "f3"], snrs=[None, 10.0], shard_size=4, quiet=True)  # fmt: skip
    m = build_speech_synth(tmp_path / "a", workers=1, **kw)
    check_manifest(tmp_path / "a", {"train": 8, "test": 3})
    assert m["corpus"] == {"name": "corpus.txt", "usable_sentences": 8, "train_sentences": 5, "test_sentences": 3}
    train, test = read_split(tmp_path / "a", "train"), read_split(tmp_path / "a", "test")
    train_text = {s["txt"].decode() for s in train}
    test_text = [s["txt"].decode() for s in test]
    assert len(set(test_text)) == 3 and set(test_text) <= set(SENTENCES)
    assert not train_text & set(test_text)
    assert not {sentence_key(t) for t in train_text} & {sentence_key(t) for t in test_text}
    assert len(train_text) == 4  # 8 utterances, 2 voice configs per sentence
    for s in train + test:
        audio, sr = sf.read(io.BytesIO(s["flac"]), dtype="float32")
        meta = json.loads(s["json"])
        assert sr == 16000 and audio.ndim == 1
        assert 0.8 < len(audio) / sr < 6.0 and meta["duration"] == pytest.approx(len(audio) / sr, abs=1e-3)
        assert np.sqrt(np.mean(audio**2)) > 0.01
        assert meta["voice"] in ("en-us", "en", "en-us+f3", "en+f3") and 130 <= meta["rate"] <= 210
        assert meta["snr"] in (None, 10.0) and (meta["noise"] is None) == (meta["snr"] is None)
    # 2 worker processes get the same jobs in the same order (eSpeak's pitch flutter carries state
    # across utterances in a process, so waveforms differ by a few samples, not the content)
    build_speech_synth(tmp_path / "b", workers=2, **kw)
    for split, first in (("train", train), ("test", test)):
        second = read_split(tmp_path / "b", split)
        assert [(s["__key__"], s["txt"]) for s in second] == [(s["__key__"], s["txt"]) for s in first]
        for a, b in zip(first, second):
            ma, mb = json.loads(a["json"]), json.loads(b["json"])
            assert ma.pop("duration") == pytest.approx(mb.pop("duration"), abs=0.05) and ma == mb
    with pytest.raises(ValueError, match=r"text corpus \(.*\) has \d+ usable sentences .*8 are held out for test"):
        build_speech_synth(tmp_path / "c", test=8, train=1, text=[text], quiet=True)


# -- gym / minari -----------------------------------------------------------------------------------
def test_mix_parsing() -> None:
    assert parse_mix("random:1,expert:3", "CartPole-v1") == {"random": 0.25, "expert": 0.75}
    assert mix_counts({"a": 0.5, "b": 0.3, "c": 0.2}, 7) == {"a": 4, "b": 2, "c": 1}
    with pytest.raises(ValueError, match="not available for Acrobot-v1; available: random"):
        parse_mix("expert:1", "Acrobot-v1")
    with pytest.raises(ValueError, match="POLICY:WEIGHT"):
        parse_mix("expert", "CartPole-v1")


def test_episode_npz_deterministic() -> None:
    arrays = {"a": np.arange(5, dtype=np.float32), "b": np.ones((2, 3), dtype=bool)}
    b1, b2 = episode_npz(arrays), episode_npz(arrays)
    assert b1 == b2
    with np.load(io.BytesIO(b1)) as z:
        np.testing.assert_array_equal(z["a"], arrays["a"])
        assert z["b"].dtype == bool and z["b"].shape == (2, 3)


def test_gym_cartpole_with_minari_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("gymnasium")
    minari = pytest.importorskip("minari")
    root = tmp_path / "minari"
    out = tmp_path / "cartpole"
    m = build_gym(out, env="CartPole-v1", episodes=8, mix="random:0.5,expert:0.25,medium:0.25", seed=1,
                  val_fraction=0.25, reference_episodes=3, minari_root_dir=root, quiet=True)  # fmt: skip
    check_manifest(out, {"train": 6, "val": 2})
    assert m["policy_counts"] == {"expert": 2, "medium": 2, "random": 4}
    assert m["reference_returns"]["expert"] == 500.0 and 8 < m["reference_returns"]["random"] < 60
    assert m["action_space"] == {"type": "Discrete", "n": 2, "start": 0}
    assert m["minari"]["id"] == "omni/cartpole-v0"
    episodes = {}
    for split in ("train", "val"):
        for s in read_split(out, split):
            meta = json.loads(s["json"])
            with np.load(io.BytesIO(s["npz"])) as z:
                ep = {k: z[k] for k in z.files}
            T = meta["length"]
            assert ep["observations"].shape == (T + 1, 4) and ep["actions"].shape == (T,)
            assert ep["actions"].dtype == np.int64 and set(np.unique(ep["actions"])) <= {0, 1}
            assert float(ep["rewards"].sum()) == pytest.approx(meta["return"])
            assert bool(ep["terminations"][-1] or ep["truncations"][-1]) and not ep["terminations"][:-1].any()
            episodes[meta["episode"]] = (meta, ep)
    assert sorted(episodes) == list(range(8))
    assert all(episodes[i][0]["return"] == 500.0 for i in episodes if episodes[i][0]["policy"] == "expert")

    import os

    os.environ.pop("MINARI_DATASETS_PATH", None)
    from omni.data.builders_rl import minari_root

    with minari_root(root):
        ds = minari.load_dataset("omni/cartpole-v0")
        assert ds.total_episodes == 8 and ds.spec.env_spec.id == "CartPole-v1"
        for mep in ds.iterate_episodes():
            _, ep = episodes[mep.id]
            np.testing.assert_allclose(mep.observations, ep["observations"])
            np.testing.assert_array_equal(mep.actions, ep["actions"])
            np.testing.assert_allclose(mep.rewards, ep["rewards"])
    # idempotent, including the Minari copy
    before = mtimes(out)
    build_gym(out, env="CartPole-v1", episodes=8, mix="random:0.5,expert:0.25,medium:0.25", seed=1,
              val_fraction=0.25, reference_episodes=3, minari_root_dir=root, quiet=True)  # fmt: skip
    assert mtimes(out) == before

    # import the Minari copy back into shards: the same episodes
    mm = build_minari(tmp_path / "imported", dataset_id="omni/cartpole-v0", root=root, quiet=True)
    check_manifest(tmp_path / "imported", {"train": 8})
    assert mm["env_id"] == "CartPole-v1" and mm["reference_returns"]["expert"] == 500.0
    for s in read_split(tmp_path / "imported", "train"):
        meta = json.loads(s["json"])
        with np.load(io.BytesIO(s["npz"])) as z:
            np.testing.assert_array_equal(z["actions"], episodes[meta["episode"]][1]["actions"])
    with pytest.raises(FileNotFoundError, match="no local Minari dataset 'omni/nope-v0'"):
        build_minari(tmp_path / "x", dataset_id="omni/nope-v0", root=root, quiet=True)


def test_gym_pendulum_continuous(tmp_path: Path) -> None:
    pytest.importorskip("gymnasium")
    m = build_gym(tmp_path / "p", env="Pendulum-v1", episodes=3, mix="expert:1,random:2", minari=False,
                  reference_episodes=2, quiet=True)  # fmt: skip
    check_manifest(tmp_path / "p", {"train": 3})
    assert m["minari"] is None and m["action_space"]["type"] == "Box"
    assert m["reference_returns"]["expert"] > m["reference_returns"]["random"]
    for s in read_split(tmp_path / "p", "train"):
        with np.load(io.BytesIO(s["npz"])) as z:
            assert z["observations"].shape == (201, 3) and z["actions"].shape == (200, 1)
            assert z["actions"].dtype == np.float32 and np.abs(z["actions"]).max() <= 2.0
            assert z["truncations"][-1]


# -- text + tokenizer -------------------------------------------------------------------------------
def test_chunk_text() -> None:
    text = "para one line a\nline b\n\npara two\n\n\n" + "x" * 25 + "\n\nlast words here"
    assert chunk_text(text, max_chars=30) == ["para one line a\nline b", "para two", "x" * 25, "last words here"]
    assert chunk_text(text, max_chars=40) == ["para one line a\nline b\n\npara two", "x" * 25, "last words here"]
    assert chunk_text("aaaa bbbb cccc", max_chars=9) == ["aaaa bbbb", "cccc"]
    assert chunk_text("abcdefghij", max_chars=4) == ["abcd", "efgh", "ij"]
    assert chunk_text("l1\nl2\n\nl3", max_chars=100, mode="line") == ["l1\nl2\nl3"]


def test_text_builder_and_tokenizer_fit(tmp_path: Path) -> None:
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("First paragraph here.\n\nSecond paragraph, a bit longer than the first.\n")
    (src / "b.txt").write_text("Third file text.\n")
    out = tmp_path / "text"
    build_text(out, src=[src], max_chars=30, quiet=True)
    check_manifest(out, {"train": 4})
    got = [s["txt"].decode() for s in read_split(out, "train")]
    # a paragraph over max_chars is cut at spaces; documents never share a chunk
    assert got == ["First paragraph here.", "Second paragraph, a bit longer", "than the first.", "Third file text."]
    assert [json.loads(s["json"]) for s in read_split(out, "train")][3] == {"source": "b.txt", "chunk": 0}
    rc = cli_main(["tokenizer", "fit", "--input", str(src), "--vocab-size", "300", "--out", str(tmp_path / "tok")])
    assert rc == 0
    from omni.tokenizers import Tokenizer

    tok = Tokenizer.load(tmp_path / "tok")
    assert 16 + 256 < tok.vocab_size <= 300  # a tiny corpus runs out of merges before 300
    assert tok.decode(tok.encode("Third paragraph.").tokens) == "Third paragraph."


def one_error_line(capsys: pytest.CaptureFixture, command: str) -> str:
    """The stderr of a failed `omni data` command: exactly one `omni data X: error:` line, no traceback."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"omni {command}: error: ") and "Traceback" not in err, err
    return err


def test_cli_runs_and_reports_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "t.txt").write_text("hello world\n")
    assert cli_main(["data", "text", "--src", str(tmp_path / "t.txt"), "--out", str(tmp_path / "o"), "-q"]) == 0
    assert cli_main(["data", "verify", str(tmp_path / "o")]) == 0
    assert "train: 1 samples, 1 shard(s)" in capsys.readouterr().out
    assert cli_main(["data", "images", "--src", str(tmp_path / "missing"), "--out", str(tmp_path / "i")]) == 2
    assert str(tmp_path / "missing") in one_error_line(capsys, "data images")
    for argv, why in ((["gym", "--out", str(tmp_path / "g"), "--episodes", "0"], "argument --episodes: must be >= 1, got 0"),
                      (["images", "--out", str(tmp_path / "i")], "the following arguments are required: --src"),
                      (["text", "--out", str(tmp_path / "t"), "--max-chars", "x"], "argument --max-chars")):
        try:
            status = cli_main(["data", *argv])
        except SystemExit as exc:  # argparse's own exit, where the `omni` parser lets it through
            status = exc.code
        assert status == 2 and why in one_error_line(capsys, f"data {argv[0]}")


def text_dataset(tmp_path: Path, max_chars: int) -> tuple[list[str], Path]:
    """`omni data text` arguments for a few one-chunk shards, and the dataset folder."""
    src = tmp_path / "corpus.txt"
    src.write_text("\n\n".join(f"Paragraph number {i} of the corpus, with some words." for i in range(6)))
    out = tmp_path / "text"
    return ["data", "text", "--src", str(src), "--out", str(out), "--shard-size", "1", "-q",
            "--max-chars", str(max_chars)], out


def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK_NAME}


def test_a_failed_force_rebuild_leaves_the_old_dataset(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`--force` with other arguments, the disk filling up after two new shards: the old dataset is still
    there, byte for byte, and verifies; the error is one line saying the disk is full and where."""
    import errno

    argv, out = text_dataset(tmp_path, 200)
    assert cli_main(argv) == 0
    before = snapshot(out)
    new_argv = [*argv[:-1], "30", "--force"]
    real_write, written = sh._HashingFile.write, []

    def fill_up(self: sh._HashingFile, b: bytes) -> int:
        written.append(len(b))
        if sum(written) > 20_000:  # a few shards in: the new dataset is half written
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, b)

    monkeypatch.setattr(sh._HashingFile, "write", fill_up)
    assert cli_main(new_argv) == 2
    err = one_error_line(capsys, "data text")
    assert "the disk is full" in err and str(out) in err
    assert snapshot(out) == before and not (out / sh.STAGING_NAME).exists()
    sh.verify_dataset(out)

    # a build killed outright (no cleanup at all) leaves its staging folder, the old dataset intact
    monkeypatch.setattr(sh.Build, "abort", lambda self: None)
    written.clear()
    assert cli_main(new_argv) == 2
    capsys.readouterr()
    assert (out / sh.STAGING_NAME).is_dir() and snapshot(out) == before
    sh.verify_dataset(out)
    monkeypatch.undo()
    # the old arguments again: up to date (the leftover dropped); the new ones: the new dataset replaces the old
    assert cli_main(argv) == 0 and snapshot(out) == before and not (out / sh.STAGING_NAME).exists()
    assert cli_main(new_argv) == 0
    m = check_manifest(out, {"train": 12})
    assert sorted(p.name for p in out.glob("*.tar")) == sorted(s["name"] for s in m["splits"]["train"]["shards"])
    assert m["args"]["max_chars"] == 30 and not (out / sh.STAGING_NAME).exists()


def test_a_second_build_into_one_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import os

    argv, out = text_dataset(tmp_path, 200)
    holder = DirectoryLock(out, "dataset directory").acquire()  # a build running in another process
    try:
        with pytest.raises(LockedError, match=rf"dataset directory {out} is in use by pid {os.getpid()}"):
            build_text(out, src=[tmp_path / "corpus.txt"], quiet=True)
        assert cli_main(argv) == 2
        assert f"dataset directory {out} is in use by pid {os.getpid()}" in one_error_line(capsys, "data text")
        assert not (out / sh.MANIFEST_NAME).exists()
    finally:
        holder.release()
    assert cli_main(argv) == 0
    check_manifest(out, {"train": 2})
