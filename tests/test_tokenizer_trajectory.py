"""TrajectoryTokenizer: returns-to-go, token layout, normalisation, windows, embedder, decode, errors."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
import torch

from omni.segment import Role
from omni.tokenizers.base import Tokenizer, get_tokenizer
from omni.tokenizers.trajectory import (
    KIND_ACTION,
    KIND_RETURN,
    KIND_STATE,
    TrajectoryTokenizer,
    returns_to_go,
    windows,
)


def _exact(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=0)


def _episode(T: int, S: int = 3, A: int | None = 2, n_actions: int | None = None, seed: int = 0, final_obs=True):
    rng = np.random.default_rng(seed)
    obs = rng.normal(loc=[1.0, -5.0, 100.0][:S], scale=[0.5, 2.0, 30.0][:S], size=(T + int(final_obs), S))
    actions = rng.integers(0, n_actions, size=T) if n_actions else rng.uniform(-1, 1, size=(T, A))
    return {"observations": obs, "actions": actions, "rewards": rng.normal(size=T)}


# -- returns-to-go and windows --------------------------------------------------------------------------
def test_returns_to_go_exact():
    np.testing.assert_array_equal(returns_to_go([1.0, 2.0, 3.0]), [6.0, 5.0, 3.0])
    np.testing.assert_array_equal(returns_to_go([1.0, 2.0, 3.0], gamma=0.5), [2.75, 3.5, 3.0])
    np.testing.assert_array_equal(returns_to_go([-1.0]), [-1.0])
    assert returns_to_go(np.ones(4)).dtype == np.float64


@pytest.mark.parametrize(
    "T,context,stride", [(1, 5, 1), (5, 5, 1), (23, 5, 1), (23, 5, 5), (23, 4, 3), (23, 4, 4), (100, 20, 20)]
)
def test_windows_cover_every_step(T, context, stride):
    starts = windows(T, context, stride=stride)
    assert starts[0] == 0 and starts == sorted(set(starts))
    covered = np.zeros(T, dtype=bool)
    for s in starts:
        assert 0 <= s and s + min(context, T) <= T  # every window is full length
        covered[s : s + context] = True
    assert covered.all()
    if stride == 1:
        assert starts == list(range(max(T - context, 0) + 1))


def test_windows_random():
    a = windows(50, 10, n=200, rng=3)
    assert a == windows(50, 10, n=200, rng=3)  # deterministic per seed
    assert min(a) == 0 and max(a) == 40
    b = windows(50, 10, n=500, full=False, rng=np.random.default_rng(0))
    assert min(b) == 0 and max(b) == 49
    assert windows(3, 10, n=4, rng=0) == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="stride <= context"):
        windows(23, 4, stride=7)  # would leave gaps


def test_encode_windows_cover_episode():
    tok = TrajectoryTokenizer(state_dim=3, action_dim=2, context=4)
    ep = _episode(10)
    segs = tok.encode_windows(ep, key="ep", stride=4)
    assert [s.meta["start"] for s in segs] == [0, 4, 6]
    assert all(len(s) == 12 for s in segs)
    # windows reuse the whole-episode returns-to-go and absolute timesteps
    full_rtg = returns_to_go(ep["rewards"])
    torch.testing.assert_close(segs[2].tokens[0::3, 2], torch.tensor(full_rtg[6:10] / 1000.0, dtype=torch.float32))
    _exact(segs[2].tokens[0::3, 1], [6, 7, 8, 9])


# -- layout ---------------------------------------------------------------------------------------------
def test_layout_discrete_exact():
    tok = TrajectoryTokenizer(state_dim=2, n_actions=3, rtg_scale=10.0, context=5)
    ep = {
        "observations": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]],  # T+1 rows: last dropped
        "actions": np.array([2, 0, 1]),
        "rewards": [1.0, 2.0, 3.0],
    }
    seg = tok.encode(ep, key="d")
    assert seg.modality == "trajectory" and seg.role is Role.CAUSAL
    assert tok.feature_dim == 6 and tok.n_action_outputs == 3 and tok.discrete
    _exact(
        seg.tokens,
        [
            [0, 0, 0.6, 0, 0, 0],
            [1, 0, 0.0, 1, 2, 0],
            [2, 0, 0.0, 0, 0, 2],
            [0, 1, 0.5, 0, 0, 0],
            [1, 1, 0.0, 3, 4, 0],
            [2, 1, 0.0, 0, 0, 0],
            [0, 2, 0.3, 0, 0, 0],
            [1, 2, 0.0, 5, 6, 0],
            [2, 2, 0.0, 0, 0, 1],
        ],
    )
    assert seg.tokens.dtype == torch.float32
    assert torch.equal(seg.positions, torch.arange(9))
    _exact(seg.targets, [[0], [2], [0], [0], [0], [0], [0], [1], [0]])
    assert seg.meta == {"start": 0, "steps": 3}


def test_layout_continuous_exact_with_gamma_timesteps_and_start():
    tok = TrajectoryTokenizer(state_dim=1, action_dim=2, rtg_scale=2.0, gamma=0.5, context=2)
    ep = {
        "observations": [[0.5], [1.5], [2.5]],
        "actions": [[0.1, -0.2], [0.3, 0.4], [0.5, 0.6]],
        "rewards": [2.0, 4.0, 8.0],  # rtg = [2 + 0.5*8, 4 + 0.5*8, 8] = [6, 8, 8]
        "timesteps": np.array([5, 6, 7]),
    }
    seg = tok.encode(ep, key="c", start=1)
    assert tok.feature_dim == 6 and tok.n_action_outputs == 2 and not tok.discrete
    _exact(
        seg.tokens,
        [
            [0, 6, 4.0, 0, 0, 0],
            [1, 6, 0.0, 1.5, 0, 0],
            [2, 6, 0.0, 0, 0.3, 0.4],
            [0, 7, 4.0, 0, 0, 0],
            [1, 7, 0.0, 2.5, 0, 0],
            [2, 7, 0.0, 0, 0.5, 0.6],
        ],
    )
    _exact(seg.targets, [[0, 0], [0.3, 0.4], [0, 0], [0, 0], [0.5, 0.6], [0, 0]])
    # an episode shorter than context is fine; the last window is just shorter
    assert len(tok.encode(ep, key="c", start=2)) == 3
    # precomputed returns-to-go are used as given
    pre = {k: v for k, v in ep.items() if k != "rewards"} | {"returns_to_go": [10.0, 20.0, 30.0]}
    _exact(tok.encode(pre, key="c", start=1).tokens[0::3, 2], [10.0, 15.0])


def test_minari_style_object():
    tok = TrajectoryTokenizer(state_dim=3, n_actions=4)
    ep = _episode(6, n_actions=4)
    obj = types.SimpleNamespace(id=7, observations=ep["observations"], actions=ep["actions"], rewards=ep["rewards"])
    assert torch.equal(tok.encode(obj, key="m").tokens, tok.encode(ep, key="m").tokens)


# -- normalisation and persistence ----------------------------------------------------------------------
def test_fit_normalises_states_to_zero_mean_unit_std():
    tok = TrajectoryTokenizer(state_dim=3, action_dim=2, context=100)
    eps = [_episode(T, seed=i) for i, T in enumerate([5, 17, 40])]
    eps[1]["observations"][:, 1] = 0.0  # will not be constant overall; test the floor separately
    tok.fit(eps)
    states = np.concatenate([e["observations"][:-1] for e in eps])  # the final observation is not fitted
    np.testing.assert_allclose(tok.state_mean, states.mean(0), rtol=1e-12)
    np.testing.assert_allclose(tok.state_std, states.std(0), rtol=1e-12)
    rows = torch.cat([tok.encode(e, key=str(i)).tokens[1::3, 3:6] for i, e in enumerate(eps)]).double()
    torch.testing.assert_close(rows.mean(0), torch.zeros(3, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(rows.std(0, unbiased=False), torch.ones(3, dtype=torch.float64), atol=1e-6, rtol=0)

    const = TrajectoryTokenizer(state_dim=1, n_actions=2).fit(
        [{"observations": np.full((4, 1), 3.0), "actions": np.zeros(4, dtype=np.int64)}]
    )
    assert const.state_std.tolist() == [1e-6] and const.state_mean.tolist() == [3.0]
    with pytest.raises(ValueError, match="no states"):
        TrajectoryTokenizer(state_dim=1, n_actions=2).fit([])


def test_unfitted_is_identity():
    tok = TrajectoryTokenizer(state_dim=3, action_dim=2, context=100)
    ep = _episode(4)
    assert not tok.fitted
    torch.testing.assert_close(
        tok.encode(ep).tokens[1::3, 3:6], torch.tensor(ep["observations"][:-1], dtype=torch.float32), rtol=0, atol=0
    )


def test_save_load_identical_encodings(tmp_path):
    tok = TrajectoryTokenizer(state_dim=3, action_dim=2, rtg_scale=500.0, context=8, action_low=-1.0, action_high=1.0)
    eps = [_episode(T, seed=i) for i, T in enumerate([9, 30])]
    tok.fit(eps)
    tok.save(tmp_path / "traj")
    for loaded in (TrajectoryTokenizer.load(tmp_path / "traj"), Tokenizer.load(tmp_path / "traj")):
        assert isinstance(loaded, TrajectoryTokenizer)
        assert loaded.config() == tok.config()
        for i, e in enumerate(eps):
            a, b = tok.encode(e, key=str(i), start=1), loaded.encode(e, key=str(i), start=1)
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)
    assert get_tokenizer("trajectory") is TrajectoryTokenizer


def test_truncation_warns_only_without_start():
    tok = TrajectoryTokenizer(state_dim=3, action_dim=2, context=4)
    ep = _episode(10)
    with pytest.warns(UserWarning, match="'long-ep'.*truncated"):
        seg = tok.encode(ep, key="long-ep")
    assert len(seg) == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(tok.encode(ep, key="long-ep", start=0)) == 12


# -- device side ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("discrete", [True, False])
def test_embedder_per_kind_columns(discrete):
    torch.manual_seed(0)
    tok = TrajectoryTokenizer(state_dim=3, n_actions=4) if discrete else TrajectoryTokenizer(state_dim=3, action_dim=2)
    ep = _episode(5, n_actions=4 if discrete else None)
    x = tok.encode(ep, key="e").tokens
    emb = tok.embedder(16).eval()
    with torch.no_grad():
        torch.nn.init.normal_(emb.type_embedding.weight)
        base = emb(x)
        assert base.shape == (15, 16)
        cols = {KIND_RETURN: [2], KIND_STATE: [3, 4, 5], KIND_ACTION: list(range(6, tok.feature_dim))}
        for kind, own in cols.items():
            rows = (x[:, 0] == kind).nonzero().flatten()
            other = [c for c in range(2, tok.feature_dim) if c not in own]
            y = x.clone()
            y[rows[:, None], torch.tensor(other)] = 3.0  # junk in foreign columns of this kind's rows
            torch.testing.assert_close(emb(y), base, rtol=0, atol=0)
            z = x.clone()
            # own columns matter, and only for these rows ((id + 1) % n keeps discrete ids valid)
            bumped = z[rows[:, None], torch.tensor(own)] + 1.0
            z[rows[:, None], torch.tensor(own)] = bumped % 4 if discrete and kind == KIND_ACTION else bumped
            changed = (emb(z) - base).abs().amax(-1) > 1e-4
            assert changed.tolist() == [r in rows.tolist() for r in range(15)]
        t = x.clone()
        t[0, 1] += 1.0  # the timestep reaches every token
        assert (emb(t)[0] - base[0]).abs().max() > 1e-4
        # per-token: packing two segments is the concatenation of their embeddings
        x2 = tok.encode(_episode(2, n_actions=4 if discrete else None, seed=1)).tokens
        torch.testing.assert_close(emb(torch.cat([x, x2])), torch.cat([base, emb(x2)]))


def test_embedder_compiles_without_graph_breaks():
    tok = TrajectoryTokenizer(state_dim=3, n_actions=4)
    emb = tok.embedder(8)
    x = tok.encode(_episode(3, n_actions=4)).tokens
    compiled = torch.compile(emb, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), emb(x))


def test_action_target_mask_and_loss():
    tok = TrajectoryTokenizer(state_dim=3, n_actions=4)
    segs = [tok.encode(_episode(T, n_actions=4, seed=T), key=str(T)) for T in (2, 3)]
    x = torch.cat([s.tokens for s in segs])
    y = torch.cat([s.targets for s in segs])
    mask = tok.action_target_mask(x)
    assert mask.dtype == torch.bool and mask.tolist() == [False, True, False] * 5
    logits = torch.randn(15, 4, generator=torch.Generator().manual_seed(0))
    expected = torch.nn.functional.cross_entropy(logits[mask], y[mask, 0].long())
    torch.testing.assert_close(tok.action_loss(logits, x, y), expected)

    ctok = TrajectoryTokenizer(state_dim=3, action_dim=2)
    seg = ctok.encode(_episode(3), key="c")
    pred = torch.zeros(9, 2)
    actions = torch.tensor(_episode(3)["actions"], dtype=torch.float32)
    torch.testing.assert_close(ctok.action_loss(pred, seg.tokens, seg.targets), (actions**2).mean())


def test_decode():
    tok = TrajectoryTokenizer(state_dim=2, n_actions=3)
    out = tok.decode(torch.tensor([[0.1, 2.0, -1.0], [5.0, 0.0, 0.0]]))
    assert out.dtype == torch.int64 and out.tolist() == [1, 0]
    ctok = TrajectoryTokenizer(state_dim=2, action_dim=2, action_low=[-1.0, 0.0], action_high=[1.0, 0.5])
    _exact(ctok.decode(torch.tensor([[2.0, -3.0], [0.25, 0.25]])), [[1.0, 0.0], [0.25, 0.25]])
    _exact(TrajectoryTokenizer(state_dim=2, action_dim=2).decode(np.array([[7.0, -7.0]], np.float32)), [[7.0, -7.0]])
    with pytest.raises(ValueError, match=r"\(\.\.\., 3\)"):
        tok.decode(torch.zeros(2, 2))


@pytest.mark.parametrize("discrete", [True, False])
def test_rollout_helpers_match_offline_encoding(discrete):
    tok = TrajectoryTokenizer(state_dim=3, n_actions=4, context=3) if discrete else TrajectoryTokenizer(
        state_dim=3, action_dim=2, context=3
    )
    tok.fit([_episode(20, n_actions=4 if discrete else None)])
    ep = _episode(6, n_actions=4 if discrete else None, seed=5)
    G = float(np.sum(ep["rewards"]))  # the target return that reproduces the recorded returns-to-go
    for k in range(6):
        seg = tok.encode_rollout(ep["observations"][: k + 1], ep["actions"][:k], ep["rewards"][:k], G, key="r")
        ref = tok.encode(ep, key="r", start=max(k + 1 - 3, 0)).tokens[: 3 * min(k + 1, 3)]
        assert seg.targets is None and seg.meta["predict_index"] == len(seg) - 2
        torch.testing.assert_close(seg.tokens[:-1], ref[:-1], rtol=0, atol=1e-6)
        assert seg.tokens[-1, 0] == KIND_ACTION and not seg.tokens[-1, 6:].any()  # dummy action
        rtg_k = G - float(np.sum(ep["rewards"][:k]))
        step = tok.encode_step(ep["observations"][k], k, return_to_go=rtg_k, key="r")
        torch.testing.assert_close(step, ref[-3:-1], rtol=0, atol=1e-6)
        full = tok.encode_step(ep["observations"][k], k, return_to_go=rtg_k, action=ep["actions"][k], key="r")
        torch.testing.assert_close(full, ref[-3:], rtol=0, atol=1e-6)


# -- errors ---------------------------------------------------------------------------------------------
def _bad(ep: dict, **changes) -> dict:
    out = dict(ep)
    out.update(changes)
    return out


def test_errors_name_the_key():
    c = TrajectoryTokenizer(state_dim=3, action_dim=2, context=4, max_timestep=50)
    d = TrajectoryTokenizer(state_dim=3, n_actions=4, context=4)
    ce, de = _episode(6), _episode(6, n_actions=4)
    nan_obs = ce["observations"].copy()
    nan_obs[2, 1] = np.nan
    inf_obs = ce["observations"].copy()
    inf_obs[0, 0] = np.inf
    cases = [
        (c, _bad(ce, observations=nan_obs), ValueError, "'observations' contains NaN"),
        (c, _bad(ce, observations=inf_obs), ValueError, "'observations' contains NaN or inf"),
        (c, _bad(ce, rewards=np.array([0, 1, np.nan, 0, 0, 0.0])), ValueError, "'rewards' contains NaN"),
        (c, _bad(ce, returns_to_go=np.full(6, np.inf)), ValueError, "'returns_to_go' contains NaN"),
        (c, _bad(ce, actions=np.full((6, 2), np.nan)), ValueError, "'actions' contains NaN"),
        (c, _bad(ce, observations=np.zeros((6, 4))), ValueError, r"'observations' must be \(T, 3\)"),
        (c, _bad(ce, actions=np.zeros((6, 3))), ValueError, r"'actions' must be \(T, 2\)"),
        (c, _bad(ce, observations=np.zeros((8, 3))), ValueError, "expected 6 or 7 observations"),
        (c, _bad(ce, rewards=np.zeros(5)), ValueError, r"'rewards' must be \(6,\)"),
        (c, _bad(ce, timesteps=np.arange(5)), ValueError, r"'timesteps' must be \(6,\)"),
        (c, _bad(ce, timesteps=np.arange(45, 51)), ValueError, r"timesteps must be in \[0, max_timestep=50\)"),
        (c, _bad(ce, timesteps=np.arange(6.0)), TypeError, "'timesteps' must be integers"),
        (c, {"observations": np.zeros((1, 3)), "actions": np.zeros((0, 2)), "rewards": []}, ValueError, "empty"),
        (c, {"observations": ce["observations"], "actions": ce["actions"]}, ValueError, "needs 'rewards'"),
        (c, {"actions": ce["actions"], "rewards": ce["rewards"]}, ValueError, "missing 'observations'"),
        (c, [1, 2, 3], TypeError, "expected an episode dict"),
        (d, _bad(de, actions=de["actions"].astype(np.float32)), TypeError, "must be integer ids"),
        (d, _bad(de, actions=np.array([0, 1, 4, 0, 0, 0])), ValueError, r"ids must be in \[0, 4\)"),
        (d, _bad(de, actions=np.array([0, -1, 0, 0, 0, 0])), ValueError, r"ids must be in \[0, 4\)"),
        (d, _bad(de, actions=np.zeros((6, 2), np.int64)), ValueError, r"must be \(T,\)"),
    ]
    for tok, ep, exc, msg in cases:
        with pytest.raises(exc, match=msg) as info:
            tok.encode(ep, key="sample-42", start=0)
        assert "'sample-42'" in str(info.value), msg
    for start in (6, 99, -1):
        with pytest.raises(ValueError, match=r"'sample-42'.*start=.* outside the episode of 6 steps"):
            c.encode(ce, key="sample-42", start=start)
    long = _episode(60)  # default timesteps run past max_timestep=50
    with pytest.raises(ValueError, match="'long'.*max_timestep=50"):
        c.encode(long, key="long", start=0)


def test_constructor_errors():
    with pytest.raises(ValueError, match="exactly one"):
        TrajectoryTokenizer(state_dim=3, action_dim=2, n_actions=4)
    with pytest.raises(ValueError, match="exactly one"):
        TrajectoryTokenizer(state_dim=3)
    with pytest.raises(ValueError, match="continuous"):
        TrajectoryTokenizer(state_dim=3, n_actions=4, action_low=-1.0)
    with pytest.raises(ValueError, match="state_std must be > 0"):
        TrajectoryTokenizer(state_dim=2, n_actions=4, state_mean=[0, 0], state_std=[1, 0])
    with pytest.raises(ValueError, match="state_mean must have 2 values"):
        TrajectoryTokenizer(state_dim=2, n_actions=4, state_mean=[0, 0, 0], state_std=[1, 1, 1])
    with pytest.raises(ValueError, match="action_low must be <= action_high"):
        TrajectoryTokenizer(state_dim=2, action_dim=1, action_low=1.0, action_high=0.0)
    with pytest.raises(ValueError, match="gamma"):
        TrajectoryTokenizer(state_dim=2, action_dim=1, gamma=0.0)
