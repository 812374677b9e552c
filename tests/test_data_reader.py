"""ShardLoader: exactly-once per epoch over ranks and workers, equal batch counts, seeded order,
exact mid-epoch resume, and corrupt samples skipped / counted / logged / failing past a threshold."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from omni.data.reader import (
    ShardLoader,
    decode_audio,
    decode_cls,
    decode_field,
    decode_fields,
    decode_image,
    decode_json,
    decode_npz,
    decode_u8,
    index_shard,
    manifest_shards,
)
from omni.data.shards import Build, DatasetError
from omni.packing import PackedBatch, Packer
from omni.segment import Role, Sample, Segment

COUNTS = [13, 17, 29, 21, 15, 19, 23]  # 137 samples: not divisible by any world * batch used below
N = sum(COUNTS)


def key_of(shard: int, i: int) -> str:
    return f"s{shard:02d}-{i:03d}"


ALL_KEYS = {key_of(s, i) for s, c in enumerate(COUNTS) for i in range(c)}


def write_shards(root: Path, counts=COUNTS, image: bool = False) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    urls = []
    for s, count in enumerate(counts):
        url = str(root / f"train-{s:03d}.tar")
        with wds.TarWriter(url) as sink:
            for i in range(count):
                sample = {"__key__": key_of(s, i), "cls": str((s * 31 + i) % 10), "txt": f"sample {s} {i} " * 20}
                if image:
                    buf = io.BytesIO()
                    Image.fromarray(np.full((4, 4), i % 255, np.uint8)).save(buf, format="PNG")
                    sample["png"] = buf.getvalue()
                sink.write(sample)
        urls.append(url)
    return urls


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    return write_shards(tmp_path_factory.mktemp("shards"))


# Module-level so DataLoader workers can use them under any start method.
def decode_key(sample: dict) -> str:
    decode_cls(sample["cls"])  # KeyError when the field is missing -> corrupt
    return sample["__key__"]


def decode_png_key(sample: dict) -> str:
    decode_image(sample["png"])
    return sample["__key__"]


def collate_keys(values: list) -> list:
    return list(values)


def epoch_batches(loader: ShardLoader) -> list[list[str]]:
    return [list(b) for b in loader]


def make(urls, **kw) -> ShardLoader:
    kw.setdefault("batch_size", 8)
    return ShardLoader(urls, kw.pop("decode", decode_key), kw.pop("collate", collate_keys), **kw)


# ------------------------------------------------------------------------------------------------
# exactly once, order, ranks, workers
# ------------------------------------------------------------------------------------------------


def test_one_process_sees_every_key_once_per_epoch(shards):
    loader = make(shards, batch_size=8, rank=0, world_size=1)
    assert len(loader) == math.ceil(N / 8) == 18
    for epoch in range(2):
        batches = epoch_batches(loader)
        keys = [k for b in batches for k in b]
        assert len(batches) == 18 and sorted(keys) == sorted(ALL_KEYS)
        assert {len(b) for b in batches} == {7, 8}  # 137 = 11*8 + 7*7: near-equal sizes
        assert loader.state_dict()["epoch"] == epoch + 1 and loader.batches_done == 0
    assert loader.stats["seen"] == N and loader.stats["corrupt"] == 0


def test_order_is_seeded_and_changes_per_epoch(shards):
    a, b, c = make(shards, seed=1), make(shards, seed=1), make(shards, seed=2)
    a0, a1 = epoch_batches(a), epoch_batches(a)
    assert a0 == epoch_batches(b)  # same seed, same epoch: identical batches
    assert a1 == epoch_batches(b)
    assert a0 != a1 and a0 != epoch_batches(c)
    # shuffled within shards too, not only the shard order: neighbours in a batch come from several shards
    assert len({k[:3] for k in a0[0]}) > 1
    one = make(shards[:1], batch_size=4)  # one shard: only the window shuffle can change the order
    assert epoch_batches(one) != epoch_batches(one)
    plain = epoch_batches(make(shards, shuffle=False))
    assert [k for bt in plain for k in bt] == [key_of(s, i) for s, c_ in enumerate(COUNTS) for i in range(c_)]


@pytest.mark.parametrize("world,batch,drop_last", [(2, 8, False), (3, 5, False), (4, 16, False), (3, 5, True)])
def test_ranks_partition_the_epoch_with_equal_batch_counts(shards, world, batch, drop_last):
    per_rank = [epoch_batches(make(shards, batch_size=batch, rank=r, world_size=world, drop_last=drop_last))
                for r in range(world)]
    counts = [len(b) for b in per_rank]
    expected = (N // world) // batch if drop_last else math.ceil(math.ceil(N / world) / batch)
    assert counts == [expected] * world
    keys = [k for batches in per_rank for b in batches for k in b]
    assert len(keys) == len(set(keys))  # nobody sees a sample twice
    sizes = {len(b) for batches in per_rank for b in batches}
    if drop_last:
        assert sizes == {batch} and len(keys) == expected * batch * world
    else:
        assert set(keys) == ALL_KEYS and max(sizes) - min(sizes) <= 1


def test_workers_give_the_same_batches_as_one_process(shards):
    single = epoch_batches(make(shards, rank=1, world_size=2, seed=5, shuffle_window=20))
    workers = epoch_batches(make(shards, rank=1, world_size=2, seed=5, shuffle_window=20, num_workers=2))
    assert workers == single and len(single) == math.ceil(math.ceil(N / 2) / 8)


def test_two_processes_two_workers_each_see_every_sample_once(shards, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("_reader_worker.py")
    shard_dir = str(Path(shards[0]).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(port), shard_dir,
                               str(tmp_path / f"rank{r}.json"), "2"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    keys = Counter(k for r in results for k in r["keys"])
    assert set(keys) == ALL_KEYS and set(keys.values()) == {1}
    assert [r["batches"] for r in results] == [r["len"] for r in results] == [9, 9]  # ceil(69/8)
    assert results[0]["sum_batches"] == 18


# ------------------------------------------------------------------------------------------------
# resume
# ------------------------------------------------------------------------------------------------


class CountingDecode:
    """Records every decoded key (in-process only: num_workers=0)."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def __call__(self, sample: dict) -> str:
        self.keys.append(sample["__key__"])
        return sample["__key__"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_reproduces_the_remaining_batches(shards, num_workers):
    kw = dict(rank=1, world_size=2, seed=7, shuffle_window=32, num_workers=num_workers)
    full = make(shards, **kw)
    epoch0, epoch1 = epoch_batches(full), epoch_batches(full)

    first = make(shards, **kw)
    got = []
    for batch in first:
        got.append(list(batch))
        if len(got) == 5:  # odd, so a worker other than worker 0 owns the first resumed batch
            break
    state = first.state_dict()
    assert (state["epoch"], state["batches_done"]) == (0, 5)
    del first

    decode = CountingDecode()
    resumed = make(shards, **{**kw, "num_workers": 0}, decode=decode)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # the state survives a JSON round trip
    rest = epoch_batches(resumed)
    assert got + rest == epoch0
    assert sorted(decode.keys) == sorted(k for b in rest for k in b)  # skipped batches were never decoded
    assert epoch_batches(resumed) == epoch1  # and the next epoch continues as if never interrupted
    with_workers = make(shards, **{**kw, "num_workers": 2})
    with_workers.load_state_dict(state)
    assert epoch_batches(with_workers) == rest


def test_state_after_the_last_batch_points_at_the_next_epoch(shards):
    loader = make(shards)
    it = iter(loader)
    for _ in range(len(loader)):
        next(it)
    state = loader.state_dict()
    assert (state["epoch"], state["batches_done"]) == (1, 0)
    again = make(shards)
    again.load_state_dict(state)
    again.set_epoch(1)  # a trainer calling set_epoch with the current epoch does not reset it
    resumed = epoch_batches(again)
    assert resumed == epoch_batches(loader)  # the original, iterated on, also serves epoch 1 now
    assert again.epoch == loader.epoch == 2 and resumed != epoch_batches(make(shards))  # != epoch 0


def test_set_epoch_and_resume_agree(shards):
    reference = make(shards)
    reference.set_epoch(3)
    epoch3 = epoch_batches(reference)
    loader = make(shards)
    loader.load_state_dict({"epoch": 3, "batches_done": 0})
    loader.set_epoch(3)
    assert epoch_batches(loader) == epoch3
    loader.set_epoch(3)  # now at epoch 4: going back to 3 restarts it
    assert epoch_batches(loader) == epoch3


def test_resume_with_another_world_size_warns_and_keeps_the_epoch_fraction(shards):
    state = {"epoch": 2, "batches_done": 9, "plan": make(shards, world_size=1, rank=0).state_dict()["plan"]}
    loader = make(shards, world_size=2, rank=0)  # 9 batches per epoch instead of 18
    with pytest.warns(UserWarning, match="different setup.*world_size"):
        loader.load_state_dict(state)
    assert (loader.epoch, loader.batches_done) == (2, 4)


# ------------------------------------------------------------------------------------------------
# corrupt data
# ------------------------------------------------------------------------------------------------


def corrupt_keys_logged(caplog) -> set[str]:
    out = set()
    for rec in caplog.records:
        if rec.name == "omni.data.reader" and "corrupt sample" in rec.getMessage():
            out.add(rec.args[0])
    return out


def test_truncated_shard_is_counted_and_the_rest_read_once(tmp_path, caplog):
    urls = write_shards(tmp_path)
    data = Path(urls[2]).read_bytes()  # 29 samples
    cut = index_shard(urls[2]).samples[10][1]["txt"][0] + 50  # inside sample 10's text member
    Path(urls[2]).write_bytes(data[:cut])
    idx = index_shard(urls[2])
    assert len(idx) == 11 and 10 in idx.bad and idx.error
    caplog.set_level(logging.WARNING, logger="omni.data.reader")
    loader = make(urls, counts=COUNTS, max_corrupt_fraction=0.2, num_workers=0)
    keys = [k for b in epoch_batches(loader) for k in b]
    lost = {key_of(2, i) for i in range(10, 29)}
    assert len(keys) == len(set(keys)) and set(keys) == ALL_KEYS - lost
    assert loader.stats["corrupt"] == 19 and loader.stats["seen"] == N
    # one line per reason (cut inside sample 10; the 18 after it missing), then one summing up the rest
    logged = corrupt_keys_logged(caplog)
    assert key_of(2, 10) in logged and len(logged) == 2 and len({k for k in logged if "train-002.tar#" in k}) == 1
    summary = [r.getMessage() for r in caplog.records if "skipped as corrupt" in r.getMessage()]
    assert summary == [f"{urls[2]}: 17 more samples skipped as corrupt in epoch 0, for the reasons above (not logged "
                       "one by one)"]


def test_garbage_image_and_missing_field_are_skipped(tmp_path, caplog):
    urls = write_shards(tmp_path, counts=[12, 9], image=True)
    # shard 1: sample 3 gets garbage PNG bytes, sample 5 has no png at all
    path = Path(urls[1])
    with wds.TarWriter(str(path)) as sink:
        for i in range(9):
            sample = {"__key__": key_of(1, i), "cls": "1"}
            if i == 3:
                sample["png"] = b"\x89PNG\r\n\x1a\n" + b"garbage" * 10
            elif i != 5:
                buf = io.BytesIO()
                Image.new("RGB", (3, 3)).save(buf, format="PNG")
                sample["png"] = buf.getvalue()
            sink.write(sample)
    caplog.set_level(logging.WARNING, logger="omni.data.reader")
    loader = make(urls, decode=decode_png_key, batch_size=4, fields=("png",), max_corrupt_fraction=0.1,
                  num_workers=2)
    keys = [k for b in epoch_batches(loader) for k in b]
    assert sorted(keys) == sorted({key_of(0, i) for i in range(12)} | {key_of(1, i) for i in range(9)}
                                  - {key_of(1, 3), key_of(1, 5)})
    assert loader.stats["corrupt"] == 2 and loader.stats["valid"] == 19
    assert corrupt_keys_logged(caplog) == {key_of(1, 3), key_of(1, 5)}
    reasons = " ".join(r.getMessage() for r in caplog.records)
    assert "missing field(s) ['png']" in reasons and "decode failed" in reasons


def test_too_many_corrupt_samples_fail_the_run(tmp_path):
    urls = write_shards(tmp_path, counts=[40, 40, 40])
    Path(urls[1]).write_bytes(Path(urls[1]).read_bytes()[:3000])  # lose almost all of shard 1
    loader = make(urls, counts=[40, 40, 40], max_corrupt_fraction=0.05, corrupt_check_after=10)
    with pytest.raises(RuntimeError, match=r"of \d+ samples \([\d.]+%\) .* were corrupt.*max_corrupt_fraction=0.05") as err:
        epoch_batches(loader)
    assert "s01-" in str(err.value) or "train-001.tar#" in str(err.value)
    # the same data passes with a looser threshold, losing exactly the cut samples
    ok = make(urls, counts=[40, 40, 40], max_corrupt_fraction=0.5)
    keys = [k for b in epoch_batches(ok) for k in b]
    assert ok.stats["corrupt"] == 120 - len(keys) and 38 <= ok.stats["corrupt"] <= 40


def test_broken_decode_fails_with_the_reason(shards):
    def broken(sample):
        raise ValueError("decoder bug")

    with pytest.raises(RuntimeError, match="no usable sample.*decoder bug"):
        list(make(shards, decode=broken, max_corrupt_fraction=1.0))


def test_all_corrupt_batch_repeats_a_sample_to_keep_counts_equal(tmp_path, caplog):
    urls = write_shards(tmp_path, counts=[6, 6])
    with wds.TarWriter(urls[1]) as sink:  # shard 1: no cls field anywhere
        for i in range(6):
            sink.write({"__key__": key_of(1, i), "txt": "x"})
    caplog.set_level(logging.WARNING, logger="omni.data.reader")
    per_rank, fillers = [], []
    for r in range(2):
        loader = make(urls, batch_size=2, rank=r, world_size=2, max_corrupt_fraction=1.0, shuffle=False)
        per_rank.append([])
        for batch in loader:
            per_rank[-1].append(batch)
            fillers.append(loader.last_batch_was_filler)
    assert fillers == [False] * 3 + [True] * 3 and loader.stats["fillers"] == 3 and loader.stats["valid"] == 0
    assert [len(b) for b in per_rank] == [3, 3]  # rank 1's samples are all corrupt, yet it yields 3 batches
    assert [k for b in per_rank[0] for k in b] == [key_of(0, i) for i in range(6)]
    assert per_rank[1] == [[key_of(0, 0)]] * 3  # filler: first usable sample scanning on from the batch
    assert sum("repeats sample" in r.getMessage() for r in caplog.records) == 3


def drop_even(sample: dict):
    return None if int(sample["__key__"][-1]) % 2 == 0 else sample["__key__"]


def test_filtered_samples_and_batch_size_one_on_uneven_ranks(tmp_path):
    urls = write_shards(tmp_path, counts=[3])
    with pytest.warns(UserWarning, match="repeat a sample"):
        loaders = [make(urls, batch_size=1, rank=r, world_size=2, shuffle=False) for r in range(2)]
    assert [epoch_batches(lo) for lo in loaders] == [[["s00-000"], ["s00-001"]], [["s00-002"], ["s00-002"]]]
    assert loaders[1].last_batch_was_filler and loaders[1].stats["corrupt"] == 0
    loader = make(urls, decode=drop_even, batch_size=3)  # decode returning None drops on purpose
    assert epoch_batches(loader) == [["s00-001"]] and loader.stats["filtered"] == 2
    assert loader.stats["corrupt"] == 0


# ------------------------------------------------------------------------------------------------
# manifest, decoders, packing
# ------------------------------------------------------------------------------------------------


def test_dataset_directory_built_by_omni_data(tmp_path, caplog):
    build = Build(tmp_path / "ds", "reader-test", {}, shard_size=5, quiet=True)
    build.start()
    with build.split("train") as w:
        for i in range(12):
            w.write({"__key__": f"k{i:02d}", "cls": i % 3})
    with build.split("val") as w:
        w.write({"__key__": "v0", "cls": 1})
    build.finish()
    urls, counts, _ = manifest_shards(tmp_path / "ds", "train")
    assert counts == [5, 5, 2] and [Path(u).name for u in urls] == [f"train-{i:06d}.tar" for i in range(3)]
    loader = ShardLoader(tmp_path / "ds", decode_key, collate_keys, 4, split="train", fields=("cls",))
    assert len(loader) == 3 and sorted(k for b in loader for k in b) == [f"k{i:02d}" for i in range(12)]
    with pytest.raises(DatasetError, match="no split 'test'"):
        ShardLoader(tmp_path / "ds", decode_key, collate_keys, 4, split="test")
    # a shard cut after the build: logged at start, its lost samples skipped and counted
    Path(urls[1]).write_bytes(Path(urls[1]).read_bytes()[:2500])
    caplog.set_level(logging.WARNING, logger="omni.data.reader")
    loader = ShardLoader(tmp_path / "ds", decode_key, collate_keys, 4, max_corrupt_fraction=0.5)
    assert "changed after the build" in caplog.text
    assert sum(len(b) for b in loader) + loader.stats["corrupt"] == 12 and loader.stats["corrupt"] >= 3


def decode_label(sample: dict) -> tuple[str, int]:
    return sample["__key__"], decode_cls(sample["cls"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shard_changed_after_the_build_fails_the_read_naming_it(tmp_path, num_workers):
    """One label byte flipped inside an intact tar: same size, every header valid, so only the manifest's
    sha256 can tell. Every sample of that shard is corrupt, and past max_corrupt_fraction the read fails."""
    build = Build(tmp_path / "ds", "reader-test", {}, shard_size=5, quiet=True)
    build.start()
    with build.split("train") as w:
        for i in range(15):
            w.write({"__key__": f"k{i:02d}", "cls": i % 3})
    build.finish()
    urls, _, digests = manifest_shards(tmp_path / "ds", "train")
    assert all(len(d) == 64 for d in digests)
    shard = Path(urls[1])
    offset, size = index_shard(shard).samples[1][1]["cls"]  # sample k06, label 0
    data = bytearray(shard.read_bytes())
    assert data[offset:offset + size] == b"0"
    data[offset] = ord("2")
    shard.write_bytes(bytes(data))
    assert index_shard(shard).error is None and not index_shard(shard).bad  # the tar itself is fine
    name = re.escape(str(shard))
    with pytest.raises(DatasetError, match=rf"shard {name} sha256 mismatch \(manifest says {digests[1]}, file has "
                                           r"[0-9a-f]{64}\): it changed after the build.*"
                                           r"--set max_corrupt_fraction=0\.05.*ShardLoader\(max_corrupt_fraction="):
        list(ShardLoader(tmp_path / "ds", decode_label, collate_keys, 5, shuffle=False, num_workers=num_workers))
    # allowed to skip them: the other shards' samples train, none of the changed shard's
    loader = ShardLoader(tmp_path / "ds", decode_label, collate_keys, 5, shuffle=False, num_workers=num_workers,
                         max_corrupt_fraction=0.5)
    labels = dict(x for batch in loader for x in batch)
    assert sorted(labels) == [f"k{i:02d}" for i in (*range(5), *range(10, 15))] and loader.stats["corrupt"] == 5
    assert {url: n for url, (n, _) in loader.state_dict()["corrupt_shards"].items()} == {str(shard): 5}
    # bare shard paths carry no digests: nothing to check against, the flipped label is read
    bare = ShardLoader(urls, decode_label, collate_keys, 5, shuffle=False)
    assert dict(x for batch in bare for x in batch)["k06"] == 2


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])
def test_index_matches_tarfile_for_every_tar_flavour(tmp_path, fmt):
    path = tmp_path / "f.tar"
    with tarfile.open(path, "w", format=fmt) as tf:
        for i in range(3):
            for ext, payload in (("cls", b"1"), ("seg.txt", b"x" * (700 + i))):
                long = "d" * 60 + "/" + "e" * 50 if fmt != tarfile.USTAR_FORMAT else "d" * 90  # > 100 chars
                info = tarfile.TarInfo(f"{long}/k{i}.{ext}")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    idx = index_shard(path)
    with tarfile.open(path) as tf:
        expected = [(m.name, m.offset_data, m.size) for m in tf]
    assert [(f"{k}.{e}", *where) for k, fields in idx.samples for e, where in fields.items()] == expected
    assert len(idx) == 3 and idx.error is None and not idx.bad


def test_index_of_damaged_tar_files(tmp_path):
    urls = write_shards(tmp_path, counts=[10])
    data = Path(urls[0]).read_bytes()
    clean = index_shard(urls[0])
    txt_at = [fields["txt"][0] for _, fields in clean.samples]
    cases = {
        "inside a member": (data[: txt_at[4] + 10], 5, "ends inside member"),
        "inside a header": (data[: txt_at[4] - 100], 5, "header"),
        "no end blocks": (data[: (txt_at[6] + 220 + 511) // 512 * 512], 7, "end-of-archive"),
        "garbage header": (data[: txt_at[3] + 512] + b"\xff" * 512 + data[txt_at[3] + 1024:], 4, "invalid tar header"),
    }
    for name, (blob, readable, why) in cases.items():
        path = tmp_path / f"{name}.tar"
        path.write_bytes(blob)
        idx = index_shard(path)
        assert len(idx) == readable and why in idx.error, name
        assert list(idx.bad) == [readable - 1], name  # the sample being read when it broke is not trusted


def test_decoders():
    import soundfile as sf

    for mode in ("L", "LA", "RGB", "RGBA", "I;16"):
        buf = io.BytesIO()
        Image.new(mode, (5, 3)).save(buf, format="PNG")
        img = decode_image(buf.getvalue())
        assert img.size == (5, 3) and img.mode == mode
    assert decode_image(buf.getvalue(), mode="RGB").mode == "RGB"
    buf = io.BytesIO()
    sf.write(buf, np.zeros((160, 2), np.float32), 16000, format="WAV", subtype="PCM_16")
    wave, rate = decode_audio(buf.getvalue())
    assert wave.shape == (160, 2) and wave.dtype == np.float32 and rate == 16000
    buf = io.BytesIO()
    np.savez(buf, s=np.arange(3))
    assert decode_npz(buf.getvalue())["s"].tolist() == [0, 1, 2]
    assert decode_cls(b" 7\n") == 7 and decode_json(b'{"a": 1}') == {"a": 1}
    assert decode_u8(b"\x01\xff").tolist() == [1, 255]
    assert decode_field("en.txt", "hé".encode()) == "hé" and decode_field("bin", b"x") == b"x"
    assert decode_fields({"__key__": "k", "cls": b"3"}) == {"__key__": "k", "cls": 3}
    with pytest.raises(Exception):
        decode_image(b"not an image")


def decode_sample(sample: dict) -> Sample:
    ids = torch.tensor(list(sample["txt"][:5 + decode_cls(sample["cls"])]), dtype=torch.int64)
    seg = Segment("text", ids, torch.arange(len(ids)), Role.CAUSAL)
    return Sample([seg], key=sample["__key__"], label=decode_cls(sample["cls"]))


def test_variable_length_samples_go_through_the_packer(shards):
    loader = make(shards, decode=decode_sample, collate=Packer(), batch_size=6, num_workers=2)
    batches = list(loader)
    assert all(isinstance(b, PackedBatch) for b in batches) and len(batches) == math.ceil(N / 6)
    keys = [k for b in batches for k in b.keys]
    assert sorted(keys) == sorted(ALL_KEYS)
    assert sum(b.num_tokens for b in batches) == sum(5 + (s * 31 + i) % 10 for s, c in enumerate(COUNTS)
                                                     for i in range(c))


def decode_sigint_handler(sample: dict) -> bool:
    import signal

    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_workers_leave_ctrl_c_to_the_training_process(shards):
    """A Ctrl-C reaches the whole process group; workers must not die of it while the training process
    finishes its step and checkpoints (omni.train stops on the first SIGINT after the step)."""
    loader = make(shards, decode=decode_sigint_handler, num_workers=2)
    assert all(all(batch) for batch in epoch_batches(loader))
