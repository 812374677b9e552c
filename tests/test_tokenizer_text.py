"""Tests of the byte-level BPE text tokenizer and its shipped asset."""

from __future__ import annotations

import json
import pickle
import random
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import write_janeaustenr

from omni.segment import Role
from omni.tokenizers import Tokenizer, TypeEmbedding, get_tokenizer
from omni.data.builders_text import fit_default_asset
from omni.data.corpora import austen_novels
from omni.tokenizers.text import (
    SPECIAL_TOKENS,
    TextTokenizer,
    default_asset_path,
)

TRICKY = [
    "",
    " ",
    "   ",
    "\n",
    "\t",
    "\r\n",
    " \t\n \x0b\x0c ",
    "  leading",
    "trailing  ",
    "multiple   spaces   inside",
    "line one\nline two\n\n\nend\n",
    "tab\tseparated\tvalues\t",
    "\x00",
    "a\x00b\x01c\x7f\x1b[31m",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🇺🇳",
    "日本語のテキスト、中文文本，한국어",
    "e\u0301 a\u0308\u0304 \u0915\u094d\u0937",  # combining marks, Devanagari conjunct
    "\ufeffBOM and \u200b zero width \u00a0nbsp",
    "<|eos|>",
    "<|bos|>hello<|eos|><|pad|>",
    "text <|transcribe|> with <|caption|><|classify|><|act|> specials",
    "<|reserved_0|><|unknown|> <| |>",
    "\U0010ffff\U000e0001 astral",
    "Ünïcödé Ωμέγα Кириллица العربية עברית",
]

# Ids of this sentence under the shipped asset: fail when the asset changes by accident.
AUSTEN = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife."
AUSTEN_IDS = [1, 1044, 379, 274, 1916, 7339, 2744, 27, 349, 274, 3204, 550, 307, 3853, 297, 274, 580, 1699, 27, 488, 301,
              307, 775, 297, 274, 1409, 29, 2]  # fmt: skip


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer()


def random_strings(n: int, seed: int) -> list[str]:
    """Seeded random strings mixing the hard parts of Unicode (no lone surrogates)."""
    rng = random.Random(seed)
    pools = [
        (0x20, 0x7E),  # printable ASCII
        (0x00, 0x1F),  # C0 controls incl. NUL, tab, newline
        (0x7F, 0xFF),  # DEL, C1 controls, Latin-1
        (0x0300, 0x036F),  # combining marks
        (0x4E00, 0x9FFF),  # CJK
        (0x1F300, 0x1FAFF),  # emoji
        (0x0000, 0xD7FF),  # anything below the surrogates
        (0xE000, 0x10FFFF),  # anything above them
    ]
    pieces = [" ", "  ", "\n", "\t", "<|eos|>", "<|bos|>", "<|pad|>", "<|transcribe|>", "\u200d", "\r\n"]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randrange(0, 40)):
            if rng.random() < 0.1:
                chars.append(rng.choice(pieces))
            else:
                lo, hi = rng.choice(pools)
                chars.append(chr(rng.randint(lo, hi)))
        out.append("".join(chars))
    return out


def small_corpus() -> list[str]:
    base = "the cat sat on the mat. the dog ate the cat's food. a cat and a dog sat together on a mat.\n"
    return [base * 3, "hello world, hello there! tokenizers like repeated words words words.", "日本 日本 日本"]


# -- round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_tricky(tok: TextTokenizer, text: str) -> None:
    seg = tok.encode(text, key="t")
    assert tok.decode(seg.tokens) == text
    assert tok.decode(seg.tokens.tolist()) == text
    # special ids appear only at the ends, never from text that spells a special token
    inner = seg.tokens[1:-1].tolist()
    assert not set(inner) & set(range(len(SPECIAL_TOKENS)))


def test_round_trip_random_unicode(tok: TextTokenizer) -> None:
    texts = random_strings(2000, seed=1234)
    assert sum(len(t) for t in texts) > 30000  # the generator really produced content
    segs = tok.encode_batch(texts)
    bad = [t for t, s in zip(texts, segs) if tok.decode(s.tokens) != t]
    assert bad == []
    # the batch fast path agrees with one-at-a-time encode
    for text, seg in zip(texts[:200], segs[:200]):
        assert torch.equal(tok.encode(text).tokens, seg.tokens)


def test_round_trip_fitted_small(tmp_path: Path) -> None:
    small = TextTokenizer().fit(small_corpus(), vocab_size=300, min_frequency=2)
    for text in TRICKY + random_strings(200, seed=7):
        assert small.decode(small.encode(text).tokens) == text


# -- segment layout ---------------------------------------------------------------------------------
def test_shipped_asset_ids_and_specials(tok: TextTokenizer) -> None:
    assert default_asset_path().is_file()
    assert tok.vocab_size == 8192
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert [tok.token_id(n) for n in ("transcribe", "caption", "classify", "act")] == [3, 4, 5, 6]
    assert tok.token_id("<|reserved_8|>") == 15
    assert tok.special_tokens == SPECIAL_TOKENS
    assert tok.encode(AUSTEN).tokens.tolist() == AUSTEN_IDS
    with pytest.raises(KeyError, match="nope"):
        tok.token_id("nope")


def test_segment_targets_positions(tok: TextTokenizer) -> None:
    seg = tok.encode("Mr. Darcy", key="k")
    n = len(seg)
    assert seg.modality == "text" and seg.role == Role.CAUSAL
    assert seg.tokens.dtype == torch.int64 and seg.tokens.shape == (n,)
    assert seg.tokens[0].item() == 1 and seg.tokens[-1].item() == 2
    assert torch.equal(seg.positions, torch.arange(n))
    assert torch.equal(seg.targets[:-1], seg.tokens[1:])
    assert seg.targets[-1].item() == -100


def test_empty_string(tok: TextTokenizer) -> None:
    seg = tok.encode("")
    assert seg.tokens.tolist() == [1, 2]
    assert seg.targets.tolist() == [2, -100]
    assert tok.decode(seg.tokens) == ""
    bare = TextTokenizer(add_bos=False, add_eos=False)
    with pytest.raises(ValueError, match="'empty-key'"):
        bare.encode("", key="empty-key")


def test_bos_eos_flags_and_task(tok: TextTokenizer) -> None:
    body = tok.encode("hi").tokens[1:-1].tolist()
    assert TextTokenizer(add_bos=False).encode("hi").tokens.tolist() == body + [2]
    assert TextTokenizer(add_eos=False).encode("hi").tokens.tolist() == [1] + body
    seg = tok.encode("hi", task="transcribe")
    assert seg.tokens.tolist() == [1, 3] + body + [2]
    assert seg.targets.tolist() == [-100] + body + [2, -100]
    assert tok.decode(seg.tokens) == "hi"
    assert tok.decode(seg.tokens, skip_special=False) == "<|transcribe|>hi"


def test_decode_positional_rules(tok: TextTokenizer) -> None:
    a = tok.encode("alpha").tokens[1:-1].tolist()
    b = tok.encode(" beta").tokens[1:-1].tolist()
    assert tok.decode([1] + a + [2] + b) == "alpha"  # stops at the first eos
    assert tok.decode([1] + a + [0, 0] + b + [2, 0, 0]) == "alpha beta"  # pad dropped
    assert tok.decode(a + b) == "alpha beta"  # no bos is fine
    assert tok.decode(torch.tensor([1] + a + [1] + b)) == "alpha beta"  # a non-leading bos is a special: dropped
    assert tok.decode(torch.tensor([1] + a + [1] + b), skip_special=False) == "alpha<|bos|> beta"
    assert tok.decode([]) == ""
    with pytest.raises(ValueError, match="1-D"):
        tok.decode(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        tok.decode([1, 8192])


# -- truncation and errors --------------------------------------------------------------------------
def test_truncation_error(tok: TextTokenizer) -> None:
    short = TextTokenizer(max_length=5)
    assert len(short.encode("ab")) <= 5
    with pytest.raises(ValueError, match=r"'long-1'.*max_length=5"):
        short.encode(AUSTEN, key="long-1")


def test_truncation_truncate() -> None:
    short = TextTokenizer(max_length=5, truncation="truncate")
    with pytest.warns(UserWarning, match="'long-2'"):
        seg = short.encode(AUSTEN, key="long-2")
    assert seg.tokens.tolist() == AUSTEN_IDS[:5]  # eos cut too: the text did not end there
    assert seg.targets.tolist() == AUSTEN_IDS[1:5] + [-100]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(short.encode("ab", key="ok")) == 3  # no warning under the limit
    with pytest.warns(UserWarning, match="'b1'"):
        segs = short.encode_batch(["ab", AUSTEN], keys=["b0", "b1"])
    assert [len(s) for s in segs] == [3, 5]


def test_bad_input_names_key(tok: TextTokenizer) -> None:
    with pytest.raises(TypeError, match=r"'k-bytes'.*expected str.*bytes"):
        tok.encode(b"hello", key="k-bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'k-none'"):
        tok.encode(None, key="k-none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'k-sur'.*surrogate at index 1"):
        tok.encode("a\ud800b", key="k-sur")
    with pytest.raises(TypeError, match="'second'"):
        tok.encode_batch(["ok", 3], keys=["first", "second"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="'1'"):
        tok.encode_batch(["ok", "\udfff"])
    with pytest.raises(ValueError, match="2 texts but 1 keys"):
        tok.encode_batch(["a", "b"], keys=["a"])
    with pytest.raises(ValueError, match="truncation"):
        TextTokenizer(truncation="drop")
    with pytest.raises(ValueError, match="max_length"):
        TextTokenizer(max_length=1)
    with pytest.raises(FileNotFoundError, match="nowhere.json"):
        TextTokenizer(path="/nowhere.json").encode("x")


# -- fit, save, load --------------------------------------------------------------------------------
def test_fit_small_corpus() -> None:
    a = TextTokenizer().fit(small_corpus(), vocab_size=300, min_frequency=2)
    b = TextTokenizer().fit(small_corpus(), vocab_size=300, min_frequency=2)
    assert a.hf.to_str() == b.hf.to_str()  # deterministic
    assert 272 < a.vocab_size <= 300  # 16 specials + 256 bytes + some merges
    assert [a.token_id(n) for n in ("pad", "bos", "eos", "transcribe", "caption", "classify", "act")] == list(range(7))
    # merges learned: a frequent word is one token
    assert len(a.encode(" cat").tokens) == 3
    assert a.decode(a.encode("the cat sat").tokens) == "the cat sat"
    with pytest.raises(ValueError, match="vocab_size"):
        TextTokenizer().fit(small_corpus(), vocab_size=100)
    with pytest.raises(TypeError, match="'1'"):
        TextTokenizer().fit(["ok", 5], vocab_size=300)  # type: ignore[list-item]


def test_save_load_round_trip(tmp_path: Path) -> None:
    fitted = TextTokenizer(max_length=4096, truncation="truncate").fit(small_corpus(), vocab_size=300)
    fitted.save(tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    loaded = Tokenizer.load(tmp_path / "tok")
    assert isinstance(loaded, TextTokenizer)
    assert loaded.config() == fitted.config()
    assert json.loads(json.dumps(loaded.config())) == loaded.config()
    assert loaded.vocab_size == fitted.vocab_size
    for text in TRICKY + small_corpus():
        assert torch.equal(loaded.encode(text).tokens, fitted.encode(text).tokens)
        assert loaded.decode(loaded.encode(text).tokens) == text
    # a path= tokenizer reads the saved file directly
    direct = TextTokenizer(path=str(tmp_path / "tok" / "tokenizer.json"))
    assert torch.equal(direct.encode("<|eos|> cat").tokens, fitted.encode("<|eos|> cat").tokens)


def test_pickle_keeps_literal_specials(tok: TextTokenizer) -> None:
    clone = pickle.loads(pickle.dumps(tok))
    seg = clone.encode("<|eos|>")
    assert torch.equal(seg.tokens, tok.encode("<|eos|>").tokens)
    assert len(seg) > 3 and clone.decode(seg.tokens) == "<|eos|>"


def test_registry_and_config(tok: TextTokenizer) -> None:
    assert get_tokenizer("text") is TextTokenizer
    assert tok.config() == {"path": None, "max_length": 1024, "add_bos": True, "add_eos": True, "truncation": "error"}


# -- embedder ---------------------------------------------------------------------------------------
def test_embedder_shapes_and_tying(tok: TextTokenizer) -> None:
    torch.manual_seed(0)
    emb = tok.embedder(64)
    assert isinstance(emb.token, nn.Embedding) and emb.token.weight.shape == (8192, 64)
    assert abs(emb.token.weight.std().item() - 0.02) < 0.001
    assert isinstance(emb.type_embedding, TypeEmbedding)
    packed = torch.cat([tok.encode("a cat").tokens, tok.encode("").tokens, tok.encode("日本").tokens])
    out = emb(packed)
    assert out.shape == (packed.shape[0], 64)
    with torch.no_grad():
        emb.type_embedding.weight.fill_(1.0)
    assert torch.allclose(emb(packed), emb.token.weight[packed] + 1.0)
    head = nn.Linear(64, tok.vocab_size, bias=False)
    head.weight = emb.token.weight  # how an LM head ties
    assert head.weight.data_ptr() == emb.token.weight.data_ptr()


# -- the corpus reader ------------------------------------------------------------------------------
def test_austen_reader_on_synthetic_r_database(tmp_path: Path) -> None:
    """Writes a tiny R lazy-load database the way R does and reads it back."""
    data = tmp_path / "usr" / "lib" / "R" / "site-library" / "janeaustenr" / "data"
    novels = {
        "emma": ["EMMA", "", "", "Emma Woodhouse, handsome, clever,", "and rich £", "", "THE END"],
        "persuasion": ["Sir Walter", "Elliot, of Kellynch Hall"],
    }
    write_janeaustenr(data.parent, novels, xz={"persuasion"})  # both of R's compressions

    expected = {
        "emma": ["EMMA", "Emma Woodhouse, handsome, clever, and rich £", "THE END"],
        "persuasion": ["Sir Walter Elliot, of Kellynch Hall"],
    }
    assert austen_novels(tmp_path) == expected
    assert austen_novels(data.parent) == expected
    with pytest.raises(FileNotFoundError, match="r-cran-janeaustenr"):
        austen_novels(tmp_path / "usr" / "lib" / "R" / "nothing-here")

    # fit_default_asset over the R package folder plus a plain text file
    extra = tmp_path / "extra.txt"
    extra.write_text("plain text file " * 20, encoding="utf-8")
    out = fit_default_asset([tmp_path, extra], tmp_path / "asset", vocab_size=290, min_frequency=2)
    assert out == tmp_path / "asset" / "tokenizer.json"
    fitted = TextTokenizer(path=str(out))
    assert fitted.vocab_size <= 290 and fitted.bos_id == 1
    assert fitted.decode(fitted.encode("Emma Woodhouse £").tokens) == "Emma Woodhouse £"
    assert len(fitted.encode(" plain").tokens) == 3  # a merged word from the text file


# -- issue 29: non-integer ids, truncation that reads only what it keeps ------------------------------
def test_decode_refuses_ids_that_are_not_integers(tok: TextTokenizer) -> None:
    import numpy as np

    for ids, shown in [([3.7], "3.7 (float) at index 0"), ([5, 3.0], "3.0 (float) at index 1"),
                       (["7"], "'7' (str) at index 0"), ([True], "True at index 0"),
                       (torch.tensor([1.5, 2.0]), "1.5 (float) at index 0")]:
        with pytest.raises(TypeError) as err:
            tok.decode(ids)
        assert str(err.value) == f"decode expects integer token ids, got {shown}"
    ids = tok.encode("integers of any kind").tokens
    text = tok.decode(ids)
    assert tok.decode(ids.tolist()) == tok.decode(list(np.asarray(ids))) == tok.decode(list(ids)) == text


class _Recorder:
    """The HF tokenizer, recording the length of every text it encodes."""

    def __init__(self, inner) -> None:
        self.inner, self.lengths = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, **kw):
        self.lengths.append(len(text))
        return self.inner.encode(text, **kw)

    def encode_batch(self, texts, **kw):
        self.lengths.extend(len(t) for t in texts)
        return self.inner.encode_batch(texts, **kw)


def test_truncation_equals_full_encoding_then_cut() -> None:
    """Prefix encoding keeps exactly what encoding the whole text and cutting gives: random texts built from the
    pieces where a cut can change pre-tokens (contractions, whitespace runs, digits, combining marks, emoji)."""
    full = TextTokenizer(max_length=10**9)
    rng = random.Random(29)
    pieces = ["a", "bc", " ", " " * 50, "\n\n", "'", "'re", "'ll", "1234567", "é", "e\u0301", "😀", "中文", "\t",
              ".", "!!", "x" * 40, "<|eos|>", "\r\n"]
    for max_length in (2, 3, 5, 17, 64):
        short = TextTokenizer(max_length=max_length, truncation="truncate")
        short._tok = _Recorder(short.hf)
        texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 400))) for _ in range(80)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for text in texts:
                for task in (None, "transcribe"):
                    assert short.encode(text, task=task).tokens.tolist() == \
                        full.encode(text, task=task).tokens[:max_length].tolist(), (max_length, text)
            batch = short.encode_batch(texts)
        assert [s.tokens.tolist() for s in batch] == [full.encode(t).tokens[:max_length].tolist() for t in texts]
        assert sum(n < max(map(len, texts)) // 2 for n in short.hf.lengths) > 100  # prefixes were encoded


def test_truncating_a_10_mb_text_encodes_a_few_kb() -> None:
    paragraph = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must " \
                "be in want of a wife.\n\n"
    text = (paragraph * (10_000_000 // len(paragraph) + 1))[:10_000_000]
    tok = TextTokenizer(max_length=1024, truncation="truncate")
    tok._tok = _Recorder(tok.hf)
    with pytest.warns(UserWarning, match=r"'big': more than 1024 tokens \(10,000,000 characters\) truncated"):
        seg = tok.encode(text, key="big")
    assert len(seg) == 1024 and max(tok.hf.lengths) <= 16 * 1024  # read: 8,320 characters of 10,000,000
    reference = TextTokenizer(max_length=10**9).encode(text[:100_000]).tokens[:1024]
    assert seg.tokens.tolist() == reference.tolist()
    error = TextTokenizer(max_length=1024)
    error._tok = _Recorder(error.hf)
    with pytest.raises(ValueError, match=r"'big' has more than 1024 tokens \(10,000,000 characters\), more than "
                                         r"max_length=1024"):
        error.encode(text, key="big")
    assert max(error.hf.lengths) <= 16 * 1024
    with pytest.raises(ValueError, match=r"'bad'.*surrogate at index 9999999"):  # past what is kept, as before
        tok.encode(text[:-1] + "\ud800", key="bad")
