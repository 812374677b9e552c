"""Decision Transformer and behaviour cloning on the shared trunk, with rollout evaluation.

    episodes = load_episodes("data/gym-CartPole-v1")              # shards from `omni data gym`
    tok = make_tokenizer(episodes, env_spaces, context=20)        # state stats, rtg scale, timesteps
    data = encode_episodes(tok, episodes)                         # every step once, as token rows
    loader = WindowLoader(data, batch_size=64, use_returns=True)  # (tokens, targets) windows
    model = DecisionTransformer(tok, preset("dt", positions="none"))
    loss, metrics = dt_loss(model, next(iter(loader)))
    rows = evaluate(model, tok, "CartPole-v1", targets=[500, 250], seeds=range(5), reference=(22.0, 500.0))

Model. trajectory tokens (omni.tokenizers.trajectory) -> embedder -> causal Trunk -> ActionHead read
at every state token (a_t is predicted from s_t). ``use_returns=False`` is the behaviour-cloning
baseline: the same trunk fed (s_t, a_t) pairs only, the return-to-go rows dropped. Filtered BC is BC on
the top 10% of episodes by return (``top_episodes``). Continuous actions: tanh head (or, with
``action_squash=None``, a plain Linear) rescaled to the action bounds, MSE loss; discrete: logits, cross-entropy.

Training windows. An episode's steps are encoded once (``encode_episodes``) into a (steps, 3, F) tensor;
a training sample is a window of ``context`` consecutive steps, gathered on the device per batch
(``WindowLoader``: TensorLoader over window starts, so seeded, rank-split, resumable). Every window
starting in [0, T - context] is one sample per epoch (plus the start-0 window of an episode shorter
than the context). Windows are RIGHT-padded to ``context`` steps with rows of kind ``KIND_PAD``: under
causal attention no real token ever sees a later pad, so every batch uses the plain "causal" mask (the
SDPA flash/cuDNN path) and the pads only need to leave the loss, which ``action_target_mask`` (kind ==
state) already does. Short episodes are padded (``short="pad"``), or rejected / dropped.

Rollouts (``rollout``). Many envs are stepped together (one gymnasium env per row, lockstep in time; a
finished env is frozen and ignored) and the policy runs batched. With ``cache=True`` the KV cache
serves the growing window: step t appends [a_{t-1}, R_t, s_t] (one forward of 3 tokens) and reads a_t at
s_t. Once the window is full (t >= context) it slides, and then every hidden state depends on the
window's first step, so no cache can be reused exactly: the cache is reset and refilled with the last
context-1 steps + [R_t, s_t] in one batched forward (what the official DT computes every step). A
"rolling" cache would silently change the policy (old entries would have attended to steps outside the
window), so it is not offered. ``cache=False`` re-encodes each env's whole running context with the
tokenizer's own ``encode_rollout`` every step: the reference the tests compare against (equal actions,
equal head outputs to 1e-5, for episodes longer than the context). A trunk with attention patterns (``--set
trunk_overrides.attention={'kind': 'window', 'before': 30, 'after': 0}``) gets a RingKVCache: its windowed layers
keep only their window, so a context of hundreds of steps costs a fixed cache; with a context that holds the whole
episode the rollout never refills (benchmarks/long_dt.py; equal to re-encoding: tests/test_long_dt.py). A window
that reaches no earlier token (before=0) is refused (``check_causal_attention``).

Scores: ``normalized_score`` = 100 * (R - R_random) / (R_expert - R_random), mean +- std over episodes
(std with ddof=1), per target return.

Modules: ``episodes`` (shard IO, returns, spaces, the fitted tokenizer), ``windows`` (encoded steps, training
windows), ``model`` (DecisionTransformer, its builder and loss), ``rollout`` (batched env stepping, the target
sweep), ``scores`` (normalised score, reference returns). Everything is importable from ``omni.rl``; the export
builder name ``omni.rl:build_decision_transformer`` stays valid.
"""

from omni.rl.episodes import SpaceSpec, episode_return, load_episodes, make_tokenizer, top_episodes
from omni.rl.model import (CarriedTensors, DecisionTransformer, action_bounds, action_loss, build_decision_transformer,
                           check_causal_attention, rescale_actions)
from omni.rl.rollout import RolloutResult, check_env, evaluate, make_envs, rollout
from omni.rl.scores import normalized_score, reference_returns, summarize_returns
from omni.rl.windows import KIND_PAD, EpisodeData, WindowLoader, encode_episodes, gather_windows

__all__ = ["CarriedTensors", "DecisionTransformer", "EpisodeData", "KIND_PAD", "RolloutResult", "SpaceSpec",
           "WindowLoader", "action_bounds", "action_loss", "build_decision_transformer", "check_causal_attention",
           "check_env", "encode_episodes", "episode_return", "evaluate", "gather_windows", "load_episodes",
           "make_envs", "make_tokenizer", "normalized_score", "reference_returns", "rescale_actions", "rollout",
           "summarize_returns", "top_episodes"]
