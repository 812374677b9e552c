"""Issue #29's dataset cases: a manifest that names shards outside its folder, a dataset of the wrong kind for
its reader, truncated images in `omni data images --skip-bad`, and a corrupt shard reported in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni.data.reader import ShardLoader, decode_cls
from omni.data.shards import Build, DatasetError, read_manifest, shard_urls, verify_dataset


def _dataset(path: Path, n: int = 6, builder: str = "reader-test") -> Path:
    build = Build(path, builder, {}, shard_size=3, quiet=True)
    with build:
        build.start()
        with build.split("train") as w:
            for i in range(n):
                w.write({"__key__": f"k{i:02d}", "cls": i % 3})
        build.finish()
    return path


def _label(sample: dict) -> int:
    return decode_cls(sample["cls"])


@pytest.mark.parametrize("name", ["../outside.tar", "/etc/hostname", "sub/../../outside.tar", "~/x.tar",
                                  "C:/x.tar", "..\\outside.tar"])
def test_a_manifest_may_not_name_shards_outside_its_folder(tmp_path, name):
    ds = _dataset(tmp_path / "ds")
    (tmp_path / "outside.tar").write_bytes((ds / "train-000000.tar").read_bytes())
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["name"] = name
    (ds / "manifest.json").write_text(json.dumps(manifest))
    expected = rf"{ds / 'manifest.json'}: split 'train' lists the shard .*, outside the dataset folder {ds}"
    for read in (lambda: read_manifest(ds), lambda: shard_urls(ds, "train"), lambda: verify_dataset(ds),
                 lambda: ShardLoader(ds, _label, list, 2)):
        with pytest.raises(DatasetError, match=expected):
            read()


def test_shards_in_a_subfolder_of_the_dataset_are_still_read(tmp_path):
    ds = _dataset(tmp_path / "ds")
    (ds / "part").mkdir()
    manifest = json.loads((ds / "manifest.json").read_text())
    for shard in manifest["splits"]["train"]["shards"]:
        (ds / shard["name"]).rename(ds / "part" / shard["name"])
        shard["name"] = f"part/{shard['name']}"
    (ds / "manifest.json").write_text(json.dumps(manifest))
    assert sorted(x for batch in ShardLoader(ds, _label, list, 2) for x in batch) == [0, 0, 1, 1, 2, 2]
