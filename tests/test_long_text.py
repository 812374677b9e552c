"""Text past its training length (#26, recipes/lm.py): ``long_text_bpb`` at a longer length through the banded
(windowed) path and SDPA's causal path equals the dense masked reference, every length scores the same tokens,
``documents='stream'`` keeps the held-out text apart, ``eval_lengths`` runs end to end, a learned table asked past
its end and a causal window that reaches nothing earlier are refused in one line before any data, and a windowed
trunk trains under bf16 autocast (the cpu preset's)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import load_recipe
from test_lm_recipe import SENTENCES  # the same five opening sentences

from omni.multitask import MultitaskModel
from omni.tasks import LMTask
from omni.tokenizers.text import TextTokenizer
from omni.trunk import preset

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
WINDOW = {"kind": "window", "before": 16, "after": 0}
recipe = load_recipe("lm", "lm_recipe_long")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    paragraphs = [" ".join(SENTENCES[(i + k) % 5] for k in range(2 + i % 2)) + f" ({i})" for i in range(80)]
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def tiny_lm(attention=None, positions: str = "rope", seed: int = 0):
    torch.manual_seed(seed)
    tok = TextTokenizer(max_length=64)
    trunk = preset("tiny", d_model=32, n_layers=2, n_heads=2, positions=positions, max_positions=64,
                   attention=attention)
    omni = MultitaskModel([LMTask("lm", tok, ["x"])], trunk).omni
    with torch.no_grad():  # larger weights than GPT-2's init, so attention (and so the pattern) moves the scores
        for p in omni.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return omni, tok


def dense_reference(omni, tok, ids, n_bytes: int, length: int) -> float:
    """Bits/byte with each window's mask materialised: causal AND the trunk's pattern as a dense (T x T) mask."""
    nll = 0.0
    for s in range(0, len(ids), length - 1):
        piece = torch.tensor([tok.bos_id, *ids[s:s + length - 1]])
        T = len(piece)
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
        hidden = omni.trunk(omni.embedders["text"](piece)[None], mask=causal)[0]
        nll += float(F.cross_entropy(omni.heads["lm"](hidden[:-1]).float(), piece[1:], reduction="sum"))
    return nll / math.log(2) / n_bytes


@pytest.mark.parametrize("attention", [WINDOW, {"pattern": WINDOW, "full_every": 2}, None])
def test_longer_length_equals_dense_reference(attention):
    """Windows of 300 tokens (past the 64 the model is sized for; the banded path for the window, SDPA's causal
    kernel for full layers) give the dense masked reference's bits/byte, and each length scores the same tokens."""
    omni, tok = tiny_lm(attention)
    omni.eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, tok.vocab_size, (700,), generator=g).tolist()
    with torch.no_grad():
        got = recipe.long_text_bpb(omni, "lm", tok, ids, 2000, 300, chunk=128)  # chunked head: 3 chunks per window
        ref = dense_reference(omni, tok, ids, 2000, 300)
    assert got["windows"] == 3 and got["tokens"] == 700
    assert got["bpb"] == pytest.approx(ref, rel=1e-5)
    short = recipe.long_text_bpb(omni, "lm", tok, ids, 2000, 64)
    assert short["windows"] == math.ceil(700 / 63) and short["tokens"] == 700
    if attention is not None:  # the window matters past 16 tokens: a wider one scores otherwise
        wide, _ = tiny_lm({"kind": "window", "before": 200, "after": 0})
        assert recipe.long_text_bpb(wide, "lm", tok, ids, 2000, 300)["bpb"] != pytest.approx(got["bpb"], rel=1e-3)


def test_eval_window_imposes_a_window_on_the_trained_weights():
    """windowed(full model, 16) scores as the same weights built with the window (the init draws the same numbers:
    attention patterns add no parameter); the original keeps full attention."""
    full, tok = tiny_lm(None)
    built, _ = tiny_lm(WINDOW)
    ids = torch.randint(10, tok.vocab_size, (400,), generator=torch.Generator().manual_seed(2)).tolist()
    imposed = recipe.windowed(full, 16)
    assert imposed.trunk_config.attention == {"pattern": WINDOW, "full_every": 0}
    assert full.trunk_config.attention is None
    got = recipe.long_text_bpb(imposed, "lm", tok, ids, 1000, 400)["bpb"]
    assert got == pytest.approx(recipe.long_text_bpb(built, "lm", tok, ids, 1000, 400)["bpb"], rel=1e-6)
    assert got != pytest.approx(recipe.long_text_bpb(full, "lm", tok, ids, 1000, 400)["bpb"], rel=1e-3)


def test_windowed_trunk_trains_under_bf16_autocast():
    """The banded path computes in float32 inside a bf16 autocast (the cpu preset trains so): loss and gradients."""
    omni, tok = tiny_lm(WINDOW)
    piece = torch.randint(10, tok.vocab_size, (1, 300))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = omni.trunk(omni.embedders["text"](piece), mask="causal")
        loss = F.cross_entropy(omni.heads["lm"](hidden[0, :-1]).float(), piece[0, 1:])
    loss.backward()
    grads = [p.grad for p in omni.trunk.parameters() if p.grad is not None]
    assert math.isfinite(loss.item()) and len(grads) == len(list(omni.trunk.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)


def test_stream_documents_hold_the_held_out_text_apart(corpus):
    cfg = recipe.parse_args(["--preset", "tiny", "--set", f"text={[str(corpus)]!r}", "--set", "documents=stream",
                             "--set", "eval_fraction=0.25"])
    tok = TextTokenizer(max_length=cfg["context"])
    docs = recipe.documents(cfg, tok)
    lengths = [len(tok.hf.encode(d, add_special_tokens=False).ids) for d in docs["train"] + docs["test"]]
    assert max(lengths) <= cfg["context"] - 2 and sum(n == cfg["context"] - 2 for n in lengths) > len(lengths) // 2
    assert "(60)" in docs["stream"] and "(59)" not in docs["stream"]  # the last 20 of 80 paragraphs held out
    assert not any("(60)" in d for d in docs["train"]) and any("(59)" in d for d in docs["train"])
    ids, n_bytes = recipe.stream_ids(tok, docs["stream"], 200)
    assert len(ids) == 200 and n_bytes == len(tok.decode(ids).encode())
    with pytest.raises(ValueError, match="raise eval_fraction"):
        recipe.stream_ids(tok, docs["stream"], 10 ** 6)


def test_eval_lengths_end_to_end(corpus, tmp_path):
    out = tmp_path / "run"
    metrics = recipe.main(["--preset", "tiny", "--out", str(out), "--set", "progress=False", "--set",
                           f"text={[str(corpus)]!r}", "--set", "documents=stream", "--set", "positions=rope",
                           "--set", "eval_fraction=0.25", "--set", "steps=4", "--set", "eval_every=4", "--set",
                           "samples=0", "--set", "report_to=none", "--set", "eval_lengths=[64, 256]", "--set",
                           f"trunk_overrides.attention={WINDOW!r}", "--set", "eval_window=8"])
    saved = json.loads((out / "eval_lengths.json").read_text())
    assert [r["length"] for r in saved["rows"]] == [64, 256] and saved["tokens"] == 255 and saved["window"] == 8
    assert [r["windows"] for r in saved["rows"]] == [math.ceil(255 / 63), 1]
    for r in saved["rows"]:
        assert metrics[f"eval/bpb@{r['length']}"] == r["bpb"] and 0 < r["bpb"] < 20


@pytest.mark.parametrize("sets, says", [
    (["positions=learned_1d", "eval_lengths=[64, 128]"], "max_positions 64"),
    (["trunk_overrides.attention={'kind': 'window', 'before': 0, 'after': 8}"], "reaches no earlier token"),
    (["trunk_overrides.attention={'kind': 'any', 'of': [{'kind': 'window', 'before': 4}, {'kind': 'global', "
      "'first': 64}]}"], "covers every token of a segment here (at most 64, from context)"),
])
def test_user_errors_are_one_line_before_data(corpus, tmp_path, capsys, monkeypatch, sets, says):
    monkeypatch.setattr(recipe, "documents", lambda *a: pytest.fail("data was built before the error"))
    argv = ["--preset", "tiny", "--out", str(tmp_path / "o"), "--set", f"text={[str(corpus)]!r}"]
    with pytest.raises(SystemExit) as exc:
        recipe.run_recipe(lambda: recipe.main(argv + [a for s in sets for a in ("--set", s)]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()  # config errors come after argparse's usage lines
    assert "error:" in err[-1] and says in err[-1], err
    assert not any("error" in line for line in err[:-1]), err
