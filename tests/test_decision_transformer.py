"""Decision Transformer recipe on CPU: KV-cached rollouts equal full re-encoding past the context, the tiny
preset learns on a tiny CartPole set, scores, the BC variant, right-padding, and every bad input names
its sample / env."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from omni.export import load_pretrained, load_tokenizers
from omni.rl import (
    KIND_PAD,
    DecisionTransformer,
    SpaceSpec,
    WindowLoader,
    action_loss,
    check_env,
    encode_episodes,
    evaluate,
    gather_windows,
    make_envs,
    make_tokenizer,
    normalized_score,
    rollout,
    summarize_returns,
    top_episodes,
)
from omni.tokenizers.trajectory import COL_KIND, KIND_ACTION, KIND_RETURN, KIND_STATE, TrajectoryTokenizer
from omni.trunk import preset

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def load_recipe():
    spec = importlib.util.spec_from_file_location("dt_recipe", ROOT / "recipes" / "decision_transformer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_trunk(**kw):
    return preset("tiny", d_model=32, n_layers=2, n_heads=2, positions=kw.pop("positions", "rope"), **kw)


def cartpole_tok(context: int = 4) -> TrajectoryTokenizer:
    return TrajectoryTokenizer(4, n_actions=2, rtg_scale=100.0, max_timestep=500, context=context,
                               state_mean=[0, 0, 0, 0], state_std=[1.0, 0.5, 0.1, 0.5])


def fake_episode(rng: np.random.Generator, T: int, key: str) -> dict:
    return {"key": key, "observations": rng.normal(size=(T + 1, 4)).astype(np.float32),
            "actions": rng.integers(0, 2, T), "rewards": np.ones(T, np.float32)}


# ----------------------------------------------------------------------------------------------------


def test_normalized_score_and_summary():
    assert normalized_score(500.0, 20.0, 500.0) == 100.0
    assert normalized_score(20.0, 20.0, 500.0) == 0.0
    assert normalized_score(260.0, 20.0, 500.0) == pytest.approx(50.0)
    assert normalized_score(-300.0, -1200.0, -150.0) == pytest.approx(100 * 900 / 1050)  # negative returns
    np.testing.assert_allclose(normalized_score(np.array([20.0, 140.0]), 20.0, 260.0), [0.0, 50.0])
    s = summarize_returns([100.0, 200.0, 300.0], (0.0, 400.0))
    assert s["return_mean"] == 200.0 and s["return_std"] == pytest.approx(100.0)  # ddof=1
    assert s["score_mean"] == pytest.approx(50.0) and s["score_std"] == pytest.approx(25.0)
    with pytest.raises(ValueError, match="different references"):
        normalized_score(1.0, 5.0, 5.0)


@pytest.mark.parametrize("use_returns", [True, False])
def test_cached_rollout_equals_uncached_past_context(use_returns):
    torch.manual_seed(0)
    tok = cartpole_tok(context=4)
    model = DecisionTransformer(tok, tiny_trunk(), use_returns=use_returns)
    seeds = [3, 4, 5]
    targets = [200.0, 100.0, 50.0] if use_returns else None
    runs = []
    for cache in (True, False):
        envs = make_envs("CartPole-v1", 3)
        runs.append(rollout(model, tok, envs, seeds, targets=targets, max_steps=40, cache=cache, record=True))
    cached, full = runs
    assert cached.lengths.max() > 2 * tok.context  # the window slid several times
    np.testing.assert_array_equal(cached.lengths, full.lengths)
    np.testing.assert_array_equal(cached.returns, full.returns)
    assert len(cached.actions) == len(full.actions) == cached.lengths.max()
    for a, b in zip(cached.actions, full.actions):
        np.testing.assert_array_equal(a, b)
    for t, (a, b) in enumerate(zip(cached.outputs, full.outputs)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"step {t}")


def test_cached_rollout_continuous_pendulum():
    torch.manual_seed(1)
    env = gym.make("Pendulum-v1")
    spaces = SpaceSpec.from_env(env)
    tok = TrajectoryTokenizer(3, action_dim=1, rtg_scale=1000.0, max_timestep=200, context=5,
                              action_low=spaces.action_low, action_high=spaces.action_high)
    model = DecisionTransformer(tok, tiny_trunk(positions="none"))
    runs = [rollout(model, tok, make_envs("Pendulum-v1", 2), [0, 1], targets=[-200.0, -500.0], max_steps=17,
                    cache=c, record=True) for c in (True, False)]
    assert runs[0].lengths.tolist() == [17, 17]
    for a, b in zip(runs[0].outputs, runs[1].outputs):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
        assert np.all(np.abs(a) <= 2.0)  # tanh head rescaled to the torque bounds
    np.testing.assert_allclose(runs[0].returns, runs[1].returns, rtol=1e-6)


def test_action_dropout_hides_past_actions_in_training_only():
    """action_dropout: in training a hidden action token contributes its timestep alone (changing the action
    value changes nothing), kept ones do; in eval mode the model equals one built without it."""
    rng = np.random.default_rng(0)
    tok = cartpole_tok(context=4)
    x = tok.encode(fake_episode(rng, 4, "ep"), key="ep").tokens[None]  # (1, 12, F)
    flipped = x.clone()
    is_action = flipped[..., COL_KIND] == KIND_ACTION
    flipped[..., -1] = torch.where(is_action, 1.0 - flipped[..., -1], flipped[..., -1])
    torch.manual_seed(0)
    plain = DecisionTransformer(tok, tiny_trunk(dropout=0.0))
    hiding = DecisionTransformer(tok, tiny_trunk(dropout=0.0), action_dropout=0.5)
    hiding.load_state_dict(plain.state_dict())
    plain.eval(), hiding.eval()
    torch.testing.assert_close(hiding(x), plain(x), rtol=0, atol=0)
    assert not torch.allclose(plain(x), plain(flipped))  # the actions matter to the model

    hiding.train()
    # a seed whose draw (the one forward makes) hides the first action (row 2) and keeps the second (row 5)
    seed = next(s for s in range(100) if _draw(s, x)[2] == 0 and _draw(s, x)[5] == 1)
    outs = []
    for tokens in (x, flipped):
        torch.manual_seed(seed)
        outs.append(hiding(tokens))
    # rows 0-4 see only the hidden action: unchanged by the flip; from row 5 on the kept one shows
    torch.testing.assert_close(outs[0][:, :5], outs[1][:, :5], rtol=0, atol=0)
    assert (outs[0][:, 5:] - outs[1][:, 5:]).abs().amax() > 1e-4
    with pytest.raises(ValueError, match="action_dropout"):
        DecisionTransformer(tok, tiny_trunk(), action_dropout=1.0)


def _draw(seed: int, x: torch.Tensor) -> list[int]:
    torch.manual_seed(seed)
    return (torch.rand(x.shape[:-1] + (1,)) >= 0.5)[0, :, 0].long().tolist()


def test_windows_right_padded_and_bc_drops_return_tokens():
    rng = np.random.default_rng(0)
    eps = [fake_episode(rng, 9, "long"), fake_episode(rng, 3, "short")]
    tok = cartpole_tok(context=4)
    data = encode_episodes(tok, eps)
    assert data.window_start.tolist() == [0, 1, 2, 3, 4, 5, 9] and data.window_steps.tolist() == [4] * 6 + [3]
    x, y = gather_windows(data, data.window_start[-1:], data.window_steps[-1:], 4)  # the short episode
    assert x.shape == (1, 12, tok.feature_dim)
    assert x[0, :9, COL_KIND].tolist() == [0, 1, 2] * 3 and (x[0, 9:, COL_KIND] == KIND_PAD).all()
    assert y[0, 4, 0].item() == eps[1]["actions"][1]  # a_1 sits on the state row of step 1
    # causal + right padding: real tokens' outputs do not depend on the pads
    torch.manual_seed(0)
    model = DecisionTransformer(tok, tiny_trunk()).eval()
    alone = tok.encode(eps[1], key="short").tokens[None]
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :9], model(alone), atol=1e-6, rtol=1e-6)
    # pads carry no loss: the padded window's loss equals the unpadded episode's loss
    with torch.no_grad():
        seg = tok.encode(eps[1], key="short")
        l_pad, _ = action_loss(model, tok, x, y)
        l_alone, _ = action_loss(model, tok, seg.tokens[None], seg.targets[None])
    assert l_pad.item() == pytest.approx(l_alone.item(), rel=1e-6)

    bc = WindowLoader(data, 7, context=4, use_returns=False, shuffle=False)
    xb, yb = next(iter(bc))
    assert xb.shape == (7, 8, tok.feature_dim)
    kinds = xb[..., COL_KIND]
    assert not (kinds == KIND_RETURN).any()
    assert kinds[0].tolist() == [KIND_STATE, KIND_ACTION] * 4
    # the target on each state row is the action of the next row
    np.testing.assert_array_equal(yb[0, 0::2, 0].numpy(), xb[0, 1::2, tok.col_action].numpy())
    model_bc = DecisionTransformer(tok, tiny_trunk(), use_returns=False)
    assert model_bc.tokens_per_step == 2 and model_bc.new_cache(1).max_length == 8
    assert torch.isfinite(action_loss(model_bc, tok, xb, yb)[0])


def test_top_episodes_filtered_bc():
    eps = [{"key": f"e{i}", "rewards": np.full(i + 1, 1.0)} for i in range(25)]  # returns 1..25
    top = top_episodes(eps, 0.1)
    assert [e["key"] for e in top] == ["e22", "e23", "e24"]  # ceil(2.5) = 3 best, data order
    assert [e["key"] for e in top_episodes(eps[:3], 0.1)] == ["e2"]  # at least one


def test_bad_inputs_name_the_sample_or_env():
    rng = np.random.default_rng(0)
    tok = cartpole_tok(context=4)
    ep = fake_episode(rng, 6, "ep_nan")
    ep["observations"][2, 1] = np.nan
    with pytest.raises(ValueError, match="'ep_nan'.*NaN or inf"):
        encode_episodes(tok, [ep])
    ep = fake_episode(rng, 6, "ep_inf")
    ep["observations"][0, 0] = np.inf
    with pytest.raises(ValueError, match="'ep_inf'.*NaN or inf"):
        encode_episodes(tok, [ep])
    ep = fake_episode(rng, 6, "ep_act")
    ep["actions"] = rng.normal(size=(6, 3))
    with pytest.raises(TypeError, match="'ep_act'.*integer ids"):
        encode_episodes(tok, [ep])
    cont = TrajectoryTokenizer(4, action_dim=2, context=4, action_low=-1, action_high=1)
    ep = fake_episode(rng, 6, "ep_dim")
    ep["actions"] = rng.normal(size=(6, 3))
    with pytest.raises(ValueError, match=r"'ep_dim'.*\(T, 2\)"):
        encode_episodes(cont, [ep])
    with pytest.raises(ValueError, match="'ep_short'.*3 steps is shorter than context=4"):
        encode_episodes(tok, [fake_episode(rng, 3, "ep_short")], short="error")
    with pytest.warns(UserWarning, match="dropped 1 episodes"):
        assert encode_episodes(tok, [fake_episode(rng, 3, "s"), fake_episode(rng, 5, "l")], short="drop").keys == ["l"]
    # env spaces that do not match the dataset
    pend = gym.make("Pendulum-v1")
    with pytest.raises(ValueError, match="my-env: observation space .* does not match the dataset's states"):
        check_env(pend, tok, "my-env")
    model = DecisionTransformer(tok, tiny_trunk())
    with pytest.raises(ValueError, match=r"Pendulum-v1 env 0 \(seed 7\): observation space"):
        evaluate(model, tok, "Pendulum-v1", targets=[1.0], seeds=[7], reference=None)
    with pytest.raises(ValueError, match="Discrete"):
        check_env(gym.make("MountainCarContinuous-v0"), TrajectoryTokenizer(2, n_actions=3), "mc")
    with pytest.raises(ValueError, match="finite action_low/action_high"):
        DecisionTransformer(TrajectoryTokenizer(3, action_dim=1), tiny_trunk())
    with pytest.raises(ValueError, match="cannot make Gymnasium env 'NoSuchEnv-v9'"):
        make_envs("NoSuchEnv-v9", 1)

    # an env that emits NaN observations mid-episode
    class NaNAt(gym.Wrapper):
        def step(self, action):
            obs, r, term, trunc, info = self.env.step(action)
            if self.env.unwrapped.steps_beyond_terminated is None and self._n == 2:
                obs = obs * np.nan
            self._n += 1
            return obs, r, term, trunc, info

        def reset(self, **kw):
            self._n = 0
            return self.env.reset(**kw)

    envs = [gym.make("CartPole-v1"), NaNAt(gym.make("CartPole-v1"))]
    with pytest.raises(ValueError, match=r"env 1 \(seed 8\) step 3: observation contains NaN"):
        rollout(model, tok, envs, [7, 8], targets=[10.0, 10.0], max_steps=20)
    with pytest.raises(ValueError, match="one target return per env"):
        rollout(model, tok, envs, [7, 8], targets=None, max_steps=20)
    with pytest.raises(ValueError, match="max_timestep=500"):
        rollout(model, tok, envs, [7, 8], targets=[1.0, 1.0], max_steps=501)


def test_tiny_preset_learns_and_recipe_runs_end_to_end(tmp_path):
    from omni.data.builders_rl import build_gym

    data = tmp_path / "cartpole"
    build_gym(data, env="CartPole-v1", episodes=10, mix="expert:0.5,medium:0.3,random:0.2", seed=0,
              reference_episodes=2, minari=False, quiet=True)
    recipe = load_recipe()
    cfg = recipe.parse_args(["--preset", "tiny", "--data", str(data), "--out", str(tmp_path / "run"), "--set",
                             "steps=100", "progress=False", "methods=['dt']"])
    manifest, episodes = recipe.load_data(cfg)
    tok = make_tokenizer(episodes, SpaceSpec.from_manifest(manifest), context=cfg["context"], max_timestep=501)
    assert tok.rtg_scale == 500.0 and tok.fitted
    # the same initial model train_one builds (same seed), scored on a fixed batch before and after
    loader = WindowLoader(encode_episodes(tok, episodes), 256, context=cfg["context"], shuffle=False)
    batch = next(iter(loader))
    trunk = preset(cfg["trunk"], positions=cfg["positions"], dropout=cfg["dropout"], max_positions=15,
                   **cfg["trunk_overrides"])
    torch.manual_seed(0)
    before = DecisionTransformer(tok, trunk).eval()
    trained, metrics = recipe.train_one(cfg, tok, episodes, "dt", 0, torch.device("cpu"))
    trained.eval()
    with torch.no_grad():
        l0, m0 = action_loss(before, tok, *batch)
        l1, m1 = action_loss(trained, tok, *batch)
    assert l0.item() == pytest.approx(np.log(2), abs=0.05)  # untrained: uniform over 2 actions
    assert l1.item() < 0.75 * l0.item() and m1["accuracy"] > m0["accuracy"]
    # the export rebuilds the same policy with no training code
    final = tmp_path / "run" / "dt-seed0" / "final"
    loaded = load_pretrained(final)
    tok2 = load_tokenizers(final)["trajectory"]
    assert tok2.config() == tok.config()
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch[0]), trained(batch[0]))

    # the CLI path: builds nothing (data exists), trains dt + bc + fbc, sweeps targets, writes the table
    out = recipe.main(["--preset", "tiny", "--data", str(data), "--out", str(tmp_path / "cli"), "--set", "steps=3",
                       "progress=False", "eval_seeds=2", "target_fractions=[1.0, 0.5]"])
    saved = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert [(r["method"], r["episodes"]) for r in saved["results"]] == [("dt", 2), ("dt", 2), ("bc", 2), ("fbc", 2)]
    ref = saved["reference"]
    assert ref["expert"] == 500.0
    assert saved["results"][0]["target"] == pytest.approx(500.0)
    assert saved["results"][1]["target"] == pytest.approx(ref["random"] + 0.5 * (500.0 - ref["random"]))
    for r in saved["results"]:
        assert r["score_mean"] == pytest.approx(float(normalized_score(r["return_mean"], ref["random"], 500.0)))
    assert "| dt | 500.0 |" in out["table"] and "| fbc | - |" in out["table"]
    assert [r["episodes"] for r in out["runs"]] == [10, 10, 1]  # fbc: top 10% of 10 episodes
    # the time split: data, training per method, rollouts (what the run spent where), parts within the total
    seconds = saved["seconds"]
    assert list(seconds) == ["data", "training dt", "training bc", "training fbc", "rollouts", "total"]
    assert all(v >= 0 for v in seconds.values()) and sum(seconds.values()) - seconds["total"] <= seconds["total"]
    assert seconds["rollouts"] == pytest.approx(sum(r["eval_seconds"] for r in saved["runs"]))


def test_default_preset_is_cpu_without_cuda_and_dt_with(monkeypatch):
    """Plain ``python recipes/decision_transformer.py``: the cpu preset (minutes on 2 cores) on a machine without
    CUDA, the official dt configuration with one; --preset still wins; the cpu preset sweeps several targets (a
    return-vs-target curve) with enough episodes per target to read it."""
    recipe = load_recipe()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = recipe.parse_args([])
    assert cfg["preset"] == "cpu" and cfg["out"] == "runs/dt-CartPole-v1-cpu" and cfg["data"] == "data/gym-CartPole-v1"
    assert len(cfg["target_fractions"]) >= 3 and cfg["eval_seeds"] >= 20 and cfg["methods"] == ["dt", "bc", "fbc"]
    assert recipe.parse_args(["--preset", "tiny"])["preset"] == "tiny"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = recipe.parse_args([])
    assert cfg["preset"] == "dt" and cfg["steps"] == 10_000 and cfg["trunk_overrides"] == {}


def test_cuda_graph_auto_means_one_cuda_process(capsys):
    from types import SimpleNamespace

    recipe = load_recipe()
    assert recipe.COMMON["cuda_graph"] == "auto"

    def state(device, n):
        return SimpleNamespace(device=torch.device(device), num_processes=n)

    assert recipe.use_cuda_graph({"cuda_graph": "auto"}, state("cuda", 1)) is True
    assert recipe.use_cuda_graph({"cuda_graph": "auto"}, state("cuda", 2)) is False
    assert recipe.use_cuda_graph({"cuda_graph": "auto"}, state("cpu", 1)) is False
    assert recipe.use_cuda_graph({"cuda_graph": False}, state("cuda", 1)) is False
    # a bad value stops the recipe at argument parsing, before any data is built
    assert recipe.parse_args(["--set", "cuda_graph=True", "--data", "/nonexistent"])["cuda_graph"] is True
    with pytest.raises(SystemExit):
        recipe.parse_args(["--set", "cuda_graph='yes'", "--data", "/nonexistent"])
    assert "cuda_graph must be True, False or 'auto', got 'yes'" in capsys.readouterr().err
