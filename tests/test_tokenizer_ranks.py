"""GPT-2's and Whisper's BPE vocabularies as omni TextTokenizers == tiktoken / openai-whisper, id for id."""

from __future__ import annotations

import random

import pytest

from omni.tokenizers.base import Tokenizer
from omni.tokenizers.ranks import gpt2_tokenizer, read_ranks, whisper_asset, whisper_tokenizer

whisper_tok = pytest.importorskip("whisper.tokenizer")

PIECES = [
    "Hello", " world", "It's", " they'll", " we've", " I'm", " you'd", " 're", "'S", " naïve", " café", " Zürich",
    " 日本語", " 中文", " 한국어", " العربية", " Ελληνικά", " русский", " 🙂", "👍🏽", " e\u0301", "\u200b", " 3.14159",
    " 2026", " 1,000,000", "--", " ...", "!!", "?", "\n", "\n\n", "\t", "   ", " ", "  \n ", " <|endoftext|>",
    " <|startoftranscript|>", " <|0.00|>", "$", "#", "@user", " https://example.org/a?b=c", " CamelCaseWord",
    " snake_case", " ALLCAPS", " x", " y2k", "\r\n", " \u00a0", " ﬁ", " Ⅻ", " 𝔘𝔫𝔦", "\x00", "\x7f", " ½",
]


def strings(n: int = 1000, seed: int = 0) -> list[str]:
    """Deterministic mixed strings: words, numbers, punctuation, whitespace runs, scripts, emoji, specials'
    text, control characters, and random code points."""
    rng = random.Random(seed)
    out = ["", " ", "a", "  leading", "trailing  ", "\n"]
    while len(out) < n:
        if rng.random() < 0.15:
            s = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xA0, 0x2FFF),
                                        rng.randrange(0x4E00, 0x9FFF), rng.randrange(0x1F300, 0x1FAFF)]))
                        for _ in range(rng.randrange(1, 30)))
        else:
            s = "".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 25)))
        out.append(s)
    return out


@pytest.fixture(scope="module")
def gpt2():
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def multilingual():
    return whisper_tokenizer(multilingual=True)


def test_gpt2_ids_equal_tiktoken(gpt2):
    # openai-whisper's English tokenizer is tiktoken over the same gpt2.tiktoken ranks and GPT-2's pattern
    reference = whisper_tok.get_tokenizer(multilingual=False).encoding
    assert gpt2.vocab_size == 50257 and gpt2.eos_id == gpt2.bos_id == gpt2.pad_id == 50256
    for s in strings():
        ours = gpt2.encode(s).tokens.tolist() if s else []
        assert ours == reference.encode_ordinary(s), s
        assert gpt2.decode(ours) == s


def test_whisper_ids_equal_openai_whisper(multilingual):
    reference = whisper_tok.get_tokenizer(multilingual=True)
    assert multilingual.vocab_size == 51865
    for s in strings(seed=1):
        ours = multilingual.encode(s).tokens.tolist()
        assert ours[0] == reference.sot and ours[-1] == reference.eot
        assert ours[1:-1] == reference.encoding.encode_ordinary(s), s
        assert multilingual.decode(ours) == s


@pytest.mark.parametrize("language,task", [("en", "transcribe"), ("de", "translate"), ("ja", "transcribe"),
                                           ("yue", "transcribe")])
def test_whisper_prompt_ids(multilingual, language, task):
    if language == "yue":  # the 100th language: large-v3's vocabulary only
        multilingual = whisper_tokenizer(num_languages=100)
    reference = whisper_tok.get_tokenizer(multilingual=True, num_languages=multilingual.vocab_size - 51766,
                                          language=language, task=task)
    names = ["startoftranscript"] + ([f"<|{language}|>"] if language else []) + ([task] if task else [])
    assert [multilingual.token_id(n) for n in names] == list(reference.sot_sequence)
    assert multilingual.token_id("notimestamps") == reference.no_timestamps
    assert multilingual.token_id("<|0.00|>") == reference.timestamp_begin
    assert multilingual.token_id("<|30.00|>") == reference.timestamp_begin + 1500
    for name in ("nospeech", "startofprev", "startoflm", "translate", "transcribe"):
        assert multilingual.token_id(name) == getattr(reference, name.replace("nospeech", "no_speech")
                                                      .replace("startofprev", "sot_prev")
                                                      .replace("startoflm", "sot_lm"))


def test_english_only_whisper_vocabulary():
    en = whisper_tokenizer(multilingual=False)
    reference = whisper_tok.get_tokenizer(multilingual=False, language="en", task="transcribe")
    assert en.vocab_size == 51864 and en.eos_id == reference.eot and en.bos_id == reference.sot
    assert en.token_id("notimestamps") == reference.no_timestamps


def test_special_text_is_plain_and_specials_drop_on_decode(multilingual):
    ids = multilingual.encode("<|endoftext|> <|en|>").tokens.tolist()
    assert multilingual.eos_id not in ids[1:-1] and multilingual.token_id("<|en|>") not in ids
    prompt = [multilingual.bos_id, multilingual.token_id("<|en|>"), multilingual.token_id("transcribe"),
              multilingual.token_id("notimestamps")]
    assert multilingual.decode(prompt + ids[1:]) == "<|endoftext|> <|en|>"


def test_save_load_round_trip(tmp_path, gpt2):
    gpt2.save(tmp_path / "tok")
    again = Tokenizer.load(tmp_path / "tok")
    assert again.specials == gpt2.specials and again.vocab_size == gpt2.vocab_size
    for s in strings(50, seed=3)[1:]:
        assert again.encode(s).tokens.tolist() == gpt2.encode(s).tokens.tolist()


def test_bad_rank_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(b"IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"bad.tiktoken:2: expected 'base64-token rank'"):
        read_ranks(bad)
    gap = tmp_path / "gap.tiktoken"
    gap.write_bytes(b"".join(b"%s %d\n" % (__import__("base64").b64encode(bytes([b])), b * 2) for b in range(256)))
    with pytest.raises(ValueError, match="ranks are not 0..255"):
        read_ranks(gap)
    assert whisper_asset("gpt2.tiktoken").is_file()
