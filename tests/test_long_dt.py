"""Long trajectories with a windowed Decision Transformer (#26): KV-cached rollouts through the ring cache equal
full re-encoding (before and after the context slides), the cache is sized by the window, not the context, and
patterns a causal DT cannot use are refused in one line before any data."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from omni.attention_patterns import RingKVCache
from omni.rl import DecisionTransformer, make_envs, rollout
from omni.tokenizers.trajectory import (COL_KIND, COL_RTG, COL_STATE, COL_TIMESTEP, KIND_ACTION, KIND_RETURN,
                                        KIND_STATE, TrajectoryTokenizer)
from omni.trunk import KVCache, preset

ROOT = Path(__file__).resolve().parents[1]
WINDOW = {"kind": "window", "before": 5, "after": 0}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tok_for(context: int) -> TrajectoryTokenizer:
    return TrajectoryTokenizer(4, n_actions=2, rtg_scale=100.0, max_timestep=500, context=context,
                               state_mean=[0, 0, 0, 0], state_std=[1.0, 0.5, 0.1, 0.5])


def windowed(context: int, attention=WINDOW, positions: str = "none", seed: int = 0) -> DecisionTransformer:
    torch.manual_seed(seed)
    return DecisionTransformer(tok_for(context), preset("tiny", d_model=32, n_layers=2, n_heads=2, positions=positions,
                                                        max_positions=3 * context, attention=attention))


@pytest.mark.parametrize("use_returns", [True, False])
@pytest.mark.parametrize("attention", [WINDOW, {"pattern": WINDOW, "full_every": 2}])
def test_windowed_cached_rollout_equals_recomputed(use_returns, attention):
    """A window of 5 tokens (< one context of 4 steps = 12 tokens): the ring cache's outputs equal re-encoding the
    whole running context every step, while the context grows and after it slides (refills); with a full layer
    (full_every=2) too."""
    torch.manual_seed(0)
    model = DecisionTransformer(tok_for(4), preset("tiny", d_model=32, n_layers=2, n_heads=2, positions="rope",
                                                   attention=attention), use_returns=use_returns)
    tok = tok_for(4)
    targets = [200.0, 100.0, 50.0] if use_returns else None
    cached, full = (rollout(model, tok, make_envs("CartPole-v1", 3), [3, 4, 5], targets=targets, max_steps=30,
                            cache=c, record=True) for c in (True, False))
    assert cached.lengths.max() > 2 * tok.context  # the window slid several times
    np.testing.assert_array_equal(cached.lengths, full.lengths)
    for t, (a, b) in enumerate(zip(cached.outputs, full.outputs)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"step {t}")
    for a, b in zip(cached.actions, full.actions):
        np.testing.assert_array_equal(a, b)


def test_ring_cache_size_fixed_by_the_window_not_the_context():
    """A windowed DT's cache holds `before` keys per layer whatever the context (20 or 500 steps); a full one
    holds 3 x context."""
    sizes = {}
    for context in (20, 500):
        cache = windowed(context).new_cache(4)
        assert isinstance(cache, RingKVCache)
        assert [tuple(k.shape) for k in cache.k] == [(4, 2, 5, 16)] * 2
        sizes[context] = cache.nbytes()
    assert sizes[20] == sizes[500] == 2 * 2 * 4 * 2 * 5 * 16 * 4  # k and v, 2 layers, fp32
    full = DecisionTransformer(tok_for(500), preset("tiny", d_model=32, n_layers=2, n_heads=2, positions="none",
                                                    max_positions=1500)).new_cache(4)
    assert isinstance(full, KVCache) and full.k[0].shape[2] == 1500


def test_ring_cache_stays_its_size_through_a_long_rollout():
    """150 steps (450 tokens) of a context-200 windowed DT appended one step at a time (never refilled): the
    cache's tensors keep their shapes and the last step's outputs equal a recompute of all 450 tokens."""
    model = windowed(200)
    tok = tok_for(200)
    cache = model.new_cache(1)
    shapes = [tuple(t.shape) for t in cache.k + cache.v]
    rng = np.random.default_rng(0)
    rows = []
    model.eval()
    with torch.no_grad():
        for t in range(150):  # [R, s, a] per step, 450 tokens, a ring of 5
            step = torch.zeros(1, 3, tok.feature_dim)
            step[0, :, COL_KIND] = torch.tensor([KIND_RETURN, KIND_STATE, KIND_ACTION], dtype=torch.float32)
            step[0, :, COL_TIMESTEP] = t
            step[0, 0, COL_RTG] = float(rng.normal())
            step[0, 1, COL_STATE:tok.col_action] = torch.from_numpy(rng.normal(size=4).astype(np.float32))
            step[0, 2, tok.col_action] = float(rng.integers(0, 2))
            rows.append(step)
            out = model(step, cache=cache)
        assert [tuple(t.shape) for t in cache.k + cache.v] == shapes
        ref = model(torch.cat(rows, 1))[:, -3:]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def load_recipe():
    spec = importlib.util.spec_from_file_location("dt_recipe_long", ROOT / "recipes" / "decision_transformer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("attention, says", [
    ("{'kind': 'window', 'before': 0, 'after': 9}", "reaches no earlier token"),
    ("{'kind': 'dilated', 'dilation': 3, 'before': 2, 'after': 6}", "reaches no earlier token"),
    ("{'kind': 'global', 'first': 1}", "no key"),
    ("{'kind': 'window2d', 'rows': 1, 'cols': 1}", "window2d"),
    ("{'kind': 'any', 'of': [{'kind': 'window', 'before': 4}, {'kind': 'global', 'first': 15}]}",
     "covers every token of a segment here (at most 15, from 3 x context)"),
])
def test_dt_refuses_patterns_a_causal_trajectory_cannot_use(tmp_path, capsys, attention, says):
    """One error line (config errors come after argparse's usage lines), exit 2, before any data is built (the data
    folder is never created)."""
    recipe = load_recipe()
    data = tmp_path / "data"
    with pytest.raises(SystemExit) as exc:
        recipe.run_recipe(lambda: recipe.main(["--preset", "tiny", "--data", str(data), "--out", str(tmp_path / "o"),
                                               "--set", f"trunk_overrides.attention={attention}"]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "error:" in err[-1] and says in err[-1] and "attention" in err[-1], err
    assert not any("error" in line for line in err[:-1]), err
    assert not data.exists()
