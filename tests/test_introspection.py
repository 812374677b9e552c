"""omni/introspect.py: the reference attention reproduces the fast path for every mask kind (full, causal, dense
packed, FlexAttention BlockMask on CPU, cross-attention with a memory mask, GQA/MQA, 1-D and 2-D RoPE, KV cache
incremental decoding == full recompute); capture on == off for every model class; probabilities are
distributions that are 0 on masked keys; rollout / patch maps; packed per-document / per-segment views; nothing
left behind when capture exits."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from omni.introspect import (attention_rollout, block_mask_to_dense, capture, dense_mask, document_attention,
                             image_attention, packed_layout, patch_attention, reference_attention, segment_attention)
from omni.model import OmniModel
from omni.packing import Packer, block_mask
from omni.rl import DecisionTransformer
from omni.segment import Sample
from omni.speech import SpeechRecognizer
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.image import ImageTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.tokenizers.trajectory import TrajectoryTokenizer
from omni.trunk import CrossAttention, SelfAttention, Trunk, attend, preset
from omni.vision import ImageClassifier

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

TOL = dict(atol=2e-6, rtol=1e-5)  # one attention op, fp32
MODEL_TOL = dict(atol=1e-5, rtol=1e-5)  # a whole model: rounding differences grow through the layers


def assert_close_scaled(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal to fp32 rounding relative to the tensor's scale (the residual stream of the noisy models grows
    to ~60)."""
    torch.testing.assert_close(a, b, atol=1e-6 * max(1.0, float(b.abs().max())), rtol=1e-5)


def noisy(model: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> torch.nn.Module:
    """Enlarged random weights: attention far from uniform and outputs far from zero (zero-initialised heads),
    so comparisons mean something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def check_distribution(probs: torch.Tensor, allowed: torch.Tensor | None) -> None:
    """Rows sum to 1 over the keys and are exactly 0 on masked keys."""
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-5, rtol=0)
    if allowed is not None:
        assert (probs.masked_select(~allowed.expand_as(probs)) == 0).all()
        assert (probs.masked_select(allowed.expand_as(probs)) > 0).all()  # softmax of finite scores


def packed_batch(seed: int = 0):
    """Three documents (image + text, text alone, image + text) packed into one 128-token row."""
    g = torch.Generator().manual_seed(seed)
    image, text = ImageTokenizer(patch_size=4, channels=1), TextTokenizer()
    samples = []
    for i, (hw, words) in enumerate([((8, 12), "a pair of trousers"), (None, "an ankle boot"),
                                     ((12, 8), "a coat")]):
        segs = [image.encode(torch.rand(1, *hw, generator=g), key=str(i))] if hw else []
        segs.append(text.encode(words, key=str(i)))
        samples.append(Sample(segs, key=f"doc{i}"))
    return image, text, Packer()(samples)


# ----------------------------------------------------------------------------------------------------
# The reference path == the fast path


def qkv(B=2, H=4, G=4, T=7, S=7, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g), torch.randn(B, G, S, D, generator=g),
            torch.randn(B, G, S, D, generator=g))


@pytest.mark.parametrize("G", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("kind", ["full", "causal", "padding", "dense"])
def test_reference_attention_matches_attend(kind, G):
    q, k, v = qkv(G=G)
    B, T = 2, 7
    if kind == "full":
        mask = None
    elif kind == "causal":
        mask = "causal"
    elif kind == "padding":  # key padding (B, 1, 1, S): row 1 has 3 pad keys
        mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
        mask[1, ..., 4:] = False
    else:  # a dense per-query mask: two documents, the second causal
        doc = torch.tensor([0, 0, 0, 1, 1, 1, 1])
        mask = (doc[:, None] == doc[None]) & ((doc[:, None] == 0) | (torch.arange(T)[None] <= torch.arange(T)[:, None]))
        mask = mask[None, None]
    out, probs = reference_attention(q, k, v, mask)
    torch.testing.assert_close(out, attend(q, k, v, mask), **TOL)
    # probabilities @ V (heads sharing their K/V head) is the attention output
    torch.testing.assert_close(probs @ v.repeat_interleave(4 // G, dim=1), attend(q, k, v, mask), **TOL)
    assert probs.shape == (B, 4, T, T)
    check_distribution(probs, dense_mask(mask, T, T, "cpu"))


def test_fully_masked_query_gets_zeros():
    q, k, v = qkv()
    mask = torch.ones(2, 1, 7, 7, dtype=torch.bool)
    mask[0, :, 2] = False  # query 2 of row 0 may see nothing
    out, probs = reference_attention(q, k, v, mask)
    assert (probs[0, :, 2] == 0).all() and (out[0, :, 2] == 0).all()
    check_distribution(probs[1], None)


@pytest.mark.parametrize("block_size", [128, 16])
def test_block_mask_to_dense_and_flex_on_cpu(block_size):
    _, _, batch = packed_batch()
    block = block_mask(batch.document, batch.segment, batch.causal, block_size=block_size)
    dense = batch.attention_mask("dense")
    if block_size == 16:  # 8 x 8 tiles: full, partial and skipped ones all occur
        assert int(block.full_kv_num_blocks.sum()) > 0 and int(block.kv_num_blocks.sum()) > 0
        assert int((block.full_kv_num_blocks + block.kv_num_blocks).sum()) < 64
    assert torch.equal(block_mask_to_dense(block), dense)
    q, k, v = qkv(B=1, H=4, G=2, T=128, S=128, D=16)
    out, probs = reference_attention(q, k, v, block)  # the BlockMask converted through its mask_mod
    torch.testing.assert_close(out, attend(q, k, v, block), **TOL)  # FlexAttention (eager, CPU)
    torch.testing.assert_close(out, attend(q, k, v, dense), **TOL)
    check_distribution(probs, dense)


def test_block_mask_to_dense_follows_the_block_structure():
    """Blocks decide first, as in the compiled kernels: a full block is attended whatever mask_mod says, an
    unlisted block is not (here mask_mod would allow it). 4 x 4 tiles of 16: partial diagonal, full below it."""
    i32 = torch.int32
    diagonal = torch.arange(4, dtype=i32).view(1, 1, 4, 1).expand(1, 1, 4, 4).contiguous()
    below = (torch.arange(4, dtype=i32) - 1).clamp_min(0).view(1, 1, 4, 1).expand(1, 1, 4, 4).contiguous()
    mask = BlockMask.from_kv_blocks(torch.ones(1, 1, 4, dtype=i32), diagonal,
                                    torch.tensor([[[0, 1, 1, 1]]], dtype=i32), below,
                                    BLOCK_SIZE=16, mask_mod=lambda b, h, q, kv: q == kv)
    t = torch.arange(64) // 16
    want = (t[:, None] == t[None] + 1) | torch.eye(64, dtype=torch.bool)  # full blocks + mask_mod on the diagonal
    assert torch.equal(block_mask_to_dense(mask), want[None, None])


@pytest.mark.parametrize("positions", ["rope", "rope2d", "learned"])
@pytest.mark.parametrize("mask", ["dense", "block"])
def test_trunk_packed_capture_equals_fast_path(positions, mask):
    _, _, batch = packed_batch()
    torch.manual_seed(0)
    trunk = noisy(Trunk(preset("tiny", positions=positions, n_kv_heads=2, n_layers=3)))
    x = torch.randn(*batch.shape, 64)
    m = batch.attention_mask(mask)
    with torch.no_grad():
        fast = trunk(x, batch.positions, m)
        with capture(trunk) as rec:
            slow = trunk(x, batch.positions, m)
        assert torch.equal(trunk(x, batch.positions, m), fast)  # after the block: the fast path, bit for bit
    torch.testing.assert_close(slow, fast, **MODEL_TOL)
    assert sorted(rec.attention) == [f"trunk.blocks.{i}.attn" for i in range(3)]  # a bare Trunk is "trunk"
    dense = batch.attention_mask("dense")
    for probs in rec.attention.values():
        assert probs.shape == (1, 4, 128, 128)
        check_distribution(probs, dense)
    hidden = rec.hidden_states["trunk"]
    assert len(hidden) == 4 and all(h.shape == (1, 128, 64) for h in hidden)
    torch.testing.assert_close(trunk.norm(hidden[-1]), fast, **MODEL_TOL)  # the last block's output, before the norm
    if positions == "learned":  # block 0's input is the embeddings plus the absolute positions
        assert torch.equal(hidden[0], x + trunk.absolute(batch.positions))
    else:
        assert torch.equal(hidden[0], x)


def test_bfloat16_capture_within_rounding():
    torch.manual_seed(0)
    trunk = Trunk(preset("tiny", n_kv_heads=1)).to(torch.bfloat16).eval()
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        fast = trunk(x, mask="causal")
        with capture(trunk) as rec:
            slow = trunk(x, mask="causal")
    assert slow.dtype == torch.bfloat16 and rec.attention["trunk.blocks.0.attn"].dtype == torch.float32
    torch.testing.assert_close(slow, fast, atol=3e-2, rtol=2e-2)  # bf16: 8 bits of mantissa


# ----------------------------------------------------------------------------------------------------
# Cross-attention, KV cache


def test_cross_attention_with_memory_mask():
    torch.manual_seed(0)
    dec = noisy(Trunk(preset("tiny", cross_attention=True, n_kv_heads=1)))
    x, memory = torch.randn(2, 5, 64), torch.randn(2, 9, 64)
    memory_mask = torch.ones(2, 9, dtype=torch.bool)
    memory_mask[0, 6:] = False
    with torch.no_grad():
        fast = dec(x, mask="causal", memory=memory, memory_mask=memory_mask)
        with capture(dec) as rec:
            slow = dec(x, mask="causal", memory=memory, memory_mask=memory_mask)
    torch.testing.assert_close(slow, fast, **MODEL_TOL)
    assert sorted(rec.attention) == ["trunk.blocks.0.attn", "trunk.blocks.0.cross", "trunk.blocks.1.attn",
                                     "trunk.blocks.1.cross"]
    cross = rec.attention["trunk.blocks.1.cross"]
    assert cross.shape == (2, 4, 5, 9)
    check_distribution(cross, memory_mask[:, None, None, :])
    check_distribution(rec.attention["trunk.blocks.1.attn"], torch.ones(5, 5, dtype=torch.bool).tril())
    assert [a.shape for a in rec.layers("cross")] == [(2, 4, 5, 9)] * 2 and torch.equal(rec.layers("cross")[1], cross)


@pytest.mark.parametrize("slots", [False, True], ids=["length", "cache_position"])
def test_kv_cache_incremental_decode_equals_full_recompute(slots):
    torch.manual_seed(0)
    dec = noisy(Trunk(preset("tiny", cross_attention=True, n_kv_heads=2)))
    x, memory = torch.randn(2, 6, 64), torch.randn(2, 9, 64)
    memory_mask = torch.ones(2, 9, dtype=torch.bool)
    memory_mask[1, 5:] = False
    with torch.no_grad():
        with capture(dec) as full:
            ref = dec(x, mask="causal", memory=memory, memory_mask=memory_mask)
        cache = dec.new_cache(2, 10)
        with capture(dec) as inc:
            outs = [dec(x[:, :3], memory=memory, memory_mask=memory_mask, cache=cache,
                         cache_position=torch.tensor(0) if slots else None)]  # the prompt
            for t in range(3, 6):  # then one token per step
                outs.append(dec(x[:, t:t + 1], memory=memory, memory_mask=memory_mask, cache=cache,
                                cache_position=torch.tensor(t) if slots else None))
    torch.testing.assert_close(torch.cat(outs, 1), ref, **MODEL_TOL)
    for i in range(2):
        steps = inc.steps[f"trunk.blocks.{i}.attn"]
        assert [s.shape for s in steps] == [(2, 4, 3, 10)] + [(2, 4, 1, 10)] * 3  # keys: the whole static buffer
        self_attn = inc.attention[f"trunk.blocks.{i}.attn"]  # (B, H, 6, max_length): steps appended along queries
        torch.testing.assert_close(self_attn[..., :6], full.attention[f"trunk.blocks.{i}.attn"], **TOL)
        assert (self_attn[..., 6:] == 0).all()  # slots not written yet
        torch.testing.assert_close(inc.attention[f"trunk.blocks.{i}.cross"], full.attention[f"trunk.blocks.{i}.cross"],
                                   **TOL)
    for a, b in zip(inc.hidden_states["trunk"], full.hidden_states["trunk"]):
        assert_close_scaled(a, b)


# ----------------------------------------------------------------------------------------------------
# Every model class


def test_image_classifier_capture_and_maps():
    torch.manual_seed(0)
    images = torch.rand(2, 1, 12, 16)  # a 3 x 4 grid: rows and columns cannot be swapped unnoticed
    for cls, pool in [(True, "cls"), (True, "mean"), (False, "mean")]:
        tok = ImageTokenizer(patch_size=4, channels=1, cls=cls)
        model = noisy(ImageClassifier(tok, preset("tiny", positions="rope2d", n_layers=3), 10, pool=pool))
        with torch.no_grad():
            fast = model(images)
            with capture(model) as rec:
                slow = model(images)
        torch.testing.assert_close(slow, fast, **MODEL_TOL)
        n = 12 + cls
        assert rec.attention["trunk.blocks.2.attn"].shape == (2, 4, n, n)
        for method in ("rollout", "last"):
            heat = image_attention(model, images, method=method)
            assert heat.shape == (2, 3, 4)
            torch.testing.assert_close(heat.sum((1, 2)), torch.ones(2))
        # "last" is the last layer's head-averaged row of the pooled query, patches only, renormalised
        last = rec.attention["trunk.blocks.2.attn"].mean(1)
        row = last[:, 0] if pool == "cls" else last.mean(1)
        want = row[:, int(cls):] / row[:, int(cls):].sum(-1, keepdim=True)
        torch.testing.assert_close(image_attention(model, images, method="last"), want.view(2, 3, 4), **TOL)
        rollout = attention_rollout(rec.layers("attn"))
        row = rollout[:, 0] if pool == "cls" else rollout.mean(1)
        want = row[:, int(cls):] / row[:, int(cls):].sum(-1, keepdim=True)
        torch.testing.assert_close(image_attention(model, images), want.view(2, 3, 4), **TOL)


def test_image_attention_any_size_and_packed_models_agree():
    """The prediction paths: an image Segment through ImageClassifier.token_features, and the same image packed
    alone through an OmniModel / MultitaskModel holding the same weights, give the same maps."""
    from omni.multitask import ClassifyTask, MultitaskModel

    tok = ImageTokenizer(patch_size=4, channels=1, cls=True)
    torch.manual_seed(0)
    vit = noisy(ImageClassifier(tok, preset("tiny", positions="rope2d"), 3, pool="cls"))
    image = torch.rand(1, 12, 20)
    seg = tok.encode(image)
    assert seg.meta["grid"] == (3, 5)
    multi = MultitaskModel([ClassifyTask("image", tok, [image], [0], n_classes=3, pool="cls")],
                           preset("tiny", positions="rope2d"))
    multi.omni.embedders["image"].load_state_dict(vit.embed.state_dict())
    multi.omni.trunk.load_state_dict(vit.trunk.state_dict())
    for method in ("rollout", "last"):
        want = image_attention(vit, image[None], method=method)  # the uniform-batch path
        assert want.shape == (1, 3, 5)
        torch.testing.assert_close(image_attention(vit, seg, method=method), want, **MODEL_TOL)
        torch.testing.assert_close(image_attention(multi, seg, method=method, head="image"), want, **MODEL_TOL)
        mean = image_attention(multi.omni, seg, method=method)  # no head named: the mean query
        torch.testing.assert_close(mean, image_attention(vit, image[None], method=method, query="mean"), **MODEL_TOL)


def test_forward_is_forward_head_of_forward_features():
    tok = ImageTokenizer(patch_size=4, channels=1)
    torch.manual_seed(0)
    model = noisy(ImageClassifier(tok, preset("tiny"), 5))
    images = torch.rand(2, 1, 8, 8)
    with torch.no_grad():
        features = model.forward_features(images)
        assert torch.equal(model.forward_head(features), model(images))
        pooled = model.forward_head(features, pre_logits=True)  # timm's pre_logits: what the Linear reads
        assert pooled.shape == (2, 64)
        torch.testing.assert_close(model.head.proj(pooled), model(images))
    dt_tok = TrajectoryTokenizer(4, n_actions=2, context=4)
    dt = noisy(DecisionTransformer(dt_tok, preset("dt", d_model=32, n_layers=1, n_heads=2)))
    tokens = torch.randn(2, 6, dt_tok.feature_dim)
    with torch.no_grad():
        assert torch.equal(dt.forward_head(dt.forward_features(tokens)), dt(tokens))


def test_speech_recognizer_encoder_decoder_and_cached_decoding():
    audio, text = AudioTokenizer(), TextTokenizer()
    torch.manual_seed(0)
    model = noisy(SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True)), scale=0.1)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 20, audio.encode(torch.zeros(1600)).tokens.shape[-1], generator=g)
    audio_mask = torch.ones(2, 20, dtype=torch.bool)
    audio_mask[1, 14:] = False
    ids = torch.randint(0, 500, (2, 5), generator=g)
    with torch.no_grad():
        fast = model(feats, audio_mask, ids)
        with capture(model) as rec:
            slow = model(feats, audio_mask, ids)
        torch.testing.assert_close(slow, fast, atol=1e-5, rtol=1e-5)
        assert sorted(rec.hidden_states) == ["decoder", "encoder"]
        assert set(rec.attention) == {*(f"encoder.blocks.{i}.attn" for i in range(2)),
                                      *(f"decoder.blocks.{i}.{k}" for i in range(2) for k in ("attn", "cross"))}
        enc = rec.attention["encoder.blocks.0.attn"]
        assert enc.shape == (2, 4, 20, 20)
        check_distribution(enc, audio_mask[:, None, None, :])
        cross = rec.attention["decoder.blocks.1.cross"]
        assert cross.shape == (2, 4, 5, 20)
        check_distribution(cross, audio_mask[:, None, None, :])
        # incremental decoding (the timestamps' alignment source): cross-attention steps == teacher forcing
        memory = model.encode(feats, audio_mask)
        cache = model.new_cache(memory, 8)
        with capture(model, hidden_states=False, layers=lambda n: n.endswith("cross")) as inc:
            model.logits(ids[:, :2], memory, audio_mask, cache)
            for t in range(2, 5):
                model.logits(ids[:, t:t + 1], None, audio_mask, cache)
        assert sorted(inc.attention) == ["decoder.blocks.0.cross", "decoder.blocks.1.cross"]
        torch.testing.assert_close(inc.attention["decoder.blocks.1.cross"], cross, **TOL)


def test_decision_transformer_with_and_without_cache():
    tok = TrajectoryTokenizer(4, n_actions=2, rtg_scale=100.0, max_timestep=50, context=4)
    torch.manual_seed(0)
    model = noisy(DecisionTransformer(tok, preset("dt", d_model=32, n_layers=2, n_heads=2)))
    tokens = torch.randn(2, 6, tok.feature_dim)
    with torch.no_grad():
        fast = model(tokens)
        with capture(model) as full:
            slow = model(tokens)
        cache = model.new_cache(2)
        with capture(model) as inc:
            for t in range(6):
                model(tokens[:, t:t + 1], cache)
    torch.testing.assert_close(slow, fast, **MODEL_TOL)
    with torch.no_grad(), capture(model, hidden_states=False, layers="trunk.blocks.1.attn") as one:
        model(tokens)  # one layer on the reference path, the other on SDPA
    assert list(one.attention) == ["trunk.blocks.1.attn"] and not one.hidden_steps
    torch.testing.assert_close(one.attention["trunk.blocks.1.attn"], full.attention["trunk.blocks.1.attn"], **TOL)
    for i in range(2):
        probs = full.attention[f"trunk.blocks.{i}.attn"]
        check_distribution(probs, torch.ones(6, 6, dtype=torch.bool).tril())
        torch.testing.assert_close(inc.attention[f"trunk.blocks.{i}.attn"][..., :6], probs, **TOL)


def test_omni_and_multitask_model_packed_views():
    from omni.multitask import ClassifyTask, LMTask, MultitaskModel

    image, text, batch = packed_batch()
    torch.manual_seed(0)
    model = noisy(OmniModel({"image": image, "text": text}, preset("tiny", positions="rope2d")))
    with torch.no_grad():
        fast = model(batch)
        with capture(model) as rec:
            slow = model(batch)
    torch.testing.assert_close(slow, fast, **MODEL_TOL)
    attn = rec.attention["trunk.blocks.1.attn"]
    layout = packed_layout(batch)
    assert [(d.key, [s.modality for s in d.segments]) for d in layout] == [
        ("doc0", ["image", "text"]), ("doc1", ["text"]), ("doc2", ["image", "text"])]
    n_img = 2 * 3  # an 8 x 12 image in 4 x 4 patches
    n_txt = layout[0].segments[1].stop - layout[0].segments[1].start
    t2i = segment_attention(attn, batch, 0, query="text", key="image")
    assert t2i.shape == (4, n_txt, n_img)
    t2t = segment_attention(attn, batch, 0, query=1, key=-1)  # segment indices: text -> text
    # a document's rows are all inside the document: text attends image (prefix) + text (causal) = 1
    torch.testing.assert_close(t2i.sum(-1) + t2t.sum(-1), torch.ones(4, n_txt), **TOL)
    assert (t2t.triu(1) == 0).all()  # causal text
    assert (segment_attention(attn, batch, 2, "image", "text") == 0).all()  # an image never sees its caption
    doc = document_attention(attn, batch, 1)
    torch.testing.assert_close(doc.sum(-1), torch.ones(doc.shape[:-1]), **TOL)
    with pytest.raises(ValueError, match="no 'image' segment"):
        segment_attention(attn, batch, 1, "text", "image")

    # a batch of several rows: each document's block == its attention packed alone
    g = torch.Generator().manual_seed(1)
    samples = {f"r{i}": Sample([image.encode(torch.rand(1, 8, 8, generator=g)), text.encode(words)], key=f"r{i}")
               for i, words in enumerate(["a shirt", "a bag", "a dress", "a sandal"])}
    rows = Packer(row_length=32, block_size=16)(list(samples.values()))
    assert rows.shape[0] == 2 and len({span.row for span in packed_layout(rows)}) == 2  # 4 documents in 2 rows
    with torch.no_grad(), capture(model, hidden_states=False) as rec_rows:
        model(rows)
    for d, span in enumerate(packed_layout(rows)):
        alone = Packer(block_size=16)([samples[span.key]])
        with torch.no_grad(), capture(model, hidden_states=False) as rec_alone:
            model(alone)
        for name, probs in rec_rows.attention.items():
            torch.testing.assert_close(document_attention(probs, rows, d),
                                       document_attention(rec_alone.attention[name], alone, 0), **TOL)

    tasks = [ClassifyTask("image", image, [torch.rand(1, 8, 8)], [0], n_classes=3),
             LMTask("text", text, ["a coat"])]
    multi = MultitaskModel(tasks, preset("tiny", positions="rope2d"))
    with torch.no_grad(), capture(multi) as rec:
        multi.forward_features(batch)
    assert sorted(rec.attention) == ["omni.trunk.blocks.0.attn", "omni.trunk.blocks.1.attn"]
    assert list(rec.hidden_states) == ["omni.trunk"]
    with pytest.raises(ValueError, match="no attention module named"), capture(multi, layers=["trunk.blocks.0.attn"]):
        pass


# ----------------------------------------------------------------------------------------------------
# Rollout and patch maps by hand


def test_attention_rollout_numbers():
    a1 = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])  # (B=1, T=2, T) heads fused
    a2 = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]])
    r1 = (a1 + torch.eye(2)) / (a1 + torch.eye(2)).sum(-1, keepdim=True)  # [[1, 0], [.25, .75]]
    r2 = (a2 + torch.eye(2)) / 2  # [[.5, .5], [0, 1]]
    torch.testing.assert_close(attention_rollout([a1, a2]), r2 @ r1)
    torch.testing.assert_close(attention_rollout([a1, a2]), torch.tensor([[[0.625, 0.375], [0.25, 0.75]]]))
    heads = torch.stack([a1[0], a2[0]])[None]  # (1, H=2, 2, 2): "mean" fuses them first
    torch.testing.assert_close(attention_rollout([heads]), attention_rollout([(a1 + a2) / 2]))
    with pytest.raises(ValueError, match="square"):
        attention_rollout([torch.ones(1, 2, 3) / 3])


def test_patch_attention_by_hand():
    attn = torch.zeros(1, 5, 5)  # CLS + a 2 x 2 grid
    attn[0, 0] = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    attn[0, 1:, 1] = 1.0
    torch.testing.assert_close(patch_attention(attn, (2, 2), prefix=1, query="cls"),
                               torch.tensor([[[0.2, 0.2], [0.4, 0.2]]]))
    mean = attn.mean(1)[0, 1:]
    torch.testing.assert_close(patch_attention(attn, (2, 2), prefix=1, query="mean"),
                               (mean / mean.sum()).view(1, 2, 2))
    with pytest.raises(ValueError, match="CLS"):
        patch_attention(attn[:, 1:, 1:], (2, 2), prefix=0, query="cls")


# ----------------------------------------------------------------------------------------------------
# Nothing left behind


def test_capture_leaves_nothing_behind():
    audio, text = AudioTokenizer(), TextTokenizer()
    model = SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True))
    attention = [m for m in model.modules() if isinstance(m, (SelfAttention, CrossAttention))]
    before = [dict(vars(m)) for m in model.modules()]
    hooks = lambda: [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]  # noqa: E731
    # (nn.Module keeps hooks in these private dicts; there is no public way to count them)
    start = hooks()
    with capture(model):
        assert all(m.record is not None for m in attention)
        assert hooks() != start
        with pytest.raises(RuntimeError, match="already being recorded"), capture(model):
            pass
    assert all(m.record is None and "record" not in vars(m) for m in attention)
    assert hooks() == start
    with pytest.raises(KeyError), capture(model):  # an error inside the block: cleaned up all the same
        raise KeyError("boom")
    assert hooks() == start and [dict(vars(m)) for m in model.modules()] == before
