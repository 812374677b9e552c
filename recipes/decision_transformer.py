"""Decision Transformer on the shared trunk, with BC and filtered-BC baselines on the same data.

    python recipes/decision_transformer.py                               # no GPU: preset cpu (minutes); GPU: dt
    python recipes/decision_transformer.py --env CartPole-v1             # builds data/gym-CartPole-v1 if missing
    python recipes/decision_transformer.py --env Pendulum-v1 --preset dt-actdrop   # past actions hidden: reads the state
    python recipes/decision_transformer.py --env Pendulum-v1 --preset dt-large
    python recipes/decision_transformer.py --env Hopper-v5               # MuJoCo; behaviour = shipped ARS agents
    python recipes/decision_transformer.py --preset tiny                 # CPU smoke run
    python recipes/decision_transformer.py --data data/my-minari --env Hopper-v5 --set methods=['dt']

For each method (dt: returns-conditioned; bc: same trunk on (state, action) only; fbc: bc on the top 10%
episodes by return) and each training seed it trains, then evaluates with rollouts in the real env
(many envs batched, KV-cached inference): a sweep of target returns (dt), ``eval_seeds`` episodes per
target, normalised score 100 * (R - R_random) / (R_expert - R_random) with the references from the
dataset manifest (``omni data gym`` measures them). Prints a Markdown table and writes
``<out>/results.json`` and ``<out>/returns.png`` (achieved vs target return per method, with the random and
expert references; also in TensorBoard under ``<out>/logs/summary``) and the time split (data / training per method /
rollouts). Each (method, seed) run lives in ``<out>/<method>-seed<k>/``: checkpoints every
``checkpoint_every`` steps (a re-run resumes; ``resume`` says how), TensorBoard logs with the training
curves and the rollout scores (``eval/[target<R>/]score_mean``; rollouts also every ``eval_every`` steps if
set) and that run's return plot (image ``eval/returns``), ``curves.png``, the trained model in ``final/``. --set key=value overrides any config entry (Python literals).
Needs the rl extra: ``pip install -e ".[rl]"`` (gymnasium; mujoco for Hopper-v5 and the other MuJoCo envs).

--set init=PATH starts every run from a model: an omni DT export, or a Hugging Face DecisionTransformerModel
directory (omni.interop). Its architecture replaces this config's trunk (dropout and action_dropout are this
run's) and its tokenizer the one fitted to the data (state normalisation, return scale: what the weights were
trained on; context is this run's). The env must be the model's: other states or actions, a shorter timestep
table or a context past learned positions are refused in one line (a new action space is not a new head:
actions are inputs too). A DT starts methods=['dt'], a bc export bc / fbc.
"""

from __future__ import annotations

import sys

from omni.scripts import without_script_folder

sys.path[:] = without_script_folder(sys.path, __file__)  # first: recipes/whisper.py must not hide openai-whisper

import json
import time
from pathlib import Path
from typing import Any

import torch

from omni.config import FRACTION, NON_EMPTY, POSITIVE, SEED, Check, Key, at_least, one_of, sets_trunk
from omni.recipe_runtime import rank_zero_first, recipe_config, recipe_parser, run_recipe, train_config
from omni.data.remote import dataset_source
from omni.data.shards import read_manifest
from omni.deps import require
from omni.files import write_atomic
from omni.init import DT_BUILDER, init_decision_transformer, init_trajectory_tokenizer, read_init
from omni.rl import (
    DecisionTransformer,
    SpaceSpec,
    WindowLoader,
    action_loss,
    check_causal_attention,
    encode_episodes,
    episode_return,
    evaluate,
    load_episodes,
    make_tokenizer,
    reference_returns,
    summarize_returns,
    top_episodes,
)
from omni.train import Trainer, process_state, unwrap
from omni.trunk import preset

# ---------------------------------------------------------------------------------------------------
# Config. Every entry can be overridden with --set key=value.

COMMON = dict(
    env=Key("CartPole-v1", help="Gymnasium env id (data building and evaluation)"),
    data=Key(None, help="dataset directory (None: data/gym-<env>, built with the settings below if missing)"),
    episodes=Key(1000, check=at_least(1), help="episodes to record when building the data"),
    mix=Key(None, (str, None), help="behaviour policy mix 'POLICY:WEIGHT,...' (None: the env's default)"),
    data_seed=Key(0, check=SEED), out=Key(None, (str, None), help="None: runs/dt-<env>-<preset>"),
    policies=Key(None, (str, None), help="an `omni data train-policy` file for envs without built-in policies"),
    methods=Key(["dt", "bc", "fbc"], check=NON_EMPTY, each=Key(type=str, check=one_of("dt", "bc", "fbc")),
                help="dt: returns-conditioned; bc: (state, action) only; fbc: bc on the top fbc_fraction episodes"),
    fbc_fraction=Key(0.1, check=Check(lambda v: 0 < v <= 1, "in (0, 1]")),
    trunk="dt", trunk_overrides=Key({}, check=sets_trunk(max_positions=("3 x context", lambda c: 3 * c["context"]),
                                                         longest=("3 x context", lambda c: 3 * c["context"]))),
    positions=Key("none", help="official DT: no token positions, a timestep embedding"),
    dropout=0.1, context=Key(20, check=at_least(1), help="steps per training window"),
    rtg_scale=Key(None, (float, None), POSITIVE, "returns-to-go divided by this (None: from the data)"),
    short=Key("pad", check=one_of("pad", "drop", "error"), help="episodes shorter than context"),
    action_dropout=Key(0.0, check=FRACTION, help="hide each past action's value with this probability in "
                                                  "training (0: official DT)"),
    batch_size=64, steps=10_000, lr=1e-4, min_lr_ratio=0.1, warmup_steps=1000, weight_decay=1e-4, clip_norm=0.25,
    # cuda_graph: the whole step as one CUDA graph (the DT is launch-bound: 5-9x the eager step on an H100)
    compile=False, cuda_graph="auto",
    train_seeds=Key([0], check=NON_EMPTY, each=Key(type=int, check=SEED), help="one run per seed"),
    eval_seeds=Key(5, check=at_least(1), help="rollout episodes per target (env seeds 10000..)"),
    target_fractions=Key([1.0, 0.75, 0.5], check=NON_EMPTY, help="target returns as fractions of "
                                                                  "(expert - random) over random"),
    targets=Key(None, (list, None), NON_EMPTY, each=Key(type=float),
                help="explicit target returns (over target_fractions)"),
    eval_cache=Key(True, help="KV-cached rollouts"), eval_every=0, checkpoint_every=1000, log_every=100,
    progress=True, report_to="tensorboard", resume="auto", max_corrupt_fraction=0.01,
    init=Key(None, (str, None), help="start from this model: an omni DT export or a Hugging Face "
                                     "DecisionTransformerModel directory (module docstring)"),
)
PRESETS: dict[str, dict] = {
    # CPU smoke run: a small trunk, a short context, a few hundred steps on a small CartPole set.
    "tiny": dict(episodes=60, trunk="tiny", trunk_overrides=dict(d_model=32, n_layers=2, n_heads=1), context=5,
                 dropout=0.0, batch_size=32, steps=60, lr=1e-3, warmup_steps=5, eval_seeds=2,
                 target_fractions=[1.0], log_every=20, checkpoint_every=30),
    # The default without a GPU (a few minutes on 2 CPU cores): the dt preset's data (1,000 CartPole episodes, the
    # default behaviour mix), a width-64 2-layer trunk with context 10 (CartPole is Markov; the rollouts re-encode
    # the window at every step, so their cost grows with the context), past actions hidden with p = 0.5 (the
    # model reads the state), 2,000 steps, and a 5-target sweep with 30 held-out episodes per target so the
    # return-vs-target curve and the DT-vs-BC gap stand above the episode noise (benchmarks/results.md).
    "cpu": dict(trunk_overrides=dict(d_model=64, n_layers=2, n_heads=2), context=10, dropout=0.0, action_dropout=0.5,
                steps=2000, lr=1e-3, warmup_steps=200, eval_seeds=30, target_fractions=[1.0, 0.75, 0.5, 0.25, 0.0],
                log_every=100, checkpoint_every=500),
    # The official Decision Transformer configuration (3 layers, width 128, 1 head, context 20); the GPU default.
    "dt": dict(),
    # The official trunk trained to read the state rather than copy its past actions: each past action's value
    # hidden with p = 0.5, no residual dropout. On Pendulum-v1's mixed data (H100, 20k steps, 3 training seeds)
    # it scores 99.7 / 99.7 / 99.5 where the official settings score 51 (benchmarks/results.md).
    "dt-actdrop": dict(action_dropout=0.5, dropout=0.0, lr=1e-3, steps=20_000),
    # Larger trunks on the same recipe.
    "dt-large": dict(trunk="dt", trunk_overrides=dict(d_model=256, n_layers=6, n_heads=8), positions="rope",
                     lr=3e-4, batch_size=128),
    "dt-xl": dict(trunk="dt", trunk_overrides=dict(d_model=512, n_layers=8, n_heads=8), positions="rope",
                  lr=2e-4, batch_size=256, steps=20_000),
}


def parse_args(argv=None) -> dict:
    ap = recipe_parser(__doc__, COMMON, PRESETS, "dt on CUDA, cpu otherwise",
                       data_help="dataset directory (manifest.json + episode shards)")
    ap.add_argument("--env", default=None, help="Gymnasium env id for data building and evaluation")
    args = ap.parse_args(argv)
    default = "dt" if torch.cuda.is_available() else "cpu"
    cfg = recipe_config(ap, args, COMMON, PRESETS, default, {"env": args.env} if args.env else {})
    cfg["data"] = cfg["data"] or f"data/gym-{cfg['env']}" + ("-tiny" if cfg["preset"] == "tiny" else "")
    cfg["out"] = cfg["out"] or f"runs/dt-{cfg['env']}-{cfg['preset']}"
    trunk = preset(cfg["trunk"], positions=cfg["positions"], dropout=cfg["dropout"], max_positions=3 * cfg["context"],
                   **cfg["trunk_overrides"])
    check_causal_attention(trunk.attention, trunk.n_layers)  # before data: one line (run_recipe)
    return cfg


# ---------------------------------------------------------------------------------------------------


def load_data(cfg: dict) -> tuple[dict, list[dict]]:
    """(manifest, training episodes) of ``data``, recorded there first when missing."""
    data = dataset_source(cfg["data"])  # a folder, or a URL the shard reader fetches from (omni.data.remote)
    if isinstance(data, Path) and not (data / "manifest.json").is_file():
        from omni.data.builders_rl import build_gym

        print(f"building {cfg['episodes']} {cfg['env']} episodes in {data} ...", flush=True)
        build_gym(data, env=cfg["env"], episodes=cfg["episodes"], mix=cfg["mix"], seed=cfg["data_seed"],
                  policies=cfg["policies"], minari=False, quiet=not cfg["progress"])
    manifest = read_manifest(data, kind="episodes")
    if manifest.get("env_id") and manifest["env_id"] != cfg["env"]:
        raise ValueError(f"{data} holds {manifest['env_id']} episodes but --env is {cfg['env']}")
    return manifest, load_episodes(data, "train", max_corrupt_fraction=cfg["max_corrupt_fraction"])


def use_cuda_graph(cfg: dict, state) -> bool:
    """cfg["cuda_graph"]: True / False, or "auto" (one CUDA process: yes; CPU or several processes: no)."""
    value = cfg["cuda_graph"]  # checked when parsed
    if value == "auto":
        return state.device.type == "cuda" and state.num_processes == 1
    return bool(value)


class Rollouts:
    """The Trainer's model_metrics_fn for one run: the policy's rollouts in the real env (``evaluate``: one row
    per target return, None for bc / fbc), logged as eval/<target>/return_mean, score_mean, ...; the rows of
    the last evaluation are kept in ``rows``. fp32, as the policy is exported."""

    def __init__(self, tok, cfg: dict, targets: list, reference: tuple[float, float], max_steps: int, device,
                 method: str = "dt") -> None:
        self.tok, self.cfg, self.targets, self.reference, self.method = tok, cfg, targets, reference, method
        self.max_steps, self.device = max_steps, device
        self.seeds = list(range(10_000, 10_000 + cfg["eval_seeds"]))  # disjoint from the data's env seeds
        self.rows: list[dict[str, Any]] = []
        self.seconds = 0.0

    def __call__(self, model, step: int) -> dict[str, float]:
        t0 = time.time()
        policy = unwrap(model)
        with torch.autocast(torch.device(self.device).type, enabled=False):
            self.rows = evaluate(policy, self.tok, self.cfg["env"], targets=self.targets if policy.use_returns
                                 else [None], seeds=self.seeds, reference=self.reference, max_steps=self.max_steps,
                                 device=self.device, cache=self.cfg["eval_cache"])
        self.seconds += time.time() - t0
        return {("" if r["target"] is None else f"target{r['target']:g}/") + k: r[k] for r in self.rows
                for k in ("return_mean", "return_std", "score_mean", "score_std")}

    def samples(self, model, step: int) -> list:
        """The Trainer's samples_fn: the return plot of the rollouts this evaluation just ran (TensorBoard)."""
        from omni.plots import Picture, returns_plot

        if not self.rows:
            return []
        rows = [{"method": self.method, **r} for r in self.rows]
        return [Picture("eval/returns", returns_plot(rows, self.reference,
                                                     title=f"{self.cfg['env']}: {self.method}, step {step}"))]


def train_one(cfg: dict, tok, episodes: list[dict], method: str, seed: int, device: torch.device,
              rollouts: Rollouts | None = None, source=None):
    """Train one method with one seed in <out>/<method>-seed<seed> (checkpoints, TensorBoard logs, the export;
    a re-run resumes), evaluated with ``rollouts`` through the Trainer (None: no evaluation); ``source``: the
    model to start from (``omni.init.read_init``)."""
    use_returns = method == "dt"
    data = encode_episodes(tok, episodes, short=cfg["short"]).to(device)
    state = process_state()  # each rank takes its own slice of the windows (accelerate launch)
    loader = WindowLoader(data, cfg["batch_size"], context=cfg["context"], use_returns=use_returns, seed=seed,
                          rank=state.process_index, world_size=state.num_processes)
    trunk = preset(cfg["trunk"], positions=cfg["positions"], dropout=cfg["dropout"],
                   max_positions=3 * cfg["context"], **cfg["trunk_overrides"])
    torch.manual_seed(seed)
    kept: dict[str, Any] = {}
    if source is not None:  # its architecture replaces this config's trunk
        model, kept = init_decision_transformer(source, cfg["init"], tok, cfg["dropout"], cfg["action_dropout"],
                                                use_returns)
        trunk = model.trunk_config
    else:
        model = DecisionTransformer(tok, trunk, use_returns=use_returns, action_dropout=cfg["action_dropout"])

    def loss_fn(model, batch):
        tokens, targets = batch
        return action_loss(model, tok, tokens, targets)

    config = train_config(cfg, output_dir=str(Path(cfg["out"]) / f"{method}-seed{seed}"), seed=seed,
                          warmup_steps=min(cfg["warmup_steps"], cfg["steps"]), cuda_graph=use_cuda_graph(cfg, state),
                          run_name=f"{method}-{seed}")
    export = {"builder": DT_BUILDER, "trunk": trunk.to_dict(), "use_returns": use_returns,
              "env_id": cfg["env"], "method": method, **kept}
    hparams = {k: v for k, v in cfg.items() if k not in ("methods", "train_seeds")}  # this run's: resume checks them
    trainer = Trainer(model, loss_fn, loader, config, model_metrics_fn=rollouts,
                      samples_fn=rollouts.samples if rollouts is not None else None, hparams=hparams,
                      export_config=export, export_tokenizers={"trajectory": tok})
    t0 = time.time()
    metrics = trainer.fit()
    metrics["train_seconds"] = time.time() - t0 - (rollouts.seconds if rollouts else 0.0)
    metrics["windows"] = loader.num_windows
    model = unwrap(trainer.model)
    if rollouts is not None and not rollouts.rows:  # a re-run of a finished run: fit evaluated nothing
        rollouts(model, trainer.step)
    return model, metrics


def markdown(rows: list[dict]) -> str:
    lines = ["| method | target | return (mean ± std) | normalised score (mean ± std) | episodes |",
             "|---|---|---|---|---|"]
    for r in rows:
        tgt = "-" if r["target"] is None else f"{r['target']:.1f}"
        lines.append(f"| {r['method']} | {tgt} | {r['return_mean']:.1f} ± {r['return_std']:.1f} | "
                     f"{r['score_mean']:.1f} ± {r['score_std']:.1f} | {r['episodes']} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    gym = require("gymnasium")
    state = process_state()
    device = state.device
    t_start = time.time()
    manifest, episodes = rank_zero_first(lambda: load_data(cfg), state.process_index, state.num_processes)
    data_seconds = time.time() - t_start
    spaces = SpaceSpec.from_manifest(manifest)
    limit = gym.spec(cfg["env"]).max_episode_steps or max(len(ep["actions"]) for ep in episodes)
    ref, ref_source = reference_returns(manifest, episodes)
    tok = make_tokenizer(episodes, spaces, context=cfg["context"], rtg_scale=cfg["rtg_scale"],
                         max_timestep=max(limit, max(len(ep["actions"]) for ep in episodes)) + 1)
    targets = cfg["targets"] or [ref[0] + f * (ref[1] - ref[0]) for f in cfg["target_fractions"]]
    source = None
    if cfg["init"]:  # the model's tokenizer (its normalisation) replaces the one fitted to the data
        source = read_init(cfg["init"], DT_BUILDER, "recipes/decision_transformer.py", "an omni Decision Transformer "
                           "export or a Hugging Face DecisionTransformerModel directory")
        tok = init_trajectory_tokenizer(source, cfg["init"], tok, cfg["context"])
    print(f"{cfg['env']}: {len(episodes)} episodes, returns {min(map(episode_return, episodes)):.1f}.."
          f"{max(map(episode_return, episodes)):.1f}; reference random {ref[0]:.1f} / expert {ref[1]:.1f} "
          f"({ref_source}); {device}", flush=True)
    results: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for method in cfg["methods"]:
        data = top_episodes(episodes, cfg["fbc_fraction"]) if method == "fbc" else episodes
        for seed in cfg["train_seeds"]:
            rollouts = Rollouts(tok, cfg, targets, ref, limit, device, method)
            _, metrics = train_one(cfg, tok, data, method, seed, device, rollouts, source)
            rows = rollouts.rows
            runs.append({"method": method, "seed": seed, "episodes": len(data), "eval_seconds": rollouts.seconds,
                         **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}, "rows": rows})
            if state.is_main_process:  # one line per target as each run finishes (the table comes at the end)
                for r in rows:
                    tgt = "-" if r["target"] is None else f"{r['target']:.1f}"
                    print(f"{method} seed {seed} target {tgt}: return {r['return_mean']:.1f} ± {r['return_std']:.1f}, "
                          f"normalised {r['score_mean']:.1f} ({metrics['train_seconds']:.0f} s training)", flush=True)
    # One table row per (method, target): episodes of every training seed pooled.
    for method in cfg["methods"]:
        mine = [r for r in runs if r["method"] == method]
        for j, row in enumerate(mine[0]["rows"]):
            rets = [v for run in mine for v in run["rows"][j]["returns"]]
            results.append({"method": method, "target": row["target"], **summarize_returns(rets, ref)})
    table = markdown(results)
    seconds = time_split(data_seconds, runs, time.time() - t_start)
    payload = {"env": cfg["env"], "reference": {"random": ref[0], "expert": ref[1], "source": ref_source},
               "config": cfg, "results": results, "runs": runs, "table": table, "seconds": seconds}
    if state.is_main_process:  # every rank evaluated the same episodes (seeded); one writes
        print(table, flush=True)
        print(f"references: random policy {ref[0]:.1f}, expert {ref[1]:.1f} (normalised 0 and 100)", flush=True)
        print("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()), flush=True)
        out = Path(cfg["out"])
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "results.json", json.dumps(payload, indent=2, default=str))
        write_returns_plot(cfg, results, ref, out)
    return payload


def time_split(data_seconds: float, runs: list[dict], total: float) -> dict[str, float]:
    """Wall seconds of the run by part: data (build or load), training per method (all seeds), rollouts."""
    split = {"data": data_seconds}
    for run in runs:
        split[f"training {run['method']}"] = split.get(f"training {run['method']}", 0.0) + run["train_seconds"]
    split["rollouts"] = sum(run["eval_seconds"] for run in runs)
    split["total"] = total
    return split


def write_returns_plot(cfg: dict, results: list[dict], ref: tuple[float, float], out: Path) -> Path | None:
    """``<out>/returns.png``: achieved vs target return of every method, and the same picture in TensorBoard
    (``<out>/logs/summary``, tag ``returns``). Without matplotlib: one warning line, no picture."""
    from omni.evaluation import drawn, log_items
    from omni.plots import Picture, returns_plot

    path = out / "returns.png"
    rgb = drawn("the return plot", lambda: returns_plot(
        results, ref, path, title=f"{cfg['env']}: achieved vs target return ({len(cfg['train_seeds'])} seed(s), "
                                  f"{cfg['eval_seeds']} episodes each)"), prog="decision_transformer.py")
    if rgb is None:
        return None
    if cfg["report_to"] == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out / "logs" / "summary"))
        try:
            log_items(writer, [Picture("returns", rgb)], cfg["steps"])
        finally:
            writer.close()
    return path


if __name__ == "__main__":
    run_recipe(main)
