"""``--set init=PATH`` (omni.init) on the recipes that had none: a run started from a tiny export resumes from its
weights (its first training loss, or its first evaluation, is the source model's), and what does not fit the run
is refused in one line naming PATH. recipes/vit.py's init: tests/test_interop_timm.py, test_interop_hf_vit.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from omni.export import load_pretrained, save_pretrained
from omni.model import OmniModel
from omni.tokenizers.image import ImageTokenizer
from omni.trunk import TrunkConfig
from conftest import load_recipe

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def load(name: str):
    return load_recipe(name, f"{name}_recipe_init")


# ----------------------------------------------------------------------------------------------------
# recipes/decision_transformer.py


@pytest.fixture(scope="module")
def cartpole(tmp_path_factory):
    """A 10-episode CartPole set and a DT trained on it for 20 steps (its export)."""
    pytest.importorskip("gymnasium")
    from omni.data.builders_rl import build_gym

    root = tmp_path_factory.mktemp("dt-init")
    build_gym(root / "data", env="CartPole-v1", episodes=10, mix="expert:0.5,medium:0.3,random:0.2", seed=0,
              reference_episodes=2, minari=False, quiet=True)
    load("decision_transformer").main(dt_args(root / "data", root / "source", "steps=20"))
    return root / "data", root / "source" / "dt-seed0" / "final"


def dt_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--preset", "tiny", "--data", str(data), "--out", str(out), "--set", "progress=False", "methods=['dt']",
            "eval_seeds=2", "target_fractions=[1.0]", "report_to='none'", *extra]


def test_decision_transformer_resumes_from_an_export(cartpole, tmp_path):
    """The first training loss of a run from the export is the export's loss on that batch; its rollouts score
    as the source's did; the tuned export keeps the source's tokenizer."""
    from omni.export import load_tokenizers
    from omni.rl import WindowLoader, action_loss, encode_episodes

    data, export = cartpole
    recipe = load("decision_transformer")
    cfg = recipe.parse_args(dt_args(data, tmp_path / "run", f"init={str(export)!r}", "steps=1", "lr=1e-12"))
    _, episodes = recipe.load_data(cfg)
    source, tok = load_pretrained(export).train(), load_tokenizers(export)["trajectory"]
    loader = WindowLoader(encode_episodes(tok, episodes, short=cfg["short"]), cfg["batch_size"],
                          context=cfg["context"], use_returns=True, seed=0)  # train_one's loader for seed 0
    with torch.no_grad():
        expected = action_loss(source, tok, *next(iter(loader)))[0].item()
    out = recipe.main(dt_args(data, tmp_path / "run", f"init={str(export)!r}", "steps=1", "lr=1e-12"))
    assert out["runs"][0]["train/loss"] == pytest.approx(expected, abs=1e-5)
    again = recipe.main(dt_args(data, tmp_path / "again", "steps=1", "lr=1e-12"))  # no init: a fresh model
    assert again["runs"][0]["train/loss"] != pytest.approx(expected, abs=1e-3)
    tuned = tmp_path / "run" / "dt-seed0" / "final"
    assert load_tokenizers(tuned)["trajectory"].config() == tok.config()


def test_decision_transformer_refuses_what_does_not_fit(cartpole, tmp_path):
    """Another env's model (HF's continuous-action DT), a bc method from a DT, another kind of model: one line each."""
    pytest.importorskip("transformers")
    from transformers import DecisionTransformerConfig, DecisionTransformerModel

    data, export = cartpole
    recipe = load("decision_transformer")
    hf = tmp_path / "hf-dt"
    DecisionTransformerModel(DecisionTransformerConfig(state_dim=4, act_dim=1, hidden_size=32, n_layer=1,
                                                       n_head=1, max_ep_len=600)).save_pretrained(hf)
    with pytest.raises(ValueError, match=r"^init .*hf-dt: the model takes 4 state values and Box\(1,\) actions, the "
                                         r"env 4 and Discrete\(2\): start from a model of this env$"):
        recipe.main(dt_args(data, tmp_path / "a", f"init={str(hf)!r}", "steps=1"))
    with pytest.raises(ValueError, match="a returns-conditioned DT cannot start this method; set methods=.'dt'."):
        recipe.main(dt_args(data, tmp_path / "b", f"init={str(export)!r}", "steps=1", "methods=['bc']"))
    image = ImageTokenizer(4, image_size=8, policy="resize", cls=True, positions="sequence")
    from omni.vision import ImageClassifier

    vit = ImageClassifier(image, TrunkConfig(d_model=16, n_layers=1, n_heads=2, positions="learned_1d",
                                             max_positions=5), 3, pool="cls")
    save_pretrained(vit, tmp_path / "vit", vit.export_config(), tokenizers={"image": image})
    with pytest.raises(ValueError, match="a 'omni.vision:build_image_classifier' model; "
                                         "recipes/decision_transformer.py starts from an omni Decision Transformer"):
        recipe.main(dt_args(data, tmp_path / "c", f"init={str(tmp_path / 'vit')!r}", "steps=1"))


# ----------------------------------------------------------------------------------------------------
# recipes/multimodal.py


@pytest.fixture(scope="module")
def image_run(fashion_mnist_env, tmp_path_factory):
    """The tiny preset's image task alone, 3 steps: its export and final held-out loss."""
    root = tmp_path_factory.mktemp("mm-init")
    shutil.copytree(fashion_mnist_env.text, root / "cache" / "corpus")
    metrics = load("multimodal").main(mm_args(root, root / "source", "steps=3"))
    return root, root / "source" / "final", metrics


def mm_args(root: Path, out: Path, *extra: str) -> list[str]:
    corpus = [str(p) for p in sorted((root / "cache" / "corpus").glob("*.txt"))]
    return ["--preset", "tiny", "--out", str(out), "--set", f"cache={str(root / 'cache')!r}", f"text={corpus!r}",
            "progress=False", "only='image'", "eval_batches=2", "eval_tasks=False", "report_to='none'",
            "tasks.image.limit_train=256", *extra]


def test_multimodal_resumes_from_an_export(image_run, tmp_path):
    """The first evaluation of a run from the export is the export's (a fresh model's is not); the model the
    recipe builds holds the export's trunk."""
    root, export, source_metrics = image_run
    recipe = load("multimodal")
    metrics = recipe.main(mm_args(root, tmp_path / "run", f"init={str(export)!r}", "steps=1", "lr=1e-12"))
    assert metrics["eval/loss"] == pytest.approx(source_metrics["eval/loss"], abs=1e-5)
    fresh = recipe.main(mm_args(root, tmp_path / "fresh", "steps=1", "lr=1e-12"))
    assert fresh["eval/loss"] != pytest.approx(source_metrics["eval/loss"], abs=1e-3)
    model, *_ = recipe.build(recipe.parse_args(mm_args(root, tmp_path / "x", f"init={str(export)!r}")))
    source = load_pretrained(export)
    assert torch.equal(model.omni.trunk.blocks[0].attn.qkv.weight, source.trunk.blocks[0].attn.qkv.weight)


def test_multimodal_refuses_a_text_lm_and_other_tokenizers(image_run, tmp_path):
    root, export, _ = image_run
    recipe = load("multimodal")
    image = ImageTokenizer(4, channels=1, image_size=28, policy="resize")
    lm = OmniModel({"image": image}, TrunkConfig(d_model=16, n_layers=1, n_heads=2, positions="learned_1d",
                                                 max_positions=64))
    save_pretrained(lm, tmp_path / "lm", lm.export_config(), tokenizers={"image": image})
    with pytest.raises(ValueError, match="its learned 1-D position table indexes one token sequence and cannot start "
                                         "the multimodal trunk .* start from a recipes/multimodal.py export"):
        recipe.main(mm_args(root, tmp_path / "a", f"init={str(tmp_path / 'lm')!r}", "steps=1"))
    with pytest.raises(ValueError, match=r"its image tokenizer differs from this run's in patch_size"):
        recipe.main(mm_args(root, tmp_path / "b", f"init={str(export)!r}", "steps=1", "tasks.image.patch=4"))
