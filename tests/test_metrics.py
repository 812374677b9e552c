"""WER / CER: omni.speech.edit_distance (rapidfuzz) against a pure-Python dynamic programme on random
strings and word lists (unicode included), corpus error_rates against jiwer when it is installed, and
inputs the old pure-Python edit distance needed minutes for."""

from __future__ import annotations

import random

import pytest

from omni.speech import edit_distance, error_counts, error_rates, normalize_text

ALPHABET = "ab cdé中😀\u0301"  # a space, an accented letter, CJK, an astral emoji, a combining accent
VOCAB = ["the", "cat", "sat", "on", "mat", "don't", "café", "naïve", "日本", "😀", "a", "", "1", "THE"]


def reference_distance(ref, hyp) -> int:
    """Levenshtein distance by the textbook dynamic programme (items compared with ==)."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def mutate(seq: list, rng: random.Random, pool) -> list:
    """seq with a few random substitutions, insertions and deletions."""
    out = list(seq)
    for _ in range(rng.randint(0, 6)):
        op, at = rng.randrange(3), rng.randint(0, len(out))
        if op == 0 and at < len(out):
            out[at] = rng.choice(pool)
        elif op == 1:
            out.insert(at, rng.choice(pool))
        elif at < len(out):
            del out[at]
    return out


def test_edit_distance_known_values():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "") == 0 and edit_distance("", "abc") == 3 and edit_distance("abc", "") == 3
    assert edit_distance([], [1, 2]) == 2
    assert edit_distance("the cat sat".split(), "the bat sat down".split()) == 2
    assert edit_distance(("a", "b"), ["a", "b"]) == 0 and edit_distance("ab", ["a", "b"]) == 0
    assert edit_distance([-1, 2], [-2, 2]) == 1 and edit_distance([1, 2.0], [1.0, 2]) == 0  # items compare with ==
    assert edit_distance(["a"], [97]) == 1  # no code-point or hash shortcut between items of different types


@pytest.mark.parametrize("kind", ["chars", "words", "ints"])
def test_edit_distance_equals_reference_dp(kind):
    rng = random.Random(kind)
    pool = {"chars": list(ALPHABET), "words": VOCAB, "ints": [-2, -1, 0, 1, 2, 2**70]}[kind]
    for _ in range(400):
        ref = [rng.choice(pool) for _ in range(rng.randint(0, 30))]
        hyp = mutate(ref, rng, pool) if rng.random() < 0.7 else [rng.choice(pool) for _ in range(rng.randint(0, 30))]
        if kind == "chars":
            ref, hyp = "".join(ref), "".join(hyp)
        assert edit_distance(ref, hyp) == reference_distance(ref, hyp), (ref, hyp)
        assert edit_distance(hyp, ref) == edit_distance(ref, hyp)


def random_corpus(n: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    words = ["The", "cat,", "sat", "on", "the", "mat.", "Don't", "'quoted'", "café", "naïve", "日本語", "x-ray",
             "42"]
    refs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 25))) for _ in range(n)]
    hyps = [" ".join(mutate(r.split(), rng, words)) for r in refs]
    return refs, hyps


def test_error_rates_equal_the_reference_dp():
    refs, hyps = random_corpus(60, seed=1)
    we = wn = ce = cn = 0
    for ref, hyp in zip(refs, hyps):
        r, h = normalize_text(ref), normalize_text(hyp)
        assert error_counts(ref, hyp) == (reference_distance(r.split(), h.split()), len(r.split()),
                                          reference_distance(r, h), len(r))
        we, wn = we + reference_distance(r.split(), h.split()), wn + len(r.split())
        ce, cn = ce + reference_distance(r, h), cn + len(r)
    assert error_rates(refs, hyps) == {"wer": we / wn, "cer": ce / cn}


def test_error_rates_equal_jiwer():
    jiwer = pytest.importorskip("jiwer")
    refs, hyps = random_corpus(200, seed=2)
    r = [normalize_text(t) for t in refs]  # jiwer scores what it is given: give it the project's normalised text
    h = [normalize_text(t) for t in hyps]
    got = error_rates(refs, hyps)
    assert got["wer"] == pytest.approx(jiwer.wer(r, h), rel=1e-12)
    assert got["cer"] == pytest.approx(jiwer.cer(r, h), rel=1e-12)


def test_long_inputs():
    """30,000 characters (and words) with 300 deletions: 300 edits. (Speed is measured in the closing note
    and benchmarks, not asserted here; the old pure-Python DP filled 9e8 cells for this, minutes of CPU.)"""
    rng = random.Random(3)
    text = "".join(rng.choice("abcdefgh ") for _ in range(30_000))
    shorter = "".join(c for i, c in enumerate(text) if i % 100)
    words = [rng.choice(VOCAB) for _ in range(30_000)]
    fewer = [w for i, w in enumerate(words) if i % 100]
    assert edit_distance(text, shorter) == 300  # >= the length difference, and 300 deletions reach it
    assert edit_distance(words, fewer) == 300
