"""Hugging Face GPT2LMHeadModel <-> omni text LM exports (omni.interop.gpt2) and text generation (omni.generate,
`omni generate`): the converted model gives HF's logits, greedy generation is HF's generate(do_sample=False) token
for token (with and without either KV cache), HF -> omni -> HF gives every tensor back bit for bit, an omni LM
written in HF's format loads with from_pretrained and gives the same logits, the CLI converts both ways and
generates, bad inputs are one line, and fine-tuning with omni's LM task starts at HF's loss and lowers it."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from torch import nn

import _interop
from _interop import o1_weights

from omni.cli import main
from omni.export import get_builder, load_pretrained, load_tokenizers, save_pretrained
from omni.generate import TextLM, generate_ids
from omni.pipelines.generate import generate, load_lm
from omni.interop import ConversionError, convert, to_peer
from omni.interop.gpt2 import from_hf
from omni.mixture import pack_mixed
from omni.multitask import MultitaskModel
from omni.tasks import LMTask
from omni.trunk import TrunkConfig

transformers = pytest.importorskip("transformers")
whisper_tokenizer = pytest.importorskip("whisper.tokenizer")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SIZE = dict(vocab_size=50257, n_positions=64, n_embd=64, n_layer=2, n_head=4)
PROMPTS = ["Hello world, this is", "A", "The quick brown fox jumps over the lazy dog. It"]
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife.")


def o1(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights at O(1) scale (_interop.o1_weights), in eval mode; the token and position tables ~ N(0, 1/width)
    too, so the tied logits are O(1) and greedy paths vary; omni's type embedding ~ N(0, 0.1) (where it is not
    zero it must be carried)."""
    return o1_weights(model, seed, embedding_std=lambda table: table.shape[1] ** -0.5,
                      named={"type_embedding.weight": 0.1})


def hf_model(seed: int = 0, **kw) -> GPT2LMHeadModel:
    return o1(GPT2LMHeadModel(GPT2Config(**{**SIZE, **kw})), seed).eval()


def omni_lm(hf: GPT2LMHeadModel) -> TextLM:
    """The converted model in memory (from_hf, the "omni" builder), eval mode."""
    config, sd, toks = from_hf(hf.state_dict(), hf.config.to_dict())
    model = get_builder(config["builder"])(config, toks)
    model.load_state_dict(sd, strict=True)
    return TextLM(model.eval(), "lm", toks["text"])


def packed_logits(lm: TextLM, texts: list[str]) -> torch.Tensor:
    """Logits (N, V) of every token of ``texts`` the way omni's LM task trains: packed documents, the packed mask."""
    task = LMTask("lm", lm.tokenizer, texts)
    batch = pack_mixed([task.sample(i, None) for i in range(len(texts))], [0] * len(texts), ["lm"])
    with torch.no_grad():
        return lm.omni.forward_head(lm.omni(batch), batch, "lm", "text")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.fixture(scope="module")
def hf() -> GPT2LMHeadModel:
    return hf_model()


@pytest.fixture(scope="module")
def hf_dir(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def export(hf_dir, tmp_path_factory):
    return convert(hf_dir, tmp_path_factory.mktemp("omni") / "gpt2-tiny")


@pytest.fixture(scope="module")
def lm(export) -> TextLM:
    return load_lm(export)


def hf_ids(text: str) -> list[int]:
    """tiktoken's GPT-2 ids (openai-whisper's English tokenizer: tiktoken over the same gpt2.tiktoken ranks)."""
    return whisper_tokenizer.get_tokenizer(multilingual=False).encoding.encode_ordinary(text)


# ----------------------------------------------------------------------------------------------------
# Logits


def test_converted_export_gives_hf_logits(hf, lm):
    ids = [hf_ids(t) for t in (TEXT, PROMPTS[2])]
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([i])).logits[0] for i in ids])
        direct = torch.cat([lm.head(lm.features(torch.tensor([i]), torch.arange(len(i))[None]))[0] for i in ids])
    packed = packed_logits(lm, [TEXT, PROMPTS[2]])
    print(f"GPT-2 logits, |omni - HF| max: packed (LM task) {max_diff(packed, ref):.2e}, "
          f"direct {max_diff(direct, ref):.2e} (logits up to {ref.abs().max():.1f})")
    assert max_diff(packed, ref) <= 1e-4 and max_diff(direct, ref) <= 1e-4
    assert lm.omni.embedders["text"].type_embedding.weight.abs().max() == 0  # adds nothing
    assert lm.omni.heads["lm"].proj.weight is lm.omni.embedders["text"].token.weight  # tied


@pytest.mark.parametrize("options", [
    dict(activation_function="gelu_pytorch_tanh", n_inner=96, layer_norm_epsilon=1e-6),
    dict(activation_function="relu", tie_word_embeddings=False, reorder_and_upcast_attn=True),
    dict(activation_function="gelu", n_head=2),
], ids=["gelu_pytorch_tanh-n_inner-eps", "relu-untied-reorder", "gelu-2heads"])
def test_config_variants_give_hf_logits(options):
    hf = hf_model(seed=1, **options)
    hf.config._attn_implementation = "eager"  # reorder_and_upcast_attn acts in eager attention only
    lm = omni_lm(hf)
    ids = torch.tensor([hf_ids(TEXT)])
    with torch.no_grad():
        diff = max_diff(lm.head(lm.features(ids, torch.arange(ids.shape[1])[None])), hf(ids).logits)
    print(f"GPT-2 {options}: logits |omni - HF| max {diff:.2e}")
    assert diff <= 1e-4
    assert lm.omni.heads["lm"].tied == options.get("tie_word_embeddings", True)


# ----------------------------------------------------------------------------------------------------
# Generation


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv-cache", "no-cache"])
def test_greedy_generation_is_hf_generate(hf, lm, use_cache):
    prompts = [hf_ids(p) for p in PROMPTS]
    ours = generate_ids(lm, prompts, max_new_tokens=24, use_cache=use_cache)  # one batch, right-padded
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, use_cache=use_cache,
                              pad_token_id=50256)[0, len(prompt):].tolist()
        ref = out[:out.index(50256)] if 50256 in out else out  # ours stop before eos
        assert got == ref
    assert len({tuple(o[:8]) for o in ours}) == len(ours) and len(set(ours[0])) > 3  # varied, not one token


def test_sampling_is_seeded_and_top_k_1_is_greedy(lm):
    prompts = [hf_ids(p) for p in PROMPTS[:2]]
    a = generate_ids(lm, prompts, max_new_tokens=12, temperature=1.0, seed=3)
    assert a == generate_ids(lm, prompts, max_new_tokens=12, temperature=1.0, seed=3)
    assert a != generate_ids(lm, prompts, max_new_tokens=12, temperature=1.0, seed=4)
    assert generate_ids(lm, prompts, max_new_tokens=12, temperature=0.7, top_k=1, seed=0) == \
        generate_ids(lm, prompts, max_new_tokens=12)


def test_generate_text_api(hf, export):
    text = generate(export, PROMPTS[0], max_new_tokens=10)[0]
    with torch.no_grad():
        ids = hf.generate(torch.tensor([hf_ids(PROMPTS[0])]), max_new_tokens=10, do_sample=False, pad_token_id=50256)
    assert PROMPTS[0] + text == whisper_tokenizer.get_tokenizer(multilingual=False).encoding.decode(ids[0].tolist())


# ----------------------------------------------------------------------------------------------------
# Back to HF


def test_hf_omni_hf_is_bit_exact(hf, export, tmp_path):
    out = to_peer(export, tmp_path / "back", "hf")
    back = GPT2LMHeadModel.from_pretrained(out).eval()
    ours, theirs = hf.state_dict(), back.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]
    keys = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
            "layer_norm_epsilon", "resid_pdrop", "embd_pdrop", "attn_pdrop", "tie_word_embeddings", "eos_token_id")
    assert {k: getattr(back.config, k) for k in keys} == {k: getattr(hf.config, k) for k in keys}


def test_omni_lm_in_hf_format_gives_its_logits(lm, tmp_path):
    """An LM omni trained (the LM task's model: learned_1d, gelu_tanh, head named after the task, a non-zero type
    embedding) written as a GPT2LMHeadModel: from_pretrained gives omni's logits."""
    tok = lm.tokenizer
    trunk = TrunkConfig(d_model=48, n_layers=2, n_heads=3, positions="learned_1d", max_positions=40, mlp_ratio=2.0,
                        activation="gelu_tanh")
    model = MultitaskModel([LMTask("text", tok, [TEXT])], trunk)
    o1(model.omni, seed=2).eval()
    save_pretrained(model.omni, tmp_path / "omni", model.export_config(), tokenizers={"text": tok})
    out = to_peer(tmp_path / "omni", tmp_path / "hf", "hf")
    back = GPT2LMHeadModel.from_pretrained(out).eval()
    mine = TextLM(load_pretrained(tmp_path / "omni"), "text", load_tokenizers(tmp_path / "omni")["text"])
    ids = torch.tensor([hf_ids(TEXT)[:40]])
    with torch.no_grad():
        diff = max_diff(mine.head(mine.features(ids, torch.arange(ids.shape[1])[None])), back(ids).logits)
    print(f"omni LM -> GPT2LMHeadModel.from_pretrained: logits |omni - HF| max {diff:.2e}")
    assert diff <= 1e-5
    assert back.config.n_inner == 96 and back.config.n_positions == 40


# ----------------------------------------------------------------------------------------------------
# The command line


def test_cli_converts_both_ways_and_generates(hf, hf_dir, tmp_path, capsys):
    export = tmp_path / "omni"
    assert main(["convert", str(hf_dir), str(export)]) == 0
    assert capsys.readouterr().out.strip() == str(export)
    assert main(["convert", "--to", "hf", str(export), str(tmp_path / "hf")]) == 0
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in hf.state_dict().items())
    capsys.readouterr()

    prompts = [PROMPTS[0], "naïve café 日本語 🙂 <|endoftext|>"]
    assert main(["generate", "--checkpoint", str(export), "--max-new-tokens", "9", "--format", "json", *prompts]) == 0
    rows = json.loads(capsys.readouterr().out)
    for prompt, row in zip(prompts, rows):
        assert row["prompt"] == prompt and row["prompt_ids"] == hf_ids(prompt)  # tiktoken's encoding
        with torch.no_grad():
            ref = hf.generate(torch.tensor([row["prompt_ids"]]), max_new_tokens=9, do_sample=False,
                              pad_token_id=50256)[0, len(row["prompt_ids"]):].tolist()
        assert row["ids"] == (ref[:ref.index(50256)] if 50256 in ref else ref)  # ours stop before eos

    assert main(["generate", "--checkpoint", str(export), "--max-new-tokens", "9", PROMPTS[0]]) == 0
    assert capsys.readouterr().out == PROMPTS[0] + rows[0]["completion"] + "\n"


cli_error = partial(_interop.cli_error, prog=None)  # `omni convert` and `omni generate` errors


def test_bad_inputs_are_one_line(hf, hf_dir, export, tmp_path, capsys):
    # a tensor of the wrong shape, named by its key
    bad = tmp_path / "bad-shape"
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    sd["transformer.h.1.mlp.c_fc.weight"] = sd["transformer.h.1.mlp.c_fc.weight"][:, :100]
    from safetensors.torch import save_file

    bad.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items() if k != "lm_head.weight"}, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((hf_dir / "config.json").read_text())
    err = cli_error(["convert", str(bad), str(tmp_path / "o1")], capsys)
    assert "transformer.h.1.mlp.c_fc.weight: shape (64, 100)" in err and "(64, 256)" in err

    # options omni cannot express
    for option, words in [(dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True"),
                          (dict(scale_attn_weights=False), "scale_attn_weights=False"),
                          (dict(add_cross_attention=True), "add_cross_attention=True"),
                          (dict(activation_function="quick_gelu"), "'quick_gelu' has no omni counterpart"),
                          (dict(vocab_size=50304), "vocab_size 50304")]:
        path = tmp_path / next(iter(option))
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**json.loads((hf_dir / "config.json").read_text()), **option}))
        (path / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
        assert words in cli_error(["convert", str(path), str(tmp_path / f"o-{path.name}")], capsys)
        with pytest.raises(ConversionError, match=words.replace("(", r"\(")):
            convert(path, tmp_path / f"o2-{path.name}")

    # a GPT-2 conversion takes no options; an omni LM HF cannot express (RoPE) is refused on the way back
    assert "not an option" in cli_error(["convert", str(hf_dir), str(tmp_path / "o3"), "--context", "5"], capsys)
    rope = tmp_path / "rope"
    config = json.loads((export / "config.json").read_text())
    model = get_builder("omni")({**config, "trunk": {**config["trunk"], "positions": "rope"}}, load_tokenizers(export))
    save_pretrained(model, rope, {**model.export_config(), "tasks": config["tasks"]},
                    tokenizers=load_tokenizers(export))
    assert "positions='learned_1d'" in cli_error(["convert", "--to", "hf", str(rope), str(tmp_path / "o4")], capsys)

    # generate: not an export, not a text LM, a prompt too long for the positions, top-k without sampling
    assert "not a text language model export" in cli_error(["generate", "--checkpoint", str(hf_dir), "x"], capsys)
    err = cli_error(["generate", "--checkpoint", str(tmp_path / "rope-missing"), "x"], capsys)
    assert "does not exist" in err
    err = cli_error(["generate", "--checkpoint", str(export), "--max-new-tokens", "60", PROMPTS[2]], capsys)
    assert "exceeds the model's 64 positions" in err
    assert "temperature" in cli_error(["generate", "--checkpoint", str(export), "--top-k", "5", "x"], capsys)


def test_generate_refuses_an_export_without_an_lm_head(tmp_path, capsys):
    from omni.tokenizers.ranks import gpt2_tokenizer

    tok = gpt2_tokenizer()
    model = get_builder("omni")({"trunk": {"d_model": 16, "n_layers": 1, "n_heads": 2}, "heads": {}}, {"text": tok})
    save_pretrained(model, tmp_path / "no-head", model.export_config(), tokenizers={"text": tok})
    err = cli_error(["generate", "--checkpoint", str(tmp_path / "no-head"), "x"], capsys)
    assert "not a text language model export" in err
    assert "no Hugging Face counterpart" in cli_error(["convert", "--to", "hf", str(tmp_path / "no-head"),
                                                       str(tmp_path / "o")], capsys)


# ----------------------------------------------------------------------------------------------------
# Fine-tuning


def test_fine_tuning_starts_at_hf_loss_and_lowers_it(hf, export, tmp_path):
    """omni's LM task on the converted weights: the first loss is HF's own (labels = input ids), a few Adam steps
    lower it, and the tuned model written back to HF gives the tuned loss."""
    config = json.loads((export / "config.json").read_text())
    tok = load_tokenizers(export)["text"]
    task = LMTask("lm", tok, [TEXT])
    model = MultitaskModel([task], TrunkConfig(**config["trunk"]))
    model.omni.load_state_dict(load_pretrained(export).state_dict(), strict=True)
    batch = pack_mixed([task.sample(0, None)], [0], ["lm"])
    ids = torch.tensor([hf_ids(TEXT)])

    def loss(train: bool) -> torch.Tensor:
        model.train(train)
        return model(batch)[0]

    with torch.no_grad():
        first, reference = loss(False), hf(ids, labels=ids).loss
    print(f"fine-tuning: first loss omni {first.item():.6f}, HF {reference.item():.6f}, "
          f"|diff| {abs(first - reference).item():.2e}")
    assert abs(first - reference) <= 1e-5
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(5):
        opt.zero_grad()
        loss(True).backward()
        opt.step()
    with torch.no_grad():
        tuned = loss(False)
    print(f"fine-tuning: loss {first.item():.4f} -> {tuned.item():.4f} after 5 AdamW steps")
    assert tuned < first - 0.5
    assert model.omni.embedders["text"].type_embedding.weight.abs().max() > 0  # trained: folded into wpe below

    save_pretrained(model.omni, tmp_path / "tuned", {**model.export_config(), "source": config["source"]},
                    tokenizers={"text": tok})
    back = GPT2LMHeadModel.from_pretrained(to_peer(tmp_path / "tuned", tmp_path / "tuned-hf", "hf")).eval()
    with torch.no_grad():
        diff = abs(back(ids, labels=ids).loss - tuned).item()
    print(f"fine-tuned model in HF's format: loss |omni - HF| {diff:.2e}")
    assert diff <= 1e-5


def test_gpt2model_checkpoint_without_prefix_and_mask_buffers(hf, hf_dir, lm, tmp_path):
    """The hub's own gpt2 files: a pytorch_model.bin of GPT2Model keys (no "transformer." prefix, no lm_head) with
    the causal-mask buffers older transformers saved (attn.bias, attn.masked_bias)."""
    old = tmp_path / "old"
    old.mkdir()
    sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(SIZE["n_layer"]):
        sd[f"h.{i}.attn.bias"] = torch.ones(1, 1, SIZE["n_positions"], SIZE["n_positions"]).tril()
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(sd, old / "pytorch_model.bin")
    (old / "config.json").write_text((hf_dir / "config.json").read_text())
    converted = load_pretrained(convert(old, tmp_path / "omni")).state_dict()
    assert all(torch.equal(v, converted[k]) for k, v in lm.omni.state_dict().items())


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_fills_the_whole_position_table(hf, lm, use_cache):
    """A GPT-2 with 64 positions holds a prompt of L tokens plus 64 - L + 1 new ones (the last is never fed
    back), and those tokens are HF's; one more is refused."""
    prompt = hf_ids(PROMPTS[2])
    n = 64 - len(prompt) + 1
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, use_cache=use_cache,
                          pad_token_id=50256, eos_token_id=None)[0, len(prompt):].tolist()
    assert len(ref) == n
    got = generate_ids(lm, [prompt], max_new_tokens=n, use_cache=use_cache)[0]
    assert got == (ref[:ref.index(50256)] if 50256 in ref else ref)
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        generate_ids(lm, [prompt], max_new_tokens=n + 1, use_cache=use_cache)
