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


def test_a_dataset_of_another_kind_is_one_line_naming_both(tmp_path):
    ds = _dataset(tmp_path / "speech", builder="speech-synth")
    expected = (rf"^{ds} is a dataset of speech \(built by `omni data speech-synth`\), where a dataset of images is expected "
                r"\(`omni data fashion-mnist, images` builds them\)$")
    for read in (lambda: read_manifest(ds, kind="images"), lambda: shard_urls(ds, "train", kind="images"),
                 lambda: ShardLoader(ds, _label, list, 2, kind="images")):
        with pytest.raises(DatasetError, match=expected):
            read()
    assert len(ShardLoader(ds, _label, list, 2, kind=("speech", "text"))) == 3
    other = _dataset(tmp_path / "mine", builder="my-plugin")  # a builder omni does not know: not checked
    assert read_manifest(other, kind="images")["builder"] == "my-plugin"


# ------------------------------------------------------------------------------------------------
# Images: whole files only, and a bound on their size read from the header


def _png(size=(8, 8)) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _huge_png(width: int, height: int) -> bytes:
    """A valid PNG claiming width x height with a few bytes of pixel data: what a decoder sees before it
    allocates (the header), and far too little to decode."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def test_skip_bad_skips_truncated_and_header_only_images(tmp_path):
    from omni.data.builders_vision import build_images

    good = _png()
    src = tmp_path / "src"
    for cls in ("a", "b"):
        (src / cls).mkdir(parents=True)
        for i in range(3):
            (src / cls / f"{i}.png").write_bytes(good)
    (src / "a" / "cut.png").write_bytes(good[: len(good) // 2])
    (src / "b" / "header.png").write_bytes(good[:33])  # signature + IHDR only
    (src / "b" / "huge.png").write_bytes(_huge_png(13000, 13000))
    with pytest.raises(ValueError, match=rf"{src / 'a' / 'cut.png'}: not a complete image .*--skip-bad"):
        build_images(tmp_path / "strict", src=src, val_fraction=0.0, quiet=True)
    with pytest.warns(UserWarning) as caught:
        manifest = build_images(tmp_path / "ds", src=src, val_fraction=0.0, quiet=True, skip_bad=True)
    assert sorted(manifest["skipped"]) == ["a/cut.png", "b/header.png", "b/huge.png"]
    assert manifest["splits"]["train"]["count"] == 6
    assert any("13000 x 13000 pixels (169.0 MP) is more than omni decodes" in str(w.message) for w in caught)


def test_an_image_over_the_pixel_bound_is_refused_from_its_header(tmp_path):
    from omni.data.reader import decode_image
    from omni.tokenizers.image import MAX_PIXELS, ImageTooLarge, to_image_tensor

    assert MAX_PIXELS == 8192 * 8192
    path = tmp_path / "huge.png"
    path.write_bytes(_huge_png(13000, 13000))  # decoding it would need 507 MB of pixels, 2 GB as floats
    with pytest.raises(ImageTooLarge, match=rf"^image '{path}': 13000 x 13000 pixels \(169.0 MP\) is more than omni "
                                            r"decodes \(67.1 MP, e.g. 8192 x 8192: omni.tokenizers.image.MAX_PIXELS\); "
                                            r"downscale it first$"):
        to_image_tensor(str(path), key=str(path))
    with pytest.raises(ImageTooLarge, match=r"13000 x 13000 pixels \(169.0 MP\) is more than omni decodes"):
        decode_image(path.read_bytes())  # the shard reader opens images by the same rule (omni.image_bytes)
    assert to_image_tensor(_png((5, 7))).shape == (3, 5, 7)


@pytest.mark.parametrize("script, builder, expected", [
    ("vit.py", "speech-synth", "where a dataset of images is expected"),
    ("whisper.py", "fashion-mnist", "where a dataset of speech is expected"),
    ("decision_transformer.py", "text", "where a dataset of episodes is expected"),
])
def test_a_recipe_given_a_dataset_of_another_kind_says_so_in_one_line(tmp_path, script, builder, expected):
    """The recipes pass the kind they read: a dataset of another kind is one line naming both (exit 2), not a
    traceback from the first sample's decoder."""
    import subprocess
    import sys

    ds = _dataset(tmp_path / "ds", builder=builder)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, f"recipes/{script}", "--preset", "tiny", "--data", str(ds),
                           "--out", str(tmp_path / "run"), "--set", "progress=False"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"recipes/{script}: error: ") and expected in line, proc.stderr[-2000:]


def test_user_format_builders_have_kinds(tmp_path):
    """`omni data audio` writes speech; `omni data hf` writes the kind its manifest records."""
    speech = _dataset(tmp_path / "audio", builder="audio")
    with pytest.raises(DatasetError, match="is a dataset of speech .*where a dataset of images is expected"):
        read_manifest(speech, kind="images")
    hf = tmp_path / "hf"
    build = Build(hf, "hf", {}, shard_size=3, quiet=True)
    with build:
        build.start()
        with build.split("train") as w:
            w.write({"__key__": "k0", "cls": 0})
        build.finish(kind="text")
    with pytest.raises(DatasetError, match=r"is a dataset of text \(built by `omni data hf`\)"):
        read_manifest(hf, kind="images")
    assert read_manifest(hf, kind="text")["kind"] == "text"


def test_the_shard_reader_and_the_tokenizer_read_a_rotated_photo_the_same_way():
    """A JPEG whose EXIF says "rotate 90" (phones write them): the shard reader's decode_image and the image
    tokenizer (omni predict) both apply the orientation, so training and prediction see one upright image (the
    reader used to keep the stored orientation)."""
    import io

    import numpy as np
    from PIL import Image

    from omni.data.reader import decode_image
    from omni.tokenizers.image import to_image_tensor

    pixels = np.zeros((6, 10, 3), dtype=np.uint8)
    pixels[:, :5] = 255  # the left half white: where it ends up shows the rotation
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 clockwise to display
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", exif=exif.tobytes())
    data = buf.getvalue()
    read = np.asarray(decode_image(data))
    assert read.shape == (10, 6, 3)  # upright: the stored 6 x 10 turned to 10 x 6
    tokenized = (to_image_tensor(data).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    assert np.array_equal(read, tokenized)
