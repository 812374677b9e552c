"""Tests for omni.tokenizers.image: geometry, policies, channel/dtype rules, decoding, errors, embedder."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image

from omni.segment import Role
from omni.tokenizers.base import CONFIG_FILE, Tokenizer, get_tokenizer
from omni.tokenizers.image import (
    ImagePatchEmbedder,
    ImageTokenizer,
    grid_positions,
    patchify,
    to_image_tensor,
    unpatchify,
)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _u8(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return _rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def _canvas(tok: ImageTokenizer, seg) -> torch.Tensor:
    """The normalised, padded canvas (C, H', W') behind a segment's tokens."""
    t = seg.tokens[1:, : tok.patch_dim] if tok.cls else seg.tokens
    return unpatchify(t, seg.meta["grid"], tok.patch_size)


# -- patchify / unpatchify / positions ---------------------------------------------------------------
@pytest.mark.parametrize(
    "b,c,h,w,p", [(2, 3, 32, 48, 16), (1, 1, 28, 28, 4), (3, 4, 14, 21, 7), (2, 3, 5, 5, 1), (1, 3, 16, 16, 16)]
)
def test_patchify_unpatchify_exact_inverse(b: int, c: int, h: int, w: int, p: int) -> None:
    g = torch.Generator().manual_seed(b * 1000 + h * 10 + p)
    x = torch.randn(b, c, h, w, generator=g)
    t = patchify(x, p)
    assert t.shape == (b, (h // p) * (w // p), p * p * c)
    assert torch.equal(unpatchify(t, (h // p, w // p), p), x)  # bitwise, float
    assert torch.equal(unpatchify(t[1 % b], (h // p, w // p), p), x[1 % b])  # unbatched
    u = torch.randint(0, 256, (b, c, h, w), generator=g, dtype=torch.uint8)
    tu = patchify(u, p)
    assert tu.dtype == torch.uint8 and torch.equal(unpatchify(tu, (h // p, w // p), p), u)
    tok = ImageTokenizer(patch_size=p, channels=c if c != 2 else 3)
    assert torch.equal(tok.unpatchify(tok.patchify(x), (h // p, w // p)), x)


def test_patch_feature_order_and_positions() -> None:
    p = 2
    x = torch.arange(3 * 4 * 6, dtype=torch.float32).reshape(3, 4, 6)
    t = patchify(x, p)
    pos = grid_positions(2, 3)
    assert pos.dtype == torch.int64
    assert pos.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    for k, (r, c) in enumerate(pos.tolist()):
        # (p1 p2 c): row-in-patch, col-in-patch, channel fastest
        expected = x[:, r * p : (r + 1) * p, c * p : (c + 1) * p].permute(1, 2, 0).reshape(-1)
        assert torch.equal(t[k], expected)
    assert t[0, :3].tolist() == [0.0, 24.0, 48.0]  # first pixel, 3 channels
    assert torch.equal(ImageTokenizer.grid_positions(2, 3), pos)


def test_patchify_rejects_non_multiple() -> None:
    with pytest.raises(ValueError, match="multiple of the patch size 4"):
        patchify(torch.zeros(1, 3, 6, 8), 4)
    with pytest.raises(ValueError, match="do not fit grid"):
        unpatchify(torch.zeros(5, 48), (2, 3), 4)


# -- size policies ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "h,w,p,policy,image_size,grid,content",
    [
        (28, 28, 4, "pad", None, (7, 7), (28, 28)),
        (28, 28, 4, "resize", None, (7, 7), (28, 28)),
        (37, 53, 16, "pad", None, (3, 4), (37, 53)),
        (37, 53, 16, "resize", None, (2, 3), (32, 48)),
        (1, 1, 16, "pad", None, (1, 1), (1, 1)),
        (1, 1, 16, "resize", None, (1, 1), (16, 16)),
        (37, 53, 16, "pad", 64, (4, 4), (37, 53)),
        (37, 53, 16, "resize", (32, 64), (2, 4), (32, 64)),
        (24, 40, 16, "resize", None, (2, 3), (32, 48)),  # halves round up: 1.5 -> 2, 2.5 -> 3
        (40, 24, 16, "resize", None, (3, 2), (48, 32)),
    ],
)
def test_grid_under_policies(h, w, p, policy, image_size, grid, content) -> None:
    tok = ImageTokenizer(patch_size=p, policy=policy, image_size=image_size)
    seg = tok.encode(torch.from_numpy(_u8((3, h, w))), key="k")
    gh, gw = grid
    assert seg.meta == {"grid": grid, "image_size": (h, w), "content_size": content}
    assert seg.tokens.shape == (gh * gw, p * p * 3) and seg.tokens.dtype == torch.float32
    assert torch.equal(seg.positions, grid_positions(gh, gw))
    assert seg.modality == "image" and seg.role == Role.BIDIRECTIONAL
    assert tok.grid_size(h, w) == grid


def test_pad_uses_normalised_zero_and_keeps_pixels() -> None:
    x = _u8((37, 53, 3), seed=1)
    tok = ImageTokenizer(patch_size=16, mean=[0.2, 0.4, 0.6], std=[0.5, 0.25, 0.1])
    seg = tok.encode(x, key="pad")
    canvas = _canvas(tok, seg)
    assert canvas.shape == (3, 48, 64)
    assert bool((canvas[:, 37:, :] == 0).all()) and bool((canvas[:, :, 53:] == 0).all())
    ref = torch.from_numpy(x).permute(2, 0, 1).float() / 255
    ref = (ref - torch.tensor([0.2, 0.4, 0.6]).view(3, 1, 1)) / torch.tensor([0.5, 0.25, 0.1]).view(3, 1, 1)
    assert torch.equal(canvas[:, :37, :53], ref)
    # decode undoes normalisation and padding
    back = tok.decode(seg)
    assert back.shape == (3, 37, 53)
    torch.testing.assert_close(back, torch.from_numpy(x).permute(2, 0, 1).float() / 255, atol=1e-6, rtol=0)


def test_pad_larger_than_image_size_errors() -> None:
    tok = ImageTokenizer(patch_size=8, image_size=16)
    with pytest.raises(ValueError, match=r"'big'.*larger than image_size 16x16"):
        tok.encode(torch.zeros(3, 17, 8), key="big")


def test_resize_numbers() -> None:
    tok = ImageTokenizer(patch_size=16, policy="resize")
    # constant image stays constant through the antialiased resize
    seg = tok.encode(torch.full((3, 37, 53), 0.75), key="c")
    torch.testing.assert_close(seg.tokens, torch.full_like(seg.tokens, 0.5), atol=1e-6, rtol=0)
    # pixel checkerboard (alternating columns, not 8-bit values) downscaled 2x: interior outputs average to 0.5
    x = torch.full((3, 32, 64), 0.1001)
    x[..., 1::2] = 0.8999
    tok2 = ImageTokenizer(patch_size=16, policy="resize", image_size=(16, 32), mean=0.0, std=1.0)
    img = tok2.decode(tok2.encode(x, key="chk"))
    torch.testing.assert_close(img[..., 1:-1], torch.full((3, 16, 30), 0.5), atol=1e-6, rtol=0)
    expected = TF.resize(x[None], [16, 32], antialias=True)[0]
    torch.testing.assert_close(img, expected, atol=1e-6, rtol=0)
    # 8-bit pixels are resampled by PIL in 8 bits, as torchvision / HF image processors resize PIL images
    from PIL import Image

    u8 = torch.randint(0, 256, (3, 20, 30), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for mode in ("bilinear", "bicubic"):
        tok3 = ImageTokenizer(patch_size=16, policy="resize", image_size=(48, 32), mean=0.0, std=1.0,
                              interpolation=mode)
        pil = [TF.resize(Image.fromarray(band.numpy()), [48, 32], interpolation=TF.InterpolationMode(mode))
               for band in u8]
        expected = torch.stack([torch.from_numpy(__import__("numpy").array(b)) for b in pil]).float() / 255
        torch.testing.assert_close(tok3.decode(tok3.encode(u8, key="u8")), expected, atol=1e-6, rtol=0)
    # a bicubic upsample of a hard edge overshoots; the result stays inside [0, 1] (as PIL clips)
    edge = torch.zeros(3, 8, 8) + 0.0001
    edge[..., 4:] = 0.9999
    tok4 = ImageTokenizer(patch_size=16, policy="resize", image_size=(32, 32), mean=0.0, std=1.0,
                          interpolation="bicubic")
    up = tok4.decode(tok4.encode(edge, key="edge"))
    assert up.min() >= 0.0 and up.max() <= 1.0


def test_max_patches_error_and_resize() -> None:
    x = torch.rand(3, 64, 128, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"'long'.*32 patches.*max_patches=8"):
        ImageTokenizer(patch_size=16, max_patches=8).encode(x, key="long")
    tok = ImageTokenizer(patch_size=16, max_patches=8, on_overflow="resize")
    with pytest.warns(UserWarning, match=r"'long'.*downscaled to 32x64"):
        seg = tok.encode(x, key="long")
    assert seg.meta["grid"] == (2, 4) and len(seg) == 8
    assert tok.grid_size(64, 128) == (2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(tok.encode(torch.rand(3, 32, 64), key="ok")) == 8  # fits: no warning
    with pytest.raises(ValueError, match="max_patches"):
        ImageTokenizer(patch_size=16, image_size=64, max_patches=15)


# -- channels ---------------------------------------------------------------------------------------------
def test_grey_replicated_exactly_and_luma() -> None:
    g = torch.from_numpy(_u8((1, 20, 24), seed=2))
    tok = ImageTokenizer(patch_size=4)
    a = tok.encode(g, key="g").tokens
    b = tok.encode(g.expand(3, -1, -1).clone(), key="rgb").tokens
    assert torch.equal(a, b)
    assert torch.equal(tok.encode(g[0], key="hw").tokens, a)  # (H, W) == (1, H, W)
    # RGB -> grey: ITU-R 601 luma
    tok1 = ImageTokenizer(patch_size=1, channels=1, mean=0.0, std=1.0)
    px = torch.tensor([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255]], dtype=torch.uint8)
    seg = tok1.encode(px.T.reshape(3, 1, 4), key="luma")
    torch.testing.assert_close(seg.tokens[:, 0], torch.tensor([0.299, 0.587, 0.114, 1.0]), atol=1e-6, rtol=0)


def test_rgba_composite_drop_and_keep() -> None:
    rgba = np.array([[[255, 0, 0, 128], [0, 0, 255, 0], [10, 20, 30, 255]]], dtype=np.uint8)  # (1, 3, 4)
    a = 128 / 255
    kw = dict(patch_size=1, mean=0.0, std=1.0)
    white = ImageTokenizer(**kw).encode(rgba, key="w").tokens
    expected = torch.tensor([[1.0, 1 - a, 1 - a], [1.0, 1.0, 1.0], [10 / 255, 20 / 255, 30 / 255]])
    torch.testing.assert_close(white, expected, atol=1e-6, rtol=0)
    black = ImageTokenizer(**kw, background=0.0).encode(rgba, key="b").tokens
    torch.testing.assert_close(black[0], torch.tensor([a, 0.0, 0.0]), atol=1e-6, rtol=0)
    grey_bg = ImageTokenizer(**kw, background=[0.2, 0.4, 0.6]).encode(rgba, key="g").tokens
    torch.testing.assert_close(grey_bg[1], torch.tensor([0.2, 0.4, 0.6]), atol=1e-6, rtol=0)
    dropped = ImageTokenizer(**kw, alpha="drop").encode(rgba, key="d").tokens
    torch.testing.assert_close(dropped[:2], torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]), atol=0, rtol=0)
    kept = ImageTokenizer(**kw, channels=4).encode(rgba, key="k").tokens
    torch.testing.assert_close(kept[0], torch.tensor([1.0, 0.0, 0.0, a]), atol=1e-6, rtol=0)
    opaque = ImageTokenizer(**kw, channels=4).encode(rgba[..., :3], key="o").tokens
    assert opaque[:, 3].tolist() == [1.0, 1.0, 1.0]
    # RGBA -> grey: composite over white then luma
    grey = ImageTokenizer(**kw, channels=1).encode(rgba, key="l").tokens
    torch.testing.assert_close(grey[0, 0], torch.tensor(0.299 + 0.587 * (1 - a) + 0.114 * (1 - a)), atol=1e-6, rtol=0)


def test_pil_modes() -> None:
    rgb = _u8((6, 5, 3), seed=3)
    tok = ImageTokenizer(patch_size=1, mean=0.0, std=1.0)
    ref = tok.encode(rgb, key="np").tokens
    assert torch.equal(tok.encode(Image.fromarray(rgb), key="RGB").tokens, ref)

    grey = _u8((6, 5), seed=4)
    lt = tok.encode(Image.fromarray(grey), key="L").tokens
    assert torch.equal(lt, torch.from_numpy(grey).reshape(-1, 1).float().div(255).expand(-1, 3))

    la = Image.fromarray(np.stack([np.full((2, 2), 100, np.uint8), np.full((2, 2), 128, np.uint8)], -1), "LA")
    a = 128 / 255
    tok1 = ImageTokenizer(patch_size=1, channels=1, mean=0.0, std=1.0)
    torch.testing.assert_close(tok1.encode(la, key="LA").tokens[:, 0], torch.full((4,), 100 / 255 * a + 1 - a))
    torch.testing.assert_close(tok.encode(la, key="LA3").tokens, torch.full((4, 3), 100 / 255 * a + 1 - a))

    pal = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    assert torch.equal(tok.encode(pal, key="P").tokens, tok.encode(np.asarray(pal.convert("RGB")), key="x").tokens)
    pal.info["transparency"] = 0  # palette index 0 fully transparent -> white
    pt = tok.encode(pal, key="Pt").tokens
    idx0 = torch.from_numpy(np.asarray(pal).reshape(-1) == 0)
    assert bool(idx0.any()) and bool((pt[idx0] == 1.0).all())

    rgba = Image.fromarray(_u8((4, 4, 4), seed=5), "RGBA")
    assert torch.equal(tok.encode(rgba, key="RGBA").tokens, tok.encode(np.asarray(rgba), key="x").tokens)

    cmyk = Image.fromarray(rgb).convert("CMYK")
    assert torch.equal(tok.encode(cmyk, key="CMYK").tokens, tok.encode(np.asarray(cmyk.convert("RGB")), key="x").tokens)

    bw = Image.fromarray(np.array([[0, 255]], np.uint8)).convert("1")
    assert tok.encode(bw, key="1").tokens[:, 0].tolist() == [0.0, 1.0]

    i16 = Image.fromarray(np.array([[0, 32768, 65535]], np.uint16))
    assert i16.mode == "I;16"
    torch.testing.assert_close(tok.encode(i16, key="I16").tokens[:, 0], torch.tensor([0.0, 32768 / 65535, 1.0]))
    i32 = Image.fromarray(np.array([[0, 65535]], np.int32), "I")
    assert tok.encode(i32, key="I").tokens[:, 0].tolist() == [0.0, 1.0]

    f = Image.fromarray(np.array([[0.25, 1.0]], np.float32), "F")
    assert tok.encode(f, key="F").tokens[:, 0].tolist() == [0.25, 1.0]


# -- dtypes and containers -------------------------------------------------------------------------
def test_uint8_and_float_give_same_tokens() -> None:
    x = _u8((3, 19, 23), seed=6)
    tok = ImageTokenizer(patch_size=8)
    t_u8 = tok.encode(torch.from_numpy(x), key="a").tokens
    assert torch.equal(tok.encode(torch.from_numpy(x).float() / 255, key="b").tokens, t_u8)
    hwc = np.ascontiguousarray(x.transpose(1, 2, 0))
    assert torch.equal(tok.encode(hwc, key="c").tokens, t_u8)
    assert torch.equal(tok.encode(hwc.astype(np.float32) / np.float32(255), key="d").tokens, t_u8)
    assert torch.equal(tok.encode(x.transpose(1, 2, 0), key="non-contiguous").tokens, t_u8)
    u16 = hwc.astype(np.uint16) * 257  # 257 * k / 65535 == k / 255
    torch.testing.assert_close(tok.encode(u16, key="e").tokens, t_u8, atol=1e-7, rtol=0)
    torch.testing.assert_close(tok.encode(u16.astype(">u2"), key="be").tokens, t_u8, atol=1e-7, rtol=0)
    i16 = to_image_tensor(torch.tensor([[0, 32767]], dtype=torch.int16), key="i16")
    assert i16.tolist() == [[[0.0, 1.0]]]  # other ints: divided by their dtype maximum
    b = to_image_tensor(np.array([[True, False]]), key="bool")
    assert b.tolist() == [[[1.0, 0.0]]]


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_bytes_png_jpeg_and_path(tmp_path) -> None:
    x = _u8((20, 28, 3), seed=7)
    tok = ImageTokenizer(patch_size=4)
    ref = tok.encode(x, key="ref")
    png = _png(x)
    assert torch.equal(tok.encode(png, key="png").tokens, ref.tokens)  # lossless
    assert torch.equal(tok.encode(bytearray(png), key="ba").tokens, ref.tokens)
    (tmp_path / "x.png").write_bytes(png)
    assert torch.equal(tok.encode(tmp_path / "x.png", key="path").tokens, ref.tokens)
    assert torch.equal(tok.encode(str(tmp_path / "x.png"), key="str").tokens, ref.tokens)

    smooth = np.repeat(np.linspace(0, 255, 28, dtype=np.uint8)[None, :, None], 20, 0).repeat(3, 2)
    buf = io.BytesIO()
    Image.fromarray(smooth).save(buf, format="JPEG", quality=95)
    jpg = tok.encode(buf.getvalue(), key="jpg")
    assert jpg.meta["image_size"] == (20, 28)
    decoded = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    assert torch.equal(jpg.tokens, tok.encode(decoded, key="dec").tokens)
    err = (tok.decode(jpg) - torch.from_numpy(smooth).permute(2, 0, 1).float() / 255).abs().mean()
    assert float(err) < 0.02

    # EXIF orientation 6 ("rotate 90 clockwise to display") is applied to decoded files
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(x).save(buf, format="PNG", exif=exif)
    rotated = tok.encode(buf.getvalue(), key="exif")
    assert rotated.meta["image_size"] == (28, 20)
    assert torch.equal(rotated.tokens, tok.encode(np.ascontiguousarray(np.rot90(x, -1)), key="r").tokens)

    png16 = _png(np.array([[0, 65535], [257, 0]], np.uint16))
    t16 = ImageTokenizer(patch_size=1, channels=1, mean=0.0, std=1.0).encode(png16, key="p16").tokens
    torch.testing.assert_close(t16[:, 0], torch.tensor([0.0, 1.0, 1 / 255, 0.0]))


def test_encode_batch_matches_encode() -> None:
    x = torch.from_numpy(_u8((4, 4, 21, 30), seed=8))
    for tok in (
        ImageTokenizer(patch_size=8, cls=True),
        ImageTokenizer(patch_size=8, policy="resize", channels=1),
        ImageTokenizer(patch_size=8, policy="pad", image_size=(24, 32), mean=[0.1, 0.2, 0.3]),
    ):
        tokens, positions, grid = tok.encode_batch(x, key="b")
        for i in range(4):
            seg = tok.encode(x[i], key=str(i))
            assert torch.equal(tokens[i], seg.tokens)
            assert torch.equal(positions, seg.positions) and grid == seg.meta["grid"]
    with pytest.raises(ValueError, match=r"'b'.*\(B, C, H, W\)"):
        ImageTokenizer().encode_batch(torch.zeros(3, 16, 16), key="b")


# -- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw,exc,pattern",
    [
        (torch.tensor([[0.1, float("nan")]]), ValueError, "NaN or inf"),
        (np.array([[0.1, np.inf]], np.float32), ValueError, "NaN or inf"),
        (torch.zeros(8), ValueError, r"expected a tensor \(C, H, W\) or \(H, W\)"),
        (torch.zeros(2, 3, 8, 8), ValueError, "use encode_batch"),
        (torch.zeros(2, 8, 8), ValueError, r"C in \(1, 3, 4\), got shape \(2, 8, 8\)"),
        (torch.zeros(8, 8, 3), ValueError, "channels-last"),
        (np.zeros((8, 8, 2), np.uint8), ValueError, r"numpy array \(H, W\) or \(H, W, C\)"),
        (np.zeros((1, 8, 8, 3), np.uint8), ValueError, "numpy array"),
        (torch.zeros(3, 0, 5), ValueError, "is empty"),
        (np.zeros((0, 5), np.uint8), ValueError, "is empty"),
        (b"definitely not an image", ValueError, "could not decode 23 bytes"),
        (_png(np.zeros((8, 8), np.uint8))[:40], ValueError, "could not decode"),
        (torch.full((3, 4, 4), 255.0), ValueError, r"\[0, 1\].*divide 0-255"),
        (torch.full((3, 4, 4), -1, dtype=torch.int16), ValueError, ">= 0"),
        ([[0, 1]], TypeError, "expected a torch.Tensor"),
        (np.array([["a"]]), TypeError, "unsupported numpy dtype"),
        ("/nonexistent/img.png", ValueError, "cannot read image file"),
    ],
)
def test_bad_inputs_name_the_key(raw, exc, pattern) -> None:
    with pytest.raises(exc, match=pattern) as info:
        ImageTokenizer(patch_size=4).encode(raw, key="sample-42")
    assert "'sample-42'" in str(info.value)


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="multiples of patch_size"):
        ImageTokenizer(patch_size=16, image_size=40)
    with pytest.raises(ValueError, match="channels"):
        ImageTokenizer(channels=2)
    with pytest.raises(ValueError, match="policy"):
        ImageTokenizer(policy="crop")
    with pytest.raises(ValueError, match="mean needs 1 or 3"):
        ImageTokenizer(mean=[0.5, 0.5])
    with pytest.raises(ValueError, match="std must be > 0"):
        ImageTokenizer(std=0.0)


# -- CLS + embedder -------------------------------------------------------------------------------------
def test_cls_flag_column_and_positions() -> None:
    tok = ImageTokenizer(patch_size=4, cls=True)
    seg = tok.encode(torch.from_numpy(_u8((3, 8, 12), seed=9)), key="cls")
    assert seg.tokens.shape == (1 + 6, 4 * 4 * 3 + 1) and tok.token_dim == 49
    assert seg.tokens[:, -1].tolist() == [1.0] + [0.0] * 6
    assert bool((seg.tokens[0, :-1] == 0).all())
    assert seg.positions.tolist() == [[0, 0]] + grid_positions(2, 3).tolist()
    plain = ImageTokenizer(patch_size=4).encode(torch.from_numpy(_u8((3, 8, 12), seed=9)), key="p")
    assert torch.equal(seg.tokens[1:, :-1], plain.tokens)
    assert torch.equal(tok.decode(seg), ImageTokenizer(patch_size=4).decode(plain))


def test_embedder_shapes_and_cls_vector() -> None:
    torch.manual_seed(0)
    tok = ImageTokenizer(patch_size=4, cls=True)
    emb = tok.embedder(32)
    assert isinstance(emb, ImagePatchEmbedder)
    with torch.no_grad():
        emb.type_embedding.weight.normal_()
    segs = [tok.encode(torch.rand(3, h, w), key=str(i)) for i, (h, w) in enumerate([(8, 8), (5, 13), (4, 4)])]
    packed = torch.cat([s.tokens for s in segs])  # packed along dim 0
    out = emb(packed)
    assert out.shape == (5 + 9 + 2, 32)
    flag = packed[:, -1] == 1
    assert flag.sum().item() == 3
    expected_cls = emb.cls_token + emb.type_embedding.weight
    assert torch.equal(out[flag], expected_cls.expand(3, -1))
    expected_patch = emb.proj(packed[~flag, :-1]) + emb.type_embedding.weight
    torch.testing.assert_close(out[~flag], expected_patch)
    # per-token: embedding one sample alone gives the same rows
    torch.testing.assert_close(emb(segs[1].tokens), out[5:14])
    # compile friendly: one graph, same numbers
    compiled = torch.compile(emb, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(packed), out)

    plain = ImageTokenizer(patch_size=4, channels=1).embedder(16)
    assert plain.cls_token is None and plain.proj.in_features == 16
    assert plain(torch.zeros(7, 16)).shape == (7, 16)


# -- persistence / registry -------------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path) -> None:
    tok = ImageTokenizer(
        patch_size=8, channels=1, image_size=(16, 24), policy="resize", mean=0.3, std=[0.2],
        max_patches=100, cls=True, alpha="drop", background=[0.0, 0.5, 1.0],
    )
    cfg = tok.config()
    assert json.loads(json.dumps(cfg)) == cfg
    tok.save(tmp_path)
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["modality"] == "image"
    back = Tokenizer.load(tmp_path)
    assert isinstance(back, ImageTokenizer) and back.config() == cfg
    x = torch.rand(4, 30, 17, generator=torch.Generator().manual_seed(3))
    assert torch.equal(back.encode(x, key="x").tokens, tok.encode(x, key="x").tokens)
    assert ImageTokenizer(**ImageTokenizer().config()).config() == ImageTokenizer().config()
    assert get_tokenizer("image") is ImageTokenizer
    assert ImageTokenizer.modality == "image" and ImageTokenizer.role == Role.BIDIRECTIONAL
