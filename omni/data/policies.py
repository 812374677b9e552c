"""Scripted behaviour policies of several skill levels for recording offline-RL data.

A policy here is a callable ``(observation, rng) -> action`` built by ``make_policy(env_id,
name, action_space)``. Skill levels follow the D4RL naming:

* ``random``  - uniform samples from the action space (the score-normalisation floor);
* ``expert``  - a hand-written controller with a little noise (the ceiling);
* ``medium``  - a *different*, systematically worse controller with a little noise, at roughly a
  third of the expert's normalised score;
* ``replay``  - the medium controller with a noise level drawn per episode between medium's and
  random's, like the replay buffer of an agent that never got past medium (the "medium-replay"
  flavour: every skill level from random up to medium).

``reference`` is the noise-free expert controller: its average return is the expert reference score.

Why medium is a different controller and not a noisier expert: the mean action of a noisy expert
*is* the expert, so behaviour cloning a mixture of noisy experts recovers the expert and a dataset
built that way cannot tell return-conditioned policies from cloning (measured on CartPole: BC
scored 100). Here the medium controller disagrees with the expert in a consistent way, so the
average action of a mixed dataset is not the expert's, as with D4RL's half-trained agents.

Hand-written controllers exist for CartPole-v1 (discrete; expert: PD on pole angle and cart position;
medium: the same PD with a constant rightward bias, so the cart drifts off the track after ~200
steps; epsilon-random actions as noise) and Pendulum-v1 (continuous; expert: energy-shaping
swing-up and PD balance at the top; medium: pumps the energy slightly above the top's, so the
pendulum swings over the top forever instead of balancing; Gaussian action noise). Hopper-v5
(MuJoCo) uses *trained* linear policies shipped in ``policy_weights/Hopper-v5.json``: the expert is an
ARS agent at the end of training, medium the same agent early on at ~40% of its return (see
omni.data.ars; ``omni data train-policy`` makes such a file for any Box-action env and
``register_policy_file`` / ``omni data gym --policies FILE`` uses it). Every other environment offers
only ``random``.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
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


def cartpole_biased_controller(obs: np.ndarray) -> int:
    """The expert's PD with a constant bias: the pole leans, the cart keeps accelerating to one side
    and leaves the track (|x| > 2.4) after about 220 steps; the medium policy."""
    x, x_dot, theta, theta_dot = (float(v) for v in obs)
    u = 10.0 * theta + 2.0 * theta_dot + 0.1 * x + 0.3 * x_dot + 0.5
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


def pendulum_spinning_controller(obs: np.ndarray) -> np.ndarray:
    """Energy shaping towards E = 2 (a little above the upright's E = 0) and no balancing: the
    pendulum goes over the top and keeps circling, about a third of the expert's score; the
    medium policy."""
    cos_t, sin_t, theta_dot = (float(v) for v in obs)
    energy = 0.5 * theta_dot**2 + _PENDULUM_W2 * (cos_t - 1.0)
    direction = math.copysign(1.0, theta_dot) if abs(theta_dot) > 1e-3 else 1.0
    u = -1.0 * (energy - 2.0) * direction
    return np.array([np.clip(u, -_PENDULUM_MAX_TORQUE, _PENDULUM_MAX_TORQUE)], dtype=np.float32)


@dataclass(frozen=True)
class _Behaviour:
    expert: Callable[[np.ndarray], Any]
    medium: Callable[[np.ndarray], Any]
    discrete: bool
    noise: float  # epsilon (discrete) or Gaussian action std as a fraction of the range, expert and medium
    worst_noise: float  # the noise level that "replay" reaches at its worst


_BEHAVIOUR: dict[str, _Behaviour] = {
    "CartPole-v1": _Behaviour(cartpole_controller, cartpole_biased_controller, True, 0.02, 1.0),
    "Pendulum-v1": _Behaviour(pendulum_controller, pendulum_spinning_controller, False, 0.1, 3.0),
}
# Trained (ARS) policies: Gaussian noise 0.1 of the action half-range for expert/medium, like Pendulum;
# replay's worst episodes act with noise as large as the whole range (the agent falls within ~20 steps).
_TRAINED_NOISE, _TRAINED_WORST_NOISE = 0.1, 1.0
POLICY_WEIGHTS_DIR = Path(__file__).with_name("policy_weights")
_SOURCES: dict[str, dict[str, str]] = {}


def register_policy_file(path: str | os.PathLike, env: str | None = None) -> str:
    """Use the expert/medium linear policies of a ``omni data train-policy`` file for its env (replacing
    any registered before); returns the env id. With ``env``, a file for another env is refused (and
    nothing is registered)."""
    from omni.data.ars import load_policies

    env_id, policies = load_policies(path)
    if env is not None and env_id != env:
        raise ValueError(f"{path}: policies for {env_id!r}, but the env is {env!r}")
    _registry()  # the shipped files first, so this one replaces a shipped one for the same env
    _add(path, env_id, policies)
    return env_id


def _add(path: str | os.PathLike, env_id: str, policies: dict[str, Any]) -> None:
    _BEHAVIOUR[env_id] = _Behaviour(policies["expert"], policies["medium"], False, _TRAINED_NOISE,
                                    _TRAINED_WORST_NOISE)
    _SOURCES[env_id] = {"file": str(Path(path).resolve()),
                        "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}


def policy_source(env_id: str) -> dict[str, str] | None:
    """``{file, sha256}`` of the trained-policy file ``env_id`` uses; None for hand-written or random."""
    _registry()
    return _SOURCES.get(env_id)


_SHIPPED_LOADED = False


def _registry() -> dict[str, _Behaviour]:
    """The behaviour policies by env, with the shipped policy files (POLICY_WEIGHTS_DIR) registered on first
    use rather than at import (importing omni.data reads no files)."""
    global _SHIPPED_LOADED
    if not _SHIPPED_LOADED:
        _SHIPPED_LOADED = True
        from omni.data.ars import load_policies

        for file in sorted(POLICY_WEIGHTS_DIR.glob("*.json")):
            _add(file, *load_policies(file))
    return _BEHAVIOUR


def scripted_envs() -> tuple[str, ...]:
    """Environments with non-random behaviour policies (hand-written or trained)."""
    return tuple(_registry())


def available_policies(env_id: str) -> tuple[str, ...]:
    """Policy names ``make_policy`` accepts for ``env_id``."""
    return POLICY_NAMES if env_id in _registry() else ("random",)


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


def _noisy(spec: _Behaviour, controller: Callable[[np.ndarray], Any], action_space: Any, noise: float) -> Policy:
    if spec.discrete:
        n = int(action_space.n)

        def act(obs: np.ndarray, rng: np.random.Generator) -> int:
            if rng.random() < noise:
                return int(rng.integers(n))
            return int(controller(obs))

        return act

    low, high = action_space.low, action_space.high
    scale = (high - low) / 2.0

    def act_c(obs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        a = np.asarray(controller(obs), dtype=np.float64)
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
    spec = _registry().get(env_id)
    if spec is None:
        raise ValueError(
            f"no {name!r} behaviour policy for {env_id!r}: only 'random' is available there "
            f"(behaviour policies exist for {', '.join(_registry())}; train one with `omni data train-policy`)"
        )
    if name == "reference":
        return _noisy(spec, spec.expert, action_space, 0.0)
    if name == "expert":
        return _noisy(spec, spec.expert, action_space, spec.noise)
    if name == "medium":
        return _noisy(spec, spec.medium, action_space, spec.noise)
    if rng is None:
        raise ValueError("the 'replay' policy needs rng= to draw its per-episode noise level")
    return _noisy(spec, spec.medium, action_space, float(rng.uniform(spec.noise, spec.worst_noise)))


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
