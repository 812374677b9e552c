"""Scripted behaviour policies: skill levels are ordered and medium is a different controller (so
cloning a mixed dataset does not recover the expert)."""

from __future__ import annotations

import numpy as np
import pytest

gym = pytest.importorskip("gymnasium")

from omni.data.policies import available_policies, make_policy, rollout  # noqa: E402

try:
    import mujoco  # noqa: F401

    HAVE_MUJOCO = True
except ImportError:
    HAVE_MUJOCO = False
needs_mujoco = pytest.mark.skipif(not HAVE_MUJOCO, reason="Hopper-v5 needs the mujoco wheel (pip install -e '.[rl]')")


def _mean_return(env_id: str, name: str, episodes: int = 4) -> float:
    env = gym.make(env_id)
    rng = np.random.default_rng(0)
    returns = [rollout(env, make_policy(env_id, name, env.action_space, rng), 100 + i, rng)["rewards"].sum()
               for i in range(episodes)]
    return float(np.mean(returns))


@pytest.mark.parametrize("env_id, medium_band", [("CartPole-v1", (0.2, 0.6)), ("Pendulum-v1", (0.15, 0.5)),
                                                  pytest.param("Hopper-v5", (0.25, 0.6), marks=needs_mujoco)])
def test_skill_levels_are_ordered(env_id: str, medium_band: tuple[float, float]) -> None:
    r = {name: _mean_return(env_id, name) for name in ("random", "medium", "expert")}
    assert r["random"] < r["medium"] < r["expert"]
    frac = (r["medium"] - r["random"]) / (r["expert"] - r["random"])
    assert medium_band[0] < frac < medium_band[1], (env_id, r)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1", pytest.param("Hopper-v5", marks=needs_mujoco)])
def test_medium_is_not_a_noisy_expert(env_id: str) -> None:
    """On the states the medium policy visits, its noise-free action differs from the expert's often
    (discrete) or by a large mean torque (continuous): the mixture's mean action is not the expert."""
    env = gym.make(env_id)
    rng = np.random.default_rng(0)
    medium = make_policy(env_id, "medium", env.action_space, rng)
    obs = rollout(env, medium, 7, rng)["observations"]
    from omni.data import policies

    spec = policies._registry()[env_id]
    expert_actions = np.array([np.asarray(spec.expert(o), dtype=np.float64) for o in obs])
    medium_actions = np.array([np.asarray(spec.medium(o), dtype=np.float64) for o in obs])
    if env_id != "CartPole-v1":  # what the env executes (a linear policy's raw output is unbounded)
        low, high = env.action_space.low, env.action_space.high
        expert_actions, medium_actions = np.clip(expert_actions, low, high), np.clip(medium_actions, low, high)
    gap = np.abs(expert_actions - medium_actions)
    if env_id == "CartPole-v1":
        assert 0.1 < (gap > 0).mean() < 0.9
    elif env_id == "Pendulum-v1":
        assert gap.mean() > 0.5  # torque units, range [-2, 2]
    else:  # Hopper: three joint torques in [-1, 1]; the half-trained agent has its own gait: on its own
        # states its torques differ from the expert's by more than half the expert's typical torque
        assert gap.mean() > 0.5 * np.abs(expert_actions).mean()


def test_unknown_env_offers_only_random() -> None:
    assert available_policies("Acrobot-v1") == ("random",)
    with pytest.raises(ValueError, match="only 'random'"):
        make_policy("Acrobot-v1", "expert", gym.make("Acrobot-v1").action_space)
