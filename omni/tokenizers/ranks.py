"""External byte-level BPE vocabularies (GPT-2's, Whisper's) as ``TextTokenizer``\\s.

OpenAI ships its BPE vocabularies as *rank files* (``tiktoken`` format: one ``base64(token bytes) rank``
per line; the openai-whisper PyPI package carries ``whisper/assets/gpt2.tiktoken`` and
``multilingual.tiktoken``). A rank file has no merge list, but byte-level BPE is fully determined by the
ranks: merging the adjacent pair whose concatenation has the lowest rank, until none is in the vocabulary,
is exactly BPE with merges ordered by the rank of their result. So ``hf_tokenizer_from_ranks`` recovers
each token's merge (the two pieces BPE over ranks below the token's own ends with) and builds a Hugging Face
``tokenizers`` BPE with GPT-2's pre-tokenizer regex (the same pattern tiktoken's ``gpt2`` encoding and
Whisper use). The result is an ordinary ``TextTokenizer``: encoded ids equal tiktoken's
(tests/test_tokenizer_ranks.py), exports carry it as ``tokenizer.json``, and nothing at run time needs
tiktoken or openai-whisper, or reads the network.
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import os
from pathlib import Path
from typing import Any, Sequence

from omni.deps import MissingDependency, hint_for
from omni.tokenizers.text import TextTokenizer

GPT2_EOT = "<|endoftext|>"
GPT2_SPECIALS = {"pad": GPT2_EOT, "bos": GPT2_EOT, "eos": GPT2_EOT}
WHISPER_ROLES = {"pad": GPT2_EOT, "bos": "<|startoftranscript|>", "eos": GPT2_EOT}
WHISPER_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|> in 20 ms steps


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table: printable Latin-1 bytes map to themselves,
    the other 68 bytes to code points from U+0100 upwards, in byte order (what ByteLevel expects)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def whisper_asset(name: str) -> Path:
    """A vocabulary file shipped inside the installed openai-whisper package (``gpt2.tiktoken``,
    ``multilingual.tiktoken``); found through the import system, so it is never imported or downloaded."""
    spec = importlib.util.find_spec("whisper")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency(f"{hint_for('whisper')} (its {name} vocabulary is needed)", name="whisper")
    path = Path(next(iter(spec.submodule_search_locations))) / "assets" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: this openai-whisper install has no {name}")
    return path


def read_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """A tiktoken rank file -> {token bytes: rank}; ranks must be 0..n-1 (each once)."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                # "=" decodes to b"": multilingual.tiktoken gives rank 50256 to the empty token, a placeholder
                # BPE never produces; it still takes its id, so the special tokens start at 50257.
                ranks[base64.b64decode(token, validate=True) if token != b"=" else b""] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}:{number}: expected 'base64-token rank', got {line[:60]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"{path}: not a byte-level vocabulary (some single bytes have no rank)")
    return ranks


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The last merge BPE makes when it builds ``token``: run BPE over the ranks below the token's own."""
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, where = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, where = r, i
        if where < 0:
            break
        parts[where:where + 2] = [parts[where] + parts[where + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {limit}) cannot be built from lower-ranked tokens")
    return parts[0], parts[1]


def hf_tokenizer_from_ranks(ranks: dict[bytes, int], specials: Sequence[str]) -> Any:
    """A Hugging Face byte-level BPE equal to the rank file; ``specials`` take ids ``len(ranks)`` onwards,
    in order (as tiktoken's and Whisper's special tokens do)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    char = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(char[x] for x in b)

    vocab = {text(token): rank for token, rank in ranks.items()}
    multi = sorted((r, t) for t, r in ranks.items() if len(t) > 1)
    merges = [tuple(map(text, _merge_of(token, ranks))) for _, token in multi]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if len(set(specials)) != len(specials):
        raise ValueError("special tokens must be distinct")
    tok.add_special_tokens(list(specials))
    for i, name in enumerate(specials):  # added tokens must land right after the ranks
        if tok.token_to_id(name) != len(ranks) + i:
            raise ValueError(f"special token {name!r} got id {tok.token_to_id(name)}, expected {len(ranks) + i}")
    return tok


def gpt2_tokenizer(ranks: str | os.PathLike | None = None, *, max_length: int = 1024,
                   add_bos: bool = False, add_eos: bool = False, truncation: str = "error") -> TextTokenizer:
    """GPT-2's tokenizer (50,257 ids; ``<|endoftext|>`` = 50256 is bos, eos and pad), from a rank file
    (default: openai-whisper's shipped ``gpt2.tiktoken``). No bos/eos are added by default: GPT-2 text
    is encoded plain, as tiktoken and HF do."""
    path = Path(ranks) if ranks is not None else whisper_asset("gpt2.tiktoken")
    tok = hf_tokenizer_from_ranks(read_ranks(path), [GPT2_EOT])
    return TextTokenizer.from_hf(tok, specials=GPT2_SPECIALS, max_length=max_length, add_bos=add_bos,
                                 add_eos=add_eos, truncation=truncation, source=str(path))


def whisper_special_tokens(languages: Sequence[str]) -> list[str]:
    """Whisper's special tokens in id order, after the BPE ranks."""
    return [GPT2_EOT, "<|startoftranscript|>", *(f"<|{code}|>" for code in languages), "<|translate|>",
            "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>",
            *(f"<|{i * 0.02:.2f}|>" for i in range(WHISPER_TIMESTAMPS))]


def whisper_languages() -> list[str]:
    """Whisper's language codes in token order, from the installed openai-whisper package."""
    try:
        from whisper.tokenizer import LANGUAGES
    except ImportError:
        raise MissingDependency(f"{hint_for('whisper')} (its language list is needed)", name="whisper") from None
    return list(LANGUAGES)


def whisper_tokenizer(multilingual: bool = True, num_languages: int = 99, *, ranks: str | os.PathLike | None = None,
                      max_length: int = 448) -> TextTokenizer:
    """Whisper's tokenizer: ``multilingual.tiktoken`` (multilingual models, 51,865 ids with 99 languages) or
    ``gpt2.tiktoken`` (English-only ``.en`` models, 51,864 ids), plus its special tokens: bos is
    ``<|startoftranscript|>``, eos and pad ``<|endoftext|>``. ``num_languages`` is 100 for large-v3."""
    languages = whisper_languages()
    if not 1 <= num_languages <= len(languages):
        raise ValueError(f"num_languages must be in 1..{len(languages)}, got {num_languages}")
    name = "multilingual.tiktoken" if multilingual else "gpt2.tiktoken"
    path = Path(ranks) if ranks is not None else whisper_asset(name)
    tok = hf_tokenizer_from_ranks(read_ranks(path), whisper_special_tokens(languages[:num_languages]))
    return TextTokenizer.from_hf(tok, specials=WHISPER_ROLES, max_length=max_length, source=str(path))
