"""Whisper's alignment heads (omni/interop/whisper.py -> export config "alignment_heads" -> omni/timestamps.py): a HF
directory's generation_config.json carries them into the export and back out, the cross-attention DTW reads only
those heads, and an openai .pt is named by its sha256 (the vendored copy of openai-whisper's table)."""

from __future__ import annotations

import base64
import gzip
import json

import numpy as np
import pytest
import torch

from omni.interop import convert, read_model, to_peer
from omni.files import sha256_file
from omni.interop import whisper as interop
from omni.pipelines.timing import time_windows
from omni.pipelines.transcribe import load_recognizer
from omni.timestamps import attention_word_timings, check_alignment_heads, text_ids
from omni.tokenizers.text import TextTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

TPS = 50.0
DIMS = dict(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=4, n_audio_layer=2, n_vocab=51865,
            n_text_ctx=448, n_text_state=64, n_text_head=4, n_text_layer=2)
HEADS = [[0, 1], [1, 2]]  # diagonal in the constructed maps; every other head anti-diagonal


def constructed_cross(n_rows: int, frames: int) -> list[torch.Tensor]:
    """Per layer (4 heads, 2 + n_rows - 1 + ... rows, frames): the HEADS look at frames 8k .. 8k + 7 from the query
    predicting token k, the other six heads at the mirror image (frames from the end)."""
    L, H, P = 2, 4, 2
    cross = torch.full((L, H, P + n_rows, frames), 0.01)
    for k in range(n_rows):
        for layer in range(L):
            for head in range(H):
                a = 8 * k if [layer, head] in HEADS else frames - 8 * (k + 1)
                cross[layer, head, P - 1 + k, a:a + 8] = 1.0
    return list(cross / cross.sum(-1, keepdim=True))


def test_dtw_reads_only_the_alignment_heads():
    text = TextTokenizer()
    ids = text_ids(text, "one two three")
    frames = 8 * (len(ids) + 1)
    cross = constructed_cross(len(ids) + 1, frames)
    words, _ = attention_word_timings(cross, [1.0] * len(ids), text, ids, frames, TPS, heads=HEADS)
    assert [t for w in words for t in (w.start, w.end)] == pytest.approx(
        [t for k in range(3) for t in (max(8 * k - 0.5, 0) / TPS, (8 * k + 7.5) / TPS)])
    # the default heads (all of layer 1: three anti-diagonal, one diagonal) find no such path
    default, _ = attention_word_timings(cross, [1.0] * len(ids), text, ids, frames, TPS)
    assert [t for w in default for t in (w.start, w.end)] != pytest.approx([t for w in words for t in (w.start, w.end)])
    with pytest.raises(ValueError, match=r"alignment heads \[\(2, 0\)\] lie outside this decoder \(2 layers x 4"):
        check_alignment_heads([[2, 0]], 2, 4)


def test_hf_generation_config_heads_into_the_export_and_back(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from test_interop_whisper import hf_model

    hf_model(DIMS, seed=1).save_pretrained(tmp_path / "hf")
    generation = tmp_path / "hf" / "generation_config.json"
    settings = json.loads(generation.read_text()) if generation.is_file() else {}
    generation.write_text(json.dumps({**settings, "alignment_heads": HEADS}))
    config, _, _ = read_model(tmp_path / "hf")
    assert config["alignment_heads"] == HEADS
    export = convert(tmp_path / "hf", tmp_path / "omni")
    model, audio, text = load_recognizer(export, "cpu")
    assert model.alignment_heads == HEADS

    # time_windows hands the model's heads to the DTW (and an explicit list wins)
    seen = []
    real = attention_word_timings

    def spy(*args, **kwargs):
        seen.append(kwargs.get("heads"))
        return real(*args, **kwargs)

    monkeypatch.setattr("omni.pipelines.timing.attention_word_timings", spy)
    clip = 0.1 * torch.randn(16000, generator=torch.Generator().manual_seed(0))
    time_windows(model, audio, text, [clip], ["one two"], [0.0], method="attention")
    time_windows(model, audio, text, [clip], ["one two"], [0.0], method="attention", alignment_heads=[[0, 0]])
    assert seen == [HEADS, [[0, 0]]]

    out = to_peer(export, tmp_path / "back", "hf")
    assert transformers.GenerationConfig.from_pretrained(out).alignment_heads == HEADS
    back = json.loads((out / "generation_config.json").read_text())
    hf_config = json.loads((out / "config.json").read_text())  # the token ids HF would derive without the file
    assert back["decoder_start_token_id"] == hf_config["decoder_start_token_id"] and back["max_length"] == 448
    generation.write_text(json.dumps({"alignment_heads": [[2, 0]]}))
    with pytest.raises(interop.ConversionError, match=r"alignment_heads \[\[2, 0\]\] do not fit the decoder"):
        read_model(tmp_path / "hf")


def test_openai_file_named_by_its_sha256(tmp_path, monkeypatch):
    whisper = pytest.importorskip("whisper")
    from test_interop_whisper import openai_model

    # every released file's hash names its model and heads
    table = interop.openai_checkpoints()
    assert len(table) >= 12
    for name, url in whisper._MODELS.items():
        sha = url.split("/")[-2]
        assert table[sha][1] == whisper._ALIGNMENT_HEADS[name]
        assert table[sha][0] == name or name in ("large", "turbo")  # aliases of the same file
    tiny = whisper.model.Whisper(whisper.model.ModelDimensions(**dict(DIMS, n_audio_ctx=4, n_vocab=100, n_text_ctx=8,
                                                                       n_text_layer=4, n_text_head=6,
                                                                       n_audio_state=24, n_text_state=24)))
    tiny.set_alignment_heads(whisper._ALIGNMENT_HEADS["tiny"])
    assert interop.decode_alignment_heads(whisper._ALIGNMENT_HEADS["tiny"], 4, 6) == \
        tiny.alignment_heads.to_dense().nonzero().tolist()

    path = tmp_path / "fine-tune.pt"
    torch.save({"dims": DIMS, "model_state_dict": openai_model(DIMS).state_dict()}, path)
    assert interop.openai_model_name(path) is None and "alignment_heads" not in read_model(path)[0]
    mask = np.zeros((2, 4), dtype=bool)
    mask[tuple(np.array(HEADS).T)] = True
    dump = base64.b85encode(gzip.compress(mask.tobytes()))
    monkeypatch.setattr(interop, "openai_checkpoints", lambda: {sha256_file(path): ("fake", dump)})
    assert interop.openai_model_name(path) == "fake"
    assert read_model(path)[0]["alignment_heads"] == HEADS
