"""Decision Transformer scores: the D4RL normalised score and the reference returns it is measured against."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from omni.rl.episodes import episode_return


def normalized_score(ret: float | np.ndarray, random_return: float, expert_return: float) -> float | np.ndarray:
    """100 * (R - R_random) / (R_expert - R_random): 0 = random policy, 100 = expert (D4RL convention)."""
    if not (math.isfinite(random_return) and math.isfinite(expert_return)) or expert_return == random_return:
        raise ValueError(f"normalized_score needs finite, different references, got random={random_return}, "
                         f"expert={expert_return}")
    return 100.0 * (np.asarray(ret, dtype=np.float64) - random_return) / (expert_return - random_return) \
        if isinstance(ret, np.ndarray) else 100.0 * (float(ret) - random_return) / (expert_return - random_return)


def summarize_returns(returns: Sequence[float], reference: tuple[float, float] | None) -> dict[str, float]:
    """mean / std (ddof=1; 0 for one episode) of the returns and of their normalised scores."""
    r = np.asarray(returns, dtype=np.float64)
    if r.size == 0:
        raise ValueError("summarize_returns got no returns")
    std = lambda a: float(a.std(ddof=1)) if a.size > 1 else 0.0  # noqa: E731
    out = {"episodes": int(r.size), "return_mean": float(r.mean()), "return_std": std(r)}
    if reference is not None:
        s = normalized_score(r, *reference)
        out.update(score_mean=float(s.mean()), score_std=std(s))
    return out



def reference_returns(manifest: Mapping[str, Any], episodes: Sequence[Mapping[str, Any]]
                      ) -> tuple[tuple[float, float], str]:
    """((random, expert) returns for the normalised score, where they come from): the manifest's
    (``omni data gym`` measures them with a random policy and the noise-free expert policy, scripted or
    trained; Minari ports carry ref_min/max_score), else the dataset's min / max episode return, with a
    warning."""
    refs = manifest.get("reference_returns") or {}
    lo, hi = refs.get("random"), refs.get("expert")
    if lo is not None and hi is not None:
        return (float(lo), float(hi)), "manifest (random policy / noise-free expert policy)"
    warnings.warn("dataset has no random/expert reference returns: using the dataset's min/max episode return")
    rets = [episode_return(ep) for ep in episodes]
    lo, hi = (min(rets) if lo is None else lo), (max(rets) if hi is None else hi)
    return (float(lo), float(hi)), "dataset min/max return"


__all__ = ["normalized_score", "reference_returns", "summarize_returns"]
