"""Scripted behaviour policies of several skill levels for recording offline-RL data.

A policy here is a callable ``(observation, rng) -> action`` built by ``make_policy(env_id,
name, action_space)``. Skill levels follow the D4RL naming:

* ``random``  - uniform samples from the action space (the score-normalisation floor);
* ``expert``  - a hand-written controller with a little noise (the ceiling);
* ``medium``  - the same controller with heavy noise: about a third to half the expert return;
* ``replay``  - a different noise level per episode, drawn uniformly between expert's and
  random's, like the replay buffer of an agent that learned from scratch (the "medium-replay"
  flavour: every skill level in between).

``reference`` is the noise-free controller: its average return is the expert reference score.

Scripted controllers exist for CartPole-v1 (discrete: PD on pole angle and cart position,
epsilon-random actions as noise) and Pendulum-v1 (continuous: energy-shaping swing-up, PD
balance near the top, Gaussian action noise). Every other environment offers only ``random``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

POLICY_NAMES = ("random", "medium", "expert", "replay", "reference")
Policy = Callable[[np.ndarray, np.random.Generator], Any]


def cartpole_controller(obs: np.ndarray) -> int:
    """PD on the pole angle/velocity plus a weak PD on cart position so the cart does not drift off
    the track within 500 steps. Push right (1) when the weighted error is positive."""
    x, x_dot, theta, theta_dot = (float(v) for v in obs)
    u = 10.0 * theta + 2.0 * theta_dot + 0.1 * x + 0.3 * x_dot
    return int(u > 0.0)


# Pendulum-v1: theta'' = 3g/(2l) sin(theta) + 3/(m l^2) u with g=10, m=l=1, theta=0 upright.
_PENDULUM_W2 = 15.0  # 3 g / (2 l)
_PENDULUM_MAX_TORQUE = 2.0


def pendulum_controller(obs: np.ndarray) -> np.ndarray:
    """Swing up by pumping energy E = theta_dot^2 / 2 + w^2 (cos(theta) - 1) towards 0 (upright at
    rest; dE/dt = 3 u theta_dot), then balance with PD once close to the top."""
    cos_t, sin_t, theta_dot = (float(v) for v in obs)
    theta = math.atan2(sin_t, cos_t)
    if cos_t > 0.85:  # within ~30 degrees of upright: the PD gains beat gravity (Kp > w^2 / 3)
        u = -(12.0 * theta + 2.5 * theta_dot)
    else:
        energy = 0.5 * theta_dot**2 + _PENDULUM_W2 * (cos_t - 1.0)
        # Pump along the velocity; from rest at the bottom (theta_dot = 0) kick to start swinging.
        direction = math.copysign(1.0, theta_dot) if abs(theta_dot) > 1e-3 else 1.0
        u = -1.0 * energy * direction
    return np.array([np.clip(u, -_PENDULUM_MAX_TORQUE, _PENDULUM_MAX_TORQUE)], dtype=np.float32)


@dataclass(frozen=True)
class _Scripted:
    controller: Callable[[np.ndarray], Any]
    discrete: bool
    expert_noise: float  # epsilon (discrete) or Gaussian action std as a fraction of the range
    medium_noise: float
    random_noise: float  # the noise level that "replay" reaches at its worst


_SCRIPTED: dict[str, _Scripted] = {
    "CartPole-v1": _Scripted(cartpole_controller, True, 0.02, 0.5, 1.0),
    "Pendulum-v1": _Scripted(pendulum_controller, False, 0.1, 2.0, 3.0),
}


def scripted_envs() -> tuple[str, ...]:
    """Environments with scripted (non-random) policies."""
    return tuple(_SCRIPTED)


def available_policies(env_id: str) -> tuple[str, ...]:
    """Policy names ``make_policy`` accepts for ``env_id``."""
    return POLICY_NAMES if env_id in _SCRIPTED else ("random",)


def _random_policy(action_space: Any) -> Policy:
    import gymnasium as gym

    if isinstance(action_space, gym.spaces.Discrete):
        n, start = int(action_space.n), int(action_space.start)
        return lambda obs, rng: int(start + rng.integers(n))
    if isinstance(action_space, gym.spaces.Box):
        low, high = action_space.low, action_space.high
        if not (np.isfinite(low).all() and np.isfinite(high).all()):
            raise ValueError(f"random policy needs a bounded Box action space, got {action_space}")
        return lambda obs, rng: rng.uniform(low, high).astype(action_space.dtype)
    raise ValueError(f"random policy supports Discrete and Box action spaces, got {action_space}")


def _noisy(spec: _Scripted, action_space: Any, noise: float) -> Policy:
    if spec.discrete:
        n = int(action_space.n)

        def act(obs: np.ndarray, rng: np.random.Generator) -> int:
            if rng.random() < noise:
                return int(rng.integers(n))
            return int(spec.controller(obs))

        return act

    low, high = action_space.low, action_space.high
    scale = (high - low) / 2.0

    def act_c(obs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        a = np.asarray(spec.controller(obs), dtype=np.float64)
        if noise > 0:
            a = a + rng.normal(0.0, noise, size=a.shape) * scale
        return np.clip(a, low, high).astype(action_space.dtype)

    return act_c


def make_policy(env_id: str, name: str, action_space: Any, rng: np.random.Generator | None = None) -> Policy:
    """Policy ``name`` for ``env_id``. ``rng`` is only used by ``replay`` to draw this episode's
    noise level (call make_policy once per episode for replay)."""
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    if name == "random":
        return _random_policy(action_space)
    spec = _SCRIPTED.get(env_id)
    if spec is None:
        raise ValueError(
            f"no scripted {name!r} policy for {env_id!r}: only 'random' is available there "
            f"(scripted policies exist for {', '.join(_SCRIPTED)})"
        )
    if name == "reference":
        return _noisy(spec, action_space, 0.0)
    if name == "expert":
        return _noisy(spec, action_space, spec.expert_noise)
    if name == "medium":
        return _noisy(spec, action_space, spec.medium_noise)
    if rng is None:
        raise ValueError("the 'replay' policy needs rng= to draw its per-episode noise level")
    return _noisy(spec, action_space, float(rng.uniform(spec.expert_noise, spec.random_noise)))


def rollout(env: Any, policy: Policy, seed: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Run one episode; returns Minari-layout arrays: observations (T+1, ...) including the final
    one, actions (T, ...), rewards/terminations/truncations (T,)."""
    obs, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    observations, actions, rewards, terms, truncs = [obs], [], [], [], []
    while True:
        action = policy(obs, rng)
        obs, reward, terminated, truncated, _ = env.step(action)
        observations.append(obs)
        actions.append(action)
        rewards.append(reward)
        terms.append(terminated)
        truncs.append(truncated)
        if terminated or truncated:
            break
    act = np.asarray(actions)
    return {
        "observations": np.asarray(observations, dtype=np.float32),
        "actions": act.astype(np.int64) if act.dtype.kind in "iu" else act.astype(np.float32),
        "rewards": np.asarray(rewards, dtype=np.float32),
        "terminations": np.asarray(terms, dtype=bool),
        "truncations": np.asarray(truncs, dtype=bool),
    }
