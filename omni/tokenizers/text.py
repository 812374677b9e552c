"""Text: byte-level BPE (Hugging Face ``tokenizers``) with exact round trips.

``decode(encode(s)) == s`` for every Python string that is valid Unicode (no lone surrogates):
empty, whitespace, control characters, emoji, CJK, combining marks, and text that literally
contains special-token strings such as ``"<|eos|>"``. That holds because

* there is no normalizer and the ByteLevel pre-tokenizer runs with ``add_prefix_space=False``,
  so the text is split, never rewritten, and every byte maps to one of 256 alphabet symbols;
* the BPE alphabet is the full ByteLevel alphabet, so any byte sequence is encodable;
* ``encode_special_tokens`` is on: special-token *text* in the input is encoded as plain bytes,
  so special ids only ever come from ``encode`` placing them by position (bos first, eos last);
* ``decode`` strips those by position and drops the other special ids, then the ByteLevel
  decoder turns the remaining symbols back into the original bytes.

The shipped vocabulary (``tokenizers/bpe-8k/`` at the repository root) was fitted with
``omni.data.builders_text.fit_default_asset`` on Jane Austen's six novels (public domain), read from the Debian
package ``r-cran-janeaustenr`` by ``omni.data.corpora.austen_novels`` without needing R. The tokenizer reads no
corpora itself: the data builders do.
"""

from __future__ import annotations

import operator
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor, nn

from omni.segment import Role, Segment
from omni.tokenizers.base import Tokenizer, TypeEmbedding, register_tokenizer

# Special tokens take ids 0..15 in this order in every tokenizer fitted by ``fit`` (the BPE
# trainer adds them first), so ids are stable across refits. The reserved slots let later
# tasks add a control token without refitting and without changing the embedding size.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|transcribe|>",
    "<|caption|>",
    "<|classify|>",
    "<|act|>",
    *(f"<|reserved_{i}|>" for i in range(9)),
)
DEFAULT_ASSET = "bpe-8k"
TOKENIZER_FILE = "tokenizer.json"
IGNORE_INDEX = -100  # targets value that the LM loss ignores (torch cross_entropy default)
TRUNCATION_POLICIES = ("error", "truncate")
# A long text is encoded by prefixes (TextTokenizer._prefix_ids): a pre-token (the unit BPE merges within)
# ending at least this many characters before a prefix's end is split as in the whole text, since the
# pre-tokenizer's regex looks at most a few characters past a match (contractions: 3).
PREFIX_MARGIN = 64
SURROGATE = re.compile("[\ud800-\udfff]")  # what HF refuses to encode (not valid Unicode)
PREFIX_CHARS_PER_TOKEN = 8  # the first prefix tried: this many characters per token needed (English: ~4.5)


def default_asset_path() -> Path:
    """The shipped tokenizer.json: ``<repo>/tokenizers/bpe-8k/tokenizer.json``."""
    return Path(__file__).resolve().parents[2] / "tokenizers" / DEFAULT_ASSET / TOKENIZER_FILE


DEFAULT_ROLES = {"pad": "<|pad|>", "bos": "<|bos|>", "eos": "<|eos|>"}


def _special_name(name: str) -> str:
    """Accept ``"eos"`` as well as ``"<|eos|>"``."""
    return name if name.startswith("<|") else f"<|{name}|>"


@register_tokenizer()
class TextTokenizer(Tokenizer):
    """Byte-level BPE text tokenizer producing causal segments ``[bos] + ids + [eos]``.

    Args:
        path: a tokenizer.json (byte-level BPE holding at least <|pad|>, <|bos|>, <|eos|>),
            or None for the shipped ``tokenizers/bpe-8k`` asset. Read lazily on first use,
            so ``Tokenizer.load`` of a fitted tokenizer never needs the original file.
        max_length: most tokens in one segment, bos and eos included.
        add_bos / add_eos: put bos first / eos last.
        truncation: what ``encode`` does with a text longer than ``max_length``:
            ``"error"`` raises ValueError naming the sample key; ``"truncate"`` keeps the first
            ``max_length`` tokens (eos is then cut too: the text did not end there) and warns
            naming the key.
        specials: which special token plays each role ``pad`` / ``bos`` / ``eos`` (default
            ``<|pad|>``, ``<|bos|>``, ``<|eos|>``); external vocabularies name theirs, e.g. GPT-2's
            ``<|endoftext|>`` for all three (omni.tokenizers.ranks). Every special (added) token of the
            vocabulary is a special id, whatever its name.
    """

    modality = "text"
    role = Role.CAUSAL

    def __init__(
        self,
        path: str | None = None,
        max_length: int = 1024,
        add_bos: bool = True,
        add_eos: bool = True,
        truncation: str = "error",
        specials: dict[str, str] | None = None,
    ) -> None:
        if truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"truncation must be one of {TRUNCATION_POLICIES}, got {truncation!r}")
        if int(max_length) < max(1, int(add_bos) + int(add_eos)):
            raise ValueError(f"max_length must be >= max(1, add_bos + add_eos), got {max_length}")
        self.path = None if path is None else str(path)
        self.max_length = int(max_length)
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        self.truncation = truncation
        roles = dict(DEFAULT_ROLES, **(specials or {}))
        if set(roles) != set(DEFAULT_ROLES) or not all(isinstance(v, str) and v for v in roles.values()):
            raise ValueError(f"specials maps the roles {sorted(DEFAULT_ROLES)} to token strings, got {specials!r}")
        self.specials = roles
        self._tok: Any = None  # tokenizers.Tokenizer, loaded on first use
        self._special_ids: dict[str, int] = {}
        self._special_id_set: frozenset[int] = frozenset()

    # -- state ---------------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "max_length": self.max_length,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "truncation": self.truncation,
            **({"specials": self.specials} if self.specials != DEFAULT_ROLES else {}),
        }

    @classmethod
    def from_hf(cls, tok: Any, *, source: str = "memory", **kwargs: Any) -> "TextTokenizer":
        """A TextTokenizer over an in-memory ``tokenizers.Tokenizer`` (``kwargs``: the constructor's);
        ``save`` writes it as tokenizer.json."""
        self = cls(**kwargs)
        self._set(tok, source=source)
        return self

    @property
    def hf(self) -> Any:
        """The underlying ``tokenizers.Tokenizer`` (loaded from ``path`` on first access)."""
        if self._tok is None:
            path = Path(self.path) if self.path is not None else default_asset_path()
            if not path.is_file():
                raise FileNotFoundError(
                    f"text tokenizer file {path} not found: pass path= to a tokenizer.json, "
                    "or fit one with TextTokenizer.fit / fit_default_asset"
                )
            from tokenizers import Tokenizer as HFTokenizer

            self._set(HFTokenizer.from_file(str(path)), source=str(path))
        return self._tok

    def _set(self, tok: Any, source: str) -> None:
        # Not stored in tokenizer.json, so it must be switched on after every load: without it a
        # literal "<|eos|>" in the input would become the eos id and break the round trip.
        tok.encode_special_tokens = True
        ids = {t.content: i for i, t in sorted(tok.get_added_tokens_decoder().items()) if t.special}
        missing = sorted({n for n in self.specials.values() if n not in ids})
        if missing:
            raise ValueError(f"tokenizer {source} lacks the special tokens {missing}")
        self._tok = tok
        self._special_ids = ids
        self._special_id_set = frozenset(ids.values())

    def save_state(self, directory: Path) -> None:
        """Write the fitted vocabulary as ``directory/tokenizer.json``."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        target = Path(directory) / TOKENIZER_FILE
        tmp = target.with_name(target.name + ".tmp")
        self.hf.save(str(tmp), pretty=False)
        os.replace(tmp, target)

    def load_state(self, directory: Path) -> None:
        """Read ``directory/tokenizer.json`` written by ``save_state``."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: not a saved text tokenizer")
        self._set(HFTokenizer.from_file(str(path)), source=str(path))

    def __getstate__(self) -> dict[str, Any]:
        # HF tokenizers pickle via JSON, which drops encode_special_tokens; go through _set instead.
        state = dict(self.__dict__)
        tok = state.pop("_tok")
        state["_tok_json"] = None if tok is None else tok.to_str()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        tok_json = state.pop("_tok_json")
        self.__dict__.update(state)
        self._tok = None
        if tok_json is not None:
            from tokenizers import Tokenizer as HFTokenizer

            self._set(HFTokenizer.from_str(tok_json), source="pickled state")

    # -- vocabulary ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the embedding / LM-head size)."""
        return int(self.hf.get_vocab_size(with_added_tokens=True))

    def token_id(self, name: str) -> int:
        """Id of a special token, named ``"eos"`` or ``"<|eos|>"``."""
        if self._tok is None:
            self.hf  # noqa: B018 - loads the vocabulary
        full = self.specials.get(name) or _special_name(name)
        if full not in self._special_ids:
            raise KeyError(f"unknown special token {name!r}; available: {', '.join(self._special_ids)}")
        return self._special_ids[full]

    @property
    def special_tokens(self) -> tuple[str, ...]:
        self.hf  # noqa: B018
        return tuple(self._special_ids)

    @property
    def pad_id(self) -> int:
        return self.token_id("pad")

    @property
    def bos_id(self) -> int:
        return self.token_id("bos")

    @property
    def eos_id(self) -> int:
        return self.token_id("eos")

    # -- encode --------------------------------------------------------------------------------------
    def encode(self, raw: str, *, key: str = "", task: str | None = None) -> Segment:
        """One string -> causal Segment: tokens ``[bos] (+ [task]) + ids + [eos]`` (int64),
        positions ``0..n-1``, targets = next token (``-100`` where nothing is to be predicted).

        ``task`` (e.g. ``"transcribe"``) puts that special token right after bos; it is a
        given condition, so no position is trained to predict it.
        """
        self._check_text(raw, key)
        try:
            ids, whole = self._prefix_ids(raw, self._needed(task))
        except TypeError:  # HF rejects strings that are not valid Unicode (lone surrogates)
            self._check_unicode(raw, key)
            raise
        return self._segment(ids, key, task, None if whole else len(raw))

    def encode_batch(
        self, texts: Sequence[str], *, keys: Sequence[str] | None = None, task: str | None = None
    ) -> list[Segment]:
        """``encode`` of many strings at once (HF's parallel batch encoder); ``keys[i]`` (default
        the index) names ``texts[i]`` in errors."""
        if keys is not None and len(keys) != len(texts):
            raise ValueError(f"encode_batch got {len(texts)} texts but {len(keys)} keys")
        names = [str(k) for k in keys] if keys is not None else [str(i) for i in range(len(texts))]
        for text, name in zip(texts, names):
            self._check_text(text, name)
        need = self._needed(task)
        short = [i for i, text in enumerate(texts) if len(text) <= self._first_prefix(need)]
        try:
            batch = dict(zip(short, self.hf.encode_batch([texts[i] for i in short], add_special_tokens=False)))
            # long texts one by one, only what can be kept (_prefix_ids)
            found = [(batch[i].ids, True) if i in batch else self._prefix_ids(text, need)
                     for i, text in enumerate(texts)]
        except TypeError:
            for text, name in zip(texts, names):
                self._check_unicode(text, name)
            raise
        return [self._segment(ids, name, task, None if whole else len(text))
                for (ids, whole), name, text in zip(found, names, texts)]

    def _needed(self, task: str | None) -> int:
        """How many text ids ``_segment`` can use: one more than fit after bos (+ task) shows the text is
        too long; what comes after is never read."""
        head = int(self.add_bos) + (task is not None)
        return max(1, self.max_length - head + 1)

    @staticmethod
    def _first_prefix(need: int) -> int:
        return PREFIX_CHARS_PER_TOKEN * need + 2 * PREFIX_MARGIN

    def _prefix_ids(self, raw: str, need: int) -> tuple[list[int], bool]:
        """``(ids, True)``: all of ``raw``'s ids; or ``(ids, False)``: at least ``need`` ids, each equal to the
        id at its place in the whole text's encoding, read from a prefix of ``raw`` (grown by doubling) so
        that truncating a 10 MB text to 1,024 tokens encodes a few kB. The ids kept are those of pre-tokens
        (BPE merges never cross them) that end before a later pre-token starting PREFIX_MARGIN characters or
        more before the prefix's end: the pre-tokenizer splits that part of the prefix as the whole text. A
        vocabulary without a pre-tokenizer (one "word") grows the prefix to the whole text: exact, not cheap."""
        n = self._first_prefix(need)
        if n < len(raw) and SURROGATE.search(raw):  # refused as the whole text is, even past what is kept
            raise TypeError("not valid Unicode")
        while n < len(raw):
            enc = self.hf.encode(raw[:n], add_special_tokens=False)
            stable, seen = 0, set()
            for i, (word, (start, _)) in enumerate(zip(enc.word_ids, enc.offsets)):
                if word not in seen:  # the first token of a pre-token: the ones before it are complete
                    seen.add(word)
                    if start > n - PREFIX_MARGIN:
                        break
                    stable = i
            if stable >= need:
                return enc.ids[:stable], False
            n *= 2
        return self.hf.encode(raw, add_special_tokens=False).ids, True

    @staticmethod
    def _check_text(raw: Any, key: str) -> None:
        if not isinstance(raw, str):
            raise TypeError(f"text sample {key!r}: expected str, got {type(raw).__name__}")

    @staticmethod
    def _check_unicode(raw: str, key: str) -> None:
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"text sample {key!r}: expected valid Unicode text, found a lone surrogate at index {exc.start}"
            ) from None

    def _segment(self, ids: list[int], key: str, task: str | None, chars: int | None = None) -> Segment:
        """``chars``: None when ``ids`` are the whole text's, else the text's length in characters (``ids`` are
        then only the first ones, more than fit)."""
        head = [self.bos_id] if self.add_bos else []
        if task is not None:
            head.append(self.token_id(task))
        full = head + ids + ([self.eos_id] if self.add_eos and chars is None else [])
        if len(full) > self.max_length:
            size = f"{len(full)} tokens" if chars is None else \
                f"more than {self.max_length} tokens ({chars:,} characters)"
            if self.truncation == "error":
                raise ValueError(
                    f"text sample {key!r} has {size}, more than max_length={self.max_length} "
                    "(use truncation='truncate' to cut it)"
                )
            warnings.warn(
                f"text sample {key!r}: {size} truncated to max_length={self.max_length}",
                stacklevel=3,
            )
            full = full[: self.max_length]
        if not full:
            raise ValueError(f"text sample {key!r} encodes to no tokens (empty text with add_bos=add_eos=False)")
        tokens = torch.tensor(full, dtype=torch.int64)
        targets = torch.full_like(tokens, IGNORE_INDEX)
        targets[:-1] = tokens[1:]
        if task is not None and self.add_bos and len(full) > 1:
            targets[0] = IGNORE_INDEX  # the task token is an input condition, not a prediction
        return Segment(
            modality=self.modality,
            tokens=tokens,
            positions=torch.arange(len(full), dtype=torch.int64),
            role=self.role,
            targets=targets,
        )

    # -- decode --------------------------------------------------------------------------------------
    def decode(self, ids: Tensor | Sequence[int], *, skip_special: bool = True) -> str:
        """Ids -> text: drops a leading bos, stops at the first eos, drops pad, and (with
        ``skip_special``) every other special id; otherwise those appear as their text."""
        if isinstance(ids, Tensor):
            if ids.dim() != 1:
                raise ValueError(f"decode expects a 1-D id tensor, got shape {tuple(ids.shape)}")
            ids = ids.tolist()
        ids = [_token_id(i, k) for k, i in enumerate(ids)]
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"decode got ids outside [0, {n}): {bad[:5]}")
        bos, eos, pad = self.bos_id, self.eos_id, self.pad_id
        if ids and ids[0] == bos:
            ids = ids[1:]
        if eos in ids:
            ids = ids[: ids.index(eos)]
        drop = self._special_id_set if skip_special else {pad}
        # skip_special_tokens=False: a special id we keep on purpose must decode to its text.
        return self.hf.decode([i for i in ids if i not in drop], skip_special_tokens=False)

    # -- fit -----------------------------------------------------------------------------------------
    def fit(self, texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> "TextTokenizer":
        """Train a byte-level BPE on ``texts``; ``vocab_size`` counts the special tokens.
        Replaces the current vocabulary; returns self."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < len(SPECIAL_TOKENS) + 256:
            raise ValueError(f"vocab_size must be >= {len(SPECIAL_TOKENS) + 256} (specials + 256 bytes)")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            # every byte gets a symbol even if the corpus never shows it
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )

        def checked() -> Iterable[str]:
            for i, text in enumerate(texts):
                self._check_text(text, str(i))
                yield text

        tok.train_from_iterator(checked(), trainer=trainer)
        self._set(tok, source="fit")
        return self

    # -- embed ---------------------------------------------------------------------------------------
    def embedder(self, d_model: int) -> "TextEmbedder":
        return TextEmbedder(self.vocab_size, d_model)


class TextEmbedder(nn.Module):
    """Token ids (N,) -> (N, d_model): embedding table + modality type vector.

    ``.token`` is the ``nn.Embedding``; an LM head ties to ``embedder.token.weight``.
    """

    def __init__(self, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.token.weight, std=0.02)
        self.type_embedding = TypeEmbedding(d_model)  # not `.type`: nn.Module.type is a method

    def forward(self, tokens: Tensor) -> Tensor:
        return self.type_embedding(self.token(tokens))


def _token_id(value: Any, index: int) -> int:
    """An id as an int: an int, a numpy / 0-d torch integer; TypeError naming a float (3.7 is not id 3), a
    bool or anything else."""
    if isinstance(value, bool):
        raise TypeError(f"decode expects integer token ids, got {value!r} at index {index}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"decode expects integer token ids, got {value!r} ({type(value).__name__}) at index "
                        f"{index}") from None
