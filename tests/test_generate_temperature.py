"""Sampling at a tiny temperature is greedy, not an empty completion: ``omni generate --temperature 1e-39``
returned "" with exit 0 (logits / 1e-39 overflowed to +-inf and nan, and the argmax fell on eos). Non-finite
temperatures are refused in one line. Whisper-style sampling (omni.decoding.ScoredGreedy) likewise."""

from __future__ import annotations

import json
import math

import pytest
import torch

from omni.cli import main
from omni.generate import Sampler, generate_ids
from omni.pipelines.generate import load_lm

transformers = pytest.importorskip("transformers")
pytest.importorskip("whisper.tokenizer")  # GPT-2's vocabulary file ships in openai-whisper

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
TINY = (1e-39, 1e-45, 1e-300)  # a float32 denormal, its smallest, and a temperature that rounds to 0 in float32
LOGITS = torch.tensor([[0.5, 3.0, 2.9, -1.0], [-5.0, -1.0, -3.0, float("-inf")], [1e-3, 0.0, 2e-3, -2.0]])


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A converted random GPT-2 (width 32, 1 layer, O(1) weights so greedy paths vary)."""
    from _interop import o1_weights

    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=32,
                                                              n_layer=1, n_head=2))
    o1_weights(hf, 0, embedding_std=lambda table: table.shape[1] ** -0.5)
    root = tmp_path_factory.mktemp("gpt2-temperature")
    hf.save_pretrained(root / "hf")
    assert main(["convert", str(root / "hf"), str(root / "omni")]) == 0
    return root / "omni"


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperature_samples_the_greedy_tokens(export, temperature):
    lm = load_lm(export)
    prompts = [lm.encode("Hello world, this is"), lm.encode("A")]
    greedy = generate_ids(lm, prompts, max_new_tokens=10)
    assert all(len(g) == 10 for g in greedy)  # no eos in 10 steps: an empty answer would be a failure
    for seed in (0, 1):
        assert generate_ids(lm, prompts, max_new_tokens=10, temperature=temperature, seed=seed) == greedy
        assert generate_ids(lm, prompts, max_new_tokens=10, temperature=temperature, top_k=3, seed=seed) == greedy


def test_the_cli_at_a_tiny_temperature_prints_the_greedy_completion(export, capsys):
    args = ["generate", "--checkpoint", str(export), "--max-new-tokens", "8", "--format", "json", "Once upon"]
    assert main(args) == 0
    greedy = json.loads(capsys.readouterr().out)[0]
    assert main([*args, "--temperature", "1e-39", "--seed", "0"]) == 0
    sampled = json.loads(capsys.readouterr().out)[0]
    assert len(greedy["ids"]) == 8 and sampled["ids"] == greedy["ids"] and sampled["completion"] == greedy["completion"]


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0])
def test_non_finite_or_negative_temperatures_are_refused(export, bad):
    lm = load_lm(export)
    with pytest.raises(ValueError, match="temperature"):
        generate_ids(lm, [lm.encode("A")], max_new_tokens=2, temperature=bad)
    with pytest.raises(ValueError, match="finite number > 0"):
        Sampler(bad)


def test_sampler_forms_agree_and_stay_finite():
    """The Gumbel race at T >= 1 (logits / T - log E) and below (logits - T log E) take the same argmax: the
    same draws as one form would give; at tiny T the argmax of the logits, and never a nan."""
    for temperature in (0.3, 0.9, 1.0, 2.5):
        for seed in range(20):
            out = Sampler(temperature, seed=seed)(LOGITS, None, None)
            race = torch.empty_like(LOGITS).exponential_(generator=torch.Generator().manual_seed(seed)).log()
            assert torch.equal(out.argmax(-1), (LOGITS / temperature - race).argmax(-1))
    for temperature in TINY:
        out = Sampler(temperature, seed=0)(LOGITS, None, None)
        assert not out.isnan().any() and out.argmax(-1).tolist() == [1, 1, 2]


@pytest.mark.parametrize("temperature", TINY)
def test_whisper_style_sampling_at_a_tiny_temperature_is_the_argmax(temperature):
    """omni.decoding.ScoredGreedy (openai-whisper's GreedyDecoder: Categorical(logits / T)) raised on the nan
    logits / T of a tiny T; now it takes the argmax, with the same summed log-probabilities as greedy."""
    from omni.decoding import ScoredGreedy

    def first_tokens(t: float, seed: int = 0) -> ScoredGreedy:
        torch.manual_seed(seed)
        strategy = ScoredGreedy(3, 4, eos_id=3, pad_id=3, device=torch.device("cpu"), temperature=t)
        strategy.start(torch.full((3,), 4))
        strategy.update(LOGITS, torch.tensor(0))
        return strategy

    greedy, tiny = first_tokens(0.0), first_tokens(temperature)
    assert tiny.out[:, 0].tolist() == greedy.out[:, 0].tolist() == [1, 1, 2]
    assert torch.equal(tiny.logprob, greedy.logprob) and tiny.logprob.isfinite().all()
    torch.manual_seed(5)  # a finite temperature draws exactly as openai-whisper does
    expected = torch.distributions.Categorical(logits=LOGITS / 0.7).sample().tolist()
    assert first_tokens(0.7, seed=5).out[:, 0].tolist() == expected
