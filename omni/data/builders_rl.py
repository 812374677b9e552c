"""Offline-RL dataset builders: episodes recorded from scripted policies in Gymnasium, and
imports of local Minari datasets. One episode per sample:

* ``<key>.npz``: ``observations`` (T+1, ...) float32 including the final observation (the
  Minari layout), ``actions`` (T,) int64 or (T, A) float32, ``rewards`` (T,) float32,
  ``terminations`` / ``truncations`` (T,) bool;
* ``<key>.json``: env id, policy name, return, length (and the seed for recorded episodes).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from omni.data.policies import available_policies, make_policy, policy_source, register_policy_file, rollout
from omni.data.shards import Build, fingerprint_files
from omni.deps import require

EPISODE_KEYS = ("observations", "actions", "rewards", "terminations", "truncations")
DEFAULT_MIX = "random:0.1,replay:0.3,medium:0.4,expert:0.2"  # D4RL-like: mostly sub-expert data
NPZ_FIELD = "observations (T+1, ...) float32 incl. final, actions (T,) int64 | (T, A) float32, rewards (T,) float32, terminations/truncations (T,) bool"  # noqa: E501


def episode_npz(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Arrays -> .npz bytes (deflated), readable with ``np.load(io.BytesIO(b))``. Unlike
    ``np.savez`` the zip entries carry a fixed timestamp, so equal data gives equal bytes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, arr in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(arr), allow_pickle=False)
            zf.writestr(info, member.getvalue())
    return buf.getvalue()


def parse_mix(mix: str, env_id: str) -> dict[str, float]:
    """``"random:0.2,medium:0.5,expert:0.3"`` -> normalised weights (checked against the env's policies)."""
    weights: dict[str, float] = {}
    allowed = available_policies(env_id)
    for item in mix.split(","):
        name, sep, w = item.strip().partition(":")
        if not sep:
            raise ValueError(f"--mix items must be POLICY:WEIGHT, got {item!r}")
        if name not in allowed:
            raise ValueError(f"--mix: policy {name!r} is not available for {env_id}; available: {', '.join(allowed)}")
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(f"--mix: weight of {name!r} must be a number, got {w!r}") from None
        if weight < 0 or not np.isfinite(weight):
            raise ValueError(f"--mix: weight of {name!r} must be >= 0, got {weight}")
        weights[name] = weights.get(name, 0.0) + weight
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"--mix {mix!r}: weights sum to 0")
    return {k: v / total for k, v in weights.items()}


def mix_counts(weights: Mapping[str, float], episodes: int) -> dict[str, int]:
    """Largest-remainder rounding: counts proportional to weights that sum to ``episodes``."""
    raw = {k: w * episodes for k, w in weights.items()}
    counts = {k: int(np.floor(v)) for k, v in raw.items()}
    rest = episodes - sum(counts.values())
    for k in sorted(raw, key=lambda k: (counts[k] - raw[k], k))[:rest]:
        counts[k] += 1
    return counts


def _space_info(space: Any) -> dict[str, Any]:
    import gymnasium as gym

    if isinstance(space, gym.spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, gym.spaces.Box):
        return {
            "type": "Box",
            "shape": list(space.shape),
            "dtype": str(space.dtype),
            "low": np.asarray(space.low, dtype=np.float64).tolist(),
            "high": np.asarray(space.high, dtype=np.float64).tolist(),
        }
    return {"type": type(space).__name__, "repr": repr(space)}


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"count": int(a.size), "mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()), "max": float(a.max())}


def reference_returns(env_id: str, episodes: int = 10, seed: int = 1_000_000_000) -> dict[str, Any]:
    """Mean returns of the random policy and (where scripted) the noise-free expert controller,
    on seeds disjoint from the recorded data: the normalised-score references."""
    import gymnasium as gym

    env = gym.make(env_id)
    out: dict[str, Any] = {"episodes": episodes, "seed": seed, "random": None, "expert": None}
    names = ["random"] + (["reference"] if "reference" in available_policies(env_id) else [])
    for name in names:
        rets = []
        for i in range(episodes):
            rng = np.random.default_rng([seed, i])
            ep = rollout(env, make_policy(env_id, name, env.action_space, rng), seed + i, rng)
            rets.append(float(ep["rewards"].sum()))
        out["random" if name == "random" else "expert"] = float(np.mean(rets))
    env.close()
    return out


@contextlib.contextmanager
def minari_root(root: str | os.PathLike | None) -> Iterator[None]:
    """Temporarily point MINARI_DATASETS_PATH at ``root`` (None: leave it as it is)."""
    if root is None:
        yield
        return
    old = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = str(Path(root).resolve())
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MINARI_DATASETS_PATH", None)
        else:
            os.environ["MINARI_DATASETS_PATH"] = old


def minari_available() -> bool:
    try:
        import minari  # noqa: F401
    except ImportError:
        return False
    return True


def default_minari_id(out: str | os.PathLike) -> str:
    """``omni/<out folder name>-v0`` (characters Minari rejects become '-')."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", Path(out).resolve().name).strip("-").lower() or "dataset"
    return f"omni/{name}-v0"


_MINARI_AUTHOR = "omni data gym"
_MINARI_MARKER = ".omni"  # a file in datasets omni wrote, so a rebuild only ever replaces those


def _minari_dataset_dir(dataset_id: str) -> Path:
    from minari.storage.datasets_root_dir import get_dataset_path

    return Path(get_dataset_path(dataset_id))


def write_minari(
    dataset_id: str,
    episodes: list[dict[str, np.ndarray]],
    env_id: str,
    refs: Mapping[str, Any],
    description: str,
) -> Path:
    """The recorded episodes as a Minari dataset (``create_dataset_from_buffers``: no jax).
    Replaces an earlier dataset of that id only if omni wrote it."""
    import minari
    from minari.data_collector import EpisodeBuffer

    path = _minari_dataset_dir(dataset_id)
    if path.exists():
        if not (path / _MINARI_MARKER).exists():
            raise FileExistsError(
                f"Minari dataset {dataset_id!r} already exists at {path} and was not written by omni; "
                "pass another --minari-id or remove it"
            )
        minari.delete_dataset(dataset_id)
    buffers = [
        EpisodeBuffer(
            id=i,
            observations=ep["observations"],
            actions=ep["actions"],
            rewards=ep["rewards"],
            terminations=ep["terminations"],
            truncations=ep["truncations"],
        )
        for i, ep in enumerate(episodes)
    ]
    kwargs: dict[str, Any] = {}
    if refs.get("expert") is not None:  # Minari stores reference scores only as a pair
        kwargs = {"ref_min_score": refs["random"], "ref_max_score": refs["expert"]}
    with warnings.catch_warnings():
        # Minari nags about unset code_permalink / author_email; neither exists for local data.
        warnings.filterwarnings("ignore", message=r"`(code_permalink|author_email|eval_env)` is set to None")
        minari.create_dataset_from_buffers(
            dataset_id,
            buffers,
            env=env_id,
            algorithm_name="omni scripted policies",
            author=_MINARI_AUTHOR,
            description=description,
            **kwargs,
        )
    (path / _MINARI_MARKER).write_text("written by `omni data gym`; it replaces this dataset when rebuilding\n")
    return path


def build_gym(
    out: str | os.PathLike,
    *,
    env: str = "CartPole-v1",
    episodes: int = 1000,
    mix: str | None = None,
    seed: int = 0,
    val_fraction: float = 0.0,
    reference_episodes: int = 10,
    minari: bool | None = None,
    minari_id: str | None = None,
    minari_root_dir: str | os.PathLike | None = None,
    policies: str | os.PathLike | None = None,
    shard_size: int = 500,
    quiet: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Record ``episodes`` episodes of ``env`` from a seeded mix of behaviour policies.

    ``mix`` is ``POLICY:WEIGHT,...`` over ``random``, ``medium``, ``expert``, ``replay`` and
    ``reference`` (see omni.data.policies); default ``DEFAULT_MIX`` (random 0.1, replay 0.3, medium 0.4, expert 0.2)
    where scripted policies exist, else ``random:1``. Episode i runs with env seed
    ``seed * 1_000_003 + i``. ``val_fraction`` of the episodes (seeded) go to a ``val`` split.
    With ``minari`` (default: when importable) the same episodes are also written as a Minari
    dataset ``minari_id`` (default ``omni/<out name>-v0``) under ``minari_root_dir`` (default:
    MINARI_DATASETS_PATH, else Minari's own default). ``policies`` is an ``omni data train-policy``
    file whose expert/medium policies replace ``env``'s (its env must be ``env``).
    """
    import gymnasium as gym

    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    try:
        probe = gym.make(env)
    except gym.error.Error as exc:
        raise ValueError(f"cannot make Gymnasium env {env!r}: {exc}") from None
    action_space, observation_space = probe.action_space, probe.observation_space
    probe.close()
    if policies is not None:
        register_policy_file(policies, env=env)
    if mix is None:
        mix = DEFAULT_MIX if "expert" in available_policies(env) else "random:1"
    weights = parse_mix(mix, env)
    counts = mix_counts(weights, episodes)
    if minari is None:
        minari = minari_available()
    elif minari and not minari_available():
        require("minari")  # raises MissingDependency naming the extra (rl)
    mid = (minari_id or default_minari_id(out)) if minari else None
    root = None
    if minari:
        with minari_root(minari_root_dir):
            root = str(_minari_dataset_dir("").resolve())

    with Build(
        out, "gym",
        {"env": env, "episodes": episodes, "mix": {k: round(v, 12) for k, v in sorted(weights.items())}, "seed": seed,
         "val_fraction": val_fraction, "reference_episodes": reference_episodes, "minari_id": mid, "minari_root": root,
         **({"policy_sha256": source["sha256"]} if (source := policy_source(env)) else {})},
        source={"gymnasium": gym.__version__}, shard_size=shard_size, quiet=quiet, force=force,
    ) as build:  # fmt: skip

        def minari_present(manifest: dict[str, Any]) -> bool:
            if mid is None:
                return True
            with minari_root(root):
                return (_minari_dataset_dir(mid) / "data").is_dir()

        if (manifest := build.up_to_date(minari_present)) is not None:
            return manifest

        rng = np.random.default_rng([seed, 1])
        policies = [name for name in sorted(counts) for _ in range(counts[name])]
        policies = [policies[i] for i in rng.permutation(len(policies))]
        n_val = int(round(val_fraction * episodes))
        split_of = ["val" if i < n_val else "train" for i in range(episodes)]
        split_of = [split_of[i] for i in rng.permutation(episodes)]

        build.start()
        environment = gym.make(env)
        recorded: list[dict[str, np.ndarray]] = []
        returns: dict[str, list[float]] = {}
        # Every split writer closes on success and aborts (drops its temp shard) on any error.
        with contextlib.ExitStack() as stack:
            writers = {s: stack.enter_context(build.split(s, total=split_of.count(s)))
                       for s in ("train", "val") if s in split_of}
            counters = dict.fromkeys(writers, 0)
            for i, name in enumerate(policies):
                ep_seed = seed * 1_000_003 + i
                ep_rng = np.random.default_rng([seed, 2, i])
                ep = rollout(environment, make_policy(env, name, action_space, ep_rng), ep_seed, ep_rng)
                ret = float(ep["rewards"].sum())
                returns.setdefault(name, []).append(ret)
                split = split_of[i]
                meta = {"env_id": env, "policy": name, "return": ret, "length": int(len(ep["actions"])), "seed": ep_seed,
                        "episode": i}  # fmt: skip
                writers[split].write({"__key__": f"{split}_{counters[split]:07d}", "npz": episode_npz(ep), "json": meta})
                counters[split] += 1
                if minari:
                    recorded.append(ep)
        environment.close()
        refs = reference_returns(env, reference_episodes) if reference_episodes > 0 else {"random": None, "expert": None}
        minari_path = None
        if minari:
            desc = f"{episodes} episodes of {env} from omni's behaviour policies, mix {mix}, seed {seed}"
            with minari_root(root):
                minari_path = str(write_minari(mid, recorded, env, refs, desc))
        return build.finish(
            env_id=env,
            observation_space=_space_info(observation_space),
            action_space=_space_info(action_space),
            policy_counts=counts,
            policy_returns={k: _stats(v) for k, v in sorted(returns.items())},
            reference_returns=refs,
            behaviour_policy_file=source,
            minari={"id": mid, "path": minari_path} if minari else None,
            fields={"npz": NPZ_FIELD, "json": "{env_id, policy, return, length, seed, episode}"},
        )


# -- Minari import ----------------------------------------------------------------------------------
def _flat(value: Any, space: Any, what: str) -> np.ndarray:
    """Minari episode field -> one array; Dict/Tuple spaces are flattened per step (keys sorted)."""
    import gymnasium as gym

    if isinstance(value, np.ndarray):
        return value
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)) and isinstance(value, (dict, tuple, list)):
        if isinstance(value, dict):
            parts = [value[k] for k in sorted(value)]
        else:
            parts = list(value)
        parts = [np.asarray(p).reshape(len(p), -1).astype(np.float32) for p in parts]
        return np.concatenate(parts, axis=1)
    raise TypeError(f"{what}: unsupported Minari field of type {type(value).__name__}")


def build_minari(
    out: str | os.PathLike,
    *,
    dataset_id: str,
    root: str | os.PathLike | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    shard_size: int = 500,
    quiet: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """A local Minari dataset (under ``root`` or MINARI_DATASETS_PATH) -> episode shards in the
    same layout as ``build_gym``. Dict/Tuple observations are flattened (keys sorted)."""
    try:
        import minari
    except ImportError as exc:
        raise ImportError("importing Minari datasets needs `pip install 'minari[hdf5]'`") from exc
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    with minari_root(root):
        path = _minari_dataset_dir(dataset_id)
        if not (path / "data").is_dir():
            raise FileNotFoundError(
                f"no local Minari dataset {dataset_id!r} at {path} (set --root or MINARI_DATASETS_PATH; "
                "this command does not download)"
            )
        files = sorted(p for p in path.rglob("*") if p.is_file())
        with Build(
            out, "minari", {"id": dataset_id, "val_fraction": val_fraction, "seed": seed},
            source={"files": len(files), "stat_sha256": fingerprint_files(files, path)},
            shard_size=shard_size, quiet=quiet, force=force,
        ) as build:  # fmt: skip
            if (manifest := build.up_to_date()) is not None:
                return manifest
            dataset = minari.load_dataset(dataset_id)
            meta = dataset.storage.metadata
            env_spec = dataset.spec.env_spec if hasattr(dataset, "spec") else None
            env_id = env_spec.id if env_spec is not None else None
            n = dataset.total_episodes
            rng = np.random.default_rng([seed, 3])
            n_val = int(round(val_fraction * n))
            val = set(rng.permutation(n)[:n_val].tolist())
            build.start()
            returns: list[float] = []
            policy = meta.get("algorithm_name") or "minari"
            with contextlib.ExitStack() as stack:  # writers close on success, abort on any error
                writers = {"train": stack.enter_context(build.split("train", total=n - n_val))}
                if n_val:
                    writers["val"] = stack.enter_context(build.split("val", total=n_val))
                counters = dict.fromkeys(writers, 0)
                for j, ep in enumerate(dataset.iterate_episodes()):
                    arrays = {
                        "observations": _flat(ep.observations, dataset.observation_space, f"episode {ep.id} observations"),
                        "actions": _flat(ep.actions, dataset.action_space, f"episode {ep.id} actions"),
                        "rewards": np.asarray(ep.rewards, dtype=np.float32),
                        "terminations": np.asarray(ep.terminations, dtype=bool),
                        "truncations": np.asarray(ep.truncations, dtype=bool),
                    }
                    if arrays["observations"].dtype == np.float64:
                        arrays["observations"] = arrays["observations"].astype(np.float32)
                    if arrays["actions"].dtype.kind == "f":
                        arrays["actions"] = arrays["actions"].astype(np.float32)
                    elif arrays["actions"].dtype.kind in "iu":
                        arrays["actions"] = arrays["actions"].astype(np.int64)
                    ret = float(arrays["rewards"].sum())
                    returns.append(ret)
                    split = "val" if j in val else "train"
                    info = {"env_id": env_id, "policy": policy, "return": ret, "length": int(len(arrays["actions"])),
                            "episode": int(ep.id)}  # fmt: skip
                    writers[split].write({"__key__": f"{split}_{counters[split]:07d}", "npz": episode_npz(arrays),
                                          "json": info})
                    counters[split] += 1
            return build.finish(
                env_id=env_id,
                minari={"id": dataset_id, "path": str(path), "minari_version": meta.get("minari_version")},
                observation_space=_space_info(dataset.observation_space),
                action_space=_space_info(dataset.action_space),
                policy_returns={policy: _stats(returns)} if returns else {},
                reference_returns={"random": meta.get("ref_min_score"), "expert": meta.get("ref_max_score"),
                                   "source": "minari metadata"},  # fmt: skip
                fields={"npz": NPZ_FIELD, "json": "{env_id, policy, return, length, episode}"},
            )
