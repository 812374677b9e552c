"""Trained behaviour policies (ARS): the running statistics, determinism, the policy file format and
its use by `omni data gym`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gymnasium")

from omni.data import policies  # noqa: E402
from omni.data.ars import (  # noqa: E402
    ARSConfig,
    LinearPolicy,
    _RunningStats,
    load_policies,
    save_policies,
    select_behaviour,
    train_ars,
)

TINY = ARSConfig(iterations=4, directions=2, top=1, eval_every=2, eval_episodes=1, seed=3)


def test_running_stats_match_numpy() -> None:
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=(n, 5)) for n in (1, 7, 30, 2)]
    stats = _RunningStats(5)
    for b in batches:
        stats.update(b)
    everything = np.concatenate(batches)
    np.testing.assert_allclose(stats.mean, everything.mean(0), rtol=1e-12)
    np.testing.assert_allclose(stats.std(), everything.std(0) + 1e-8, rtol=1e-12)


def test_ars_is_deterministic_for_a_seed() -> None:
    a, b = train_ars("Pendulum-v1", TINY, log=None), train_ars("Pendulum-v1", TINY, log=None)
    assert [c["iteration"] for c in a] == [2, 4]
    for ca, cb in zip(a, b):
        assert ca["return"] == cb["return"] and ca["env_steps"] == cb["env_steps"]
        np.testing.assert_array_equal(ca["policy"].weights, cb["policy"].weights)
        np.testing.assert_array_equal(ca["policy"].obs_std, cb["policy"].obs_std)
    assert np.abs(a[-1]["policy"].weights).sum() > 0  # the update moved the weights
    other = train_ars("Pendulum-v1", ARSConfig(**{**TINY.__dict__, "seed": 4}), log=None)
    assert not np.array_equal(other[-1]["policy"].weights, a[-1]["policy"].weights)


def _policy_file(tmp_path: Path) -> Path:
    checkpoints = train_ars("Pendulum-v1", TINY, log=None)
    chosen = select_behaviour("Pendulum-v1", checkpoints, episodes=1)
    return save_policies(tmp_path / "pendulum.json", "Pendulum-v1", chosen, checkpoints, TINY, "test")


def test_policy_file_round_trip_and_errors(tmp_path: Path) -> None:
    path = _policy_file(tmp_path)
    doc = json.loads(path.read_text())
    assert doc["env"] == "Pendulum-v1" and set(doc["policies"]) == {"expert", "medium"}
    assert doc["policies"]["medium"]["iteration"] < doc["policies"]["expert"]["iteration"]
    env_id, loaded = load_policies(path)
    obs = np.array([0.3, -0.9, 1.5])
    w = doc["policies"]["expert"]
    expected = np.asarray(w["weights"]) @ ((obs - np.asarray(w["obs_mean"])) / np.asarray(w["obs_std"]))
    np.testing.assert_allclose(loaded["expert"](obs), expected)

    bad = dict(doc, policies={"expert": doc["policies"]["expert"]})
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"bad.json: policies \['medium'\] missing"):
        load_policies(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="do not fit"):
        LinearPolicy.from_dict({"weights": [[1.0, 2.0]], "obs_mean": [0.0], "obs_std": [1.0]})
    with pytest.raises(ValueError, match="non-positive obs_std"):
        LinearPolicy.from_dict({"weights": [[1.0]], "obs_mean": [0.0], "obs_std": [0.0]})
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ValueError, match="junk.json: cannot read"):
        load_policies(tmp_path / "junk.json")


def test_gym_builder_uses_a_policy_file(tmp_path: Path, monkeypatch) -> None:
    from omni.data.builders_rl import build_gym

    path = _policy_file(tmp_path)
    monkeypatch.setattr(policies, "_BEHAVIOUR", dict(policies._registry()))  # keep the built-in Pendulum expert
    monkeypatch.setattr(policies, "_SOURCES", dict(policies._SOURCES))
    manifest = build_gym(tmp_path / "data", env="Pendulum-v1", episodes=4, mix="medium:1", policies=path,
                         reference_episodes=1, minari=False, quiet=True)
    assert manifest["behaviour_policy_file"]["sha256"] == policies.policy_source("Pendulum-v1")["sha256"]
    assert manifest["args"]["policy_sha256"] == manifest["behaviour_policy_file"]["sha256"]
    with pytest.raises(ValueError, match="policies for 'Pendulum-v1', but the env is 'CartPole-v1'"):
        build_gym(tmp_path / "other", env="CartPole-v1", episodes=2, policies=path, minari=False, quiet=True)
