"""omni.heads and the common model API: heads on tensors, pooling by segment ids, the head registry (spec out,
same head back, through tasks and the export), the one action loss, and forward == forward_head(forward_features)
on every model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni.export import build_omni_model, load_pretrained, save_pretrained
from omni.heads import (HEADS, ActionHead, ClassificationHead, Head, LMHead, build_head, masked_action_loss,
                        packed_segments, pool_segments, register_head)
from omni.model import OmniModel
from omni.packing import Packer
from omni.segment import Sample
from omni.tokenizers.image import ImageTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.tokenizers.trajectory import TrajectoryTokenizer
from omni.trunk import TrunkConfig, preset

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

TRUNK = TrunkConfig(d_model=32, n_layers=1, n_heads=4, max_positions=64)


def randn(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_pool_segments_by_ids_equals_rows_and_each_segment(mode):
    rows = randn(3, 5, 8)  # 3 segments of 5 tokens
    ids = torch.arange(3).repeat_interleave(5)
    torch.testing.assert_close(pool_segments(rows.reshape(15, 8), mode, ids, 3), pool_segments(rows, mode))
    x, ids = randn(9, 8), torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2])  # uneven segments, in packing order
    want = [x[ids == s].mean(0) if mode == "mean" else x[ids == s][0] for s in range(3)]
    torch.testing.assert_close(pool_segments(x, mode, ids, 3), torch.stack(want))


def packed_images(n: int = 3) -> tuple[OmniModel, object, Tensor]:
    tok = ImageTokenizer(patch_size=4, channels=1)
    torch.manual_seed(0)
    model = OmniModel({"image": tok}, TRUNK, heads={"cls": ClassificationHead(32, 4)}).eval()
    nn.init.normal_(model.heads["cls"].proj.weight)  # zero-initialised: logits would be trivially equal
    images = [torch.rand(1, 4 * (i + 1), 8, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    batch = Packer()([Sample([tok.encode(im, key=str(i))], key=str(i)) for i, im in enumerate(images)])
    with torch.no_grad():
        return model, batch, model.forward_features(batch)


def test_classification_head_reads_tensors_and_the_model_reads_packed_batches():
    model, batch, hidden = packed_images()
    head = model.heads["cls"]
    tokens, ids, n = packed_segments(hidden, batch, "image")
    with torch.no_grad():
        by_model = model.forward_head(hidden, batch, "cls", "image")
        assert by_model.shape == (3, 4)
        torch.testing.assert_close(head(tokens, ids, n), by_model)
        for s in range(n):  # each image alone, as one row of a uniform batch
            torch.testing.assert_close(head(tokens[ids == s][None])[0], by_model[s])


def test_token_heads_give_one_row_per_token():
    model, batch, hidden = packed_images(2)
    model.heads["act"] = ActionHead(32, 3, discrete=False)
    out = model.forward_head(hidden, batch, "act", "image")
    assert out.shape == (batch.tokens["image"].shape[0], 3) and out.abs().max() <= 1
    torch.testing.assert_close(out, model.heads["act"](OmniModel.gather(hidden, batch, "image")))


SPECS = [{"type": "classification", "n_classes": 3, "pool": "cls"},
         {"type": "lm", "vocab_size": TextTokenizer().vocab_size, "tie_to": "text"},
         {"type": "lm", "vocab_size": 257},
         {"type": "action", "n_outputs": 2, "discrete": True}]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s['type']}-{'tied' if 'tie_to' in s else len(s)}")
def test_each_head_gives_the_spec_it_is_rebuilt_from(spec):
    model = OmniModel({"text": TextTokenizer()}, TRUNK)
    head = build_head(spec, 32, model.embedders)
    assert isinstance(head, Head) and head.spec() == spec
    again = build_head(head.spec(), 32, model.embedders)
    assert type(again) is type(head) and again.spec() == spec
    if "tie_to" in spec:
        assert head.proj.weight is model.embedders["text"].token.weight


def test_action_head_squash_in_its_spec():
    """The default (tanh) spec is as it always was; squash=None is recorded and rebuilds a plain Linear."""
    tanh = ActionHead(8, 2, discrete=False)
    assert tanh.spec() == {"type": "action", "n_outputs": 2, "discrete": False}
    plain = build_head({"type": "action", "n_outputs": 2, "discrete": False, "squash": None}, 8)
    assert plain.squash is None and plain.spec() == {"type": "action", "n_outputs": 2, "discrete": False,
                                                     "squash": None}
    assert build_head(plain.spec(), 8).spec() == plain.spec()
    x = randn(5, 8) * 100
    with torch.no_grad():
        torch.testing.assert_close(plain(x), plain.proj(x), rtol=0, atol=0)
        assert plain(x).abs().max() > 1
    with pytest.raises(ValueError, match="head 'a': squash must be 'tanh' or None"):
        build_head({"type": "action", "n_outputs": 2, "discrete": False, "squash": "sigmoid"}, 8, name="a")


def test_spec_defaults_and_errors():
    assert build_head({"type": "classification", "n_classes": 3}, 8).spec()["pool"] == "mean"
    with pytest.raises(ValueError, match="head 'x' has type 'conv'; expected one of classification, lm, action"):
        build_head({"type": "conv"}, 8, name="x")
    with pytest.raises(ValueError, match="head 'lm': the LM head ties to 'text', which is not one of the model's"):
        build_head({"type": "lm", "vocab_size": 5, "tie_to": "text"}, 8, {}, name="lm")
    with pytest.raises(ValueError, match="head 'c': pool must be 'mean' or 'cls'"):
        build_head({"type": "classification", "n_classes": 3, "pool": "max"}, 8, name="c")
    with pytest.raises(ValueError, match="spec cannot name"):  # tied by hand to a table it cannot name
        LMHead(8, 5, tie_to=nn.Embedding(5, 8)).spec()


@pytest.fixture
def scale_head():
    @register_head("test_scale")
    class ScaleHead(Head):
        def __init__(self, d_model: int, factor: float) -> None:
            super().__init__()
            self.factor = factor
            self.proj = nn.Linear(d_model, 1)

        def options(self):
            return {"factor": self.factor}

        def forward(self, x: Tensor) -> Tensor:
            return self.factor * self.proj(x)

    yield ScaleHead
    del HEADS["test_scale"]


def test_a_registered_head_type_exports_and_loads(scale_head, tmp_path):
    tok = ImageTokenizer(patch_size=4, channels=1)
    torch.manual_seed(0)
    model = OmniModel({"image": tok}, TRUNK, heads={"s": scale_head(32, 2.0), "cls": ClassificationHead(32, 4)})
    config = model.export_config()
    assert config["heads"] == {"s": {"type": "test_scale", "factor": 2.0},
                               "cls": {"type": "classification", "n_classes": 4, "pool": "mean"}}
    save_pretrained(model, tmp_path / "m", config, tokenizers={"image": tok})
    loaded = load_pretrained(tmp_path / "m")
    assert isinstance(loaded.heads["s"], scale_head) and loaded.export_config() == config
    _, batch, _ = packed_images(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_head(loaded(batch), batch, "s", "image"),
                                   model.eval().forward_head(model(batch), batch, "s", "image"))
    with pytest.raises(ValueError, match="already registered by"):
        register_head("test_scale")(type("Other", (Head,), {}))
    assert build_omni_model({"trunk": TRUNK.to_dict(), "heads": config["heads"]}, {"image": tok}).heads["s"].factor == 2


@pytest.mark.parametrize("discrete", [True, False])
def test_masked_action_loss_is_the_tokenizers_and_the_decision_transformers(discrete):
    from omni.rl import DecisionTransformer, action_loss

    tok = TrajectoryTokenizer(3, n_actions=4, context=3) if discrete else \
        TrajectoryTokenizer(3, action_dim=2, context=3, action_low=-1, action_high=1)
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 4, 5) if discrete else rng.uniform(-1, 1, (5, 2))
    seg = tok.encode({"observations": rng.normal(size=(5, 3)), "actions": actions, "rewards": np.ones(5)},
                     start=1)
    x, y = seg.tokens, seg.targets
    torch.manual_seed(0)
    model = DecisionTransformer(tok, preset("tiny", n_layers=1)).eval()
    with torch.no_grad():
        pred = model(x[None])[0]
        loss, metrics = masked_action_loss(pred, y, tok.action_target_mask(x), discrete)
        state = x[:, 0] == 1  # the rows that carry a_t
        want = F.cross_entropy(pred[state], y[state, 0].long()) if discrete else F.mse_loss(pred[state], y[state])
        torch.testing.assert_close(loss, want)
        assert set(metrics) == ({"accuracy"} if discrete else set())
        torch.testing.assert_close(tok.action_loss(pred, x, y), loss)
        by_dt, by_dt_metrics = action_loss(model, tok, x[None], y[None])
        torch.testing.assert_close(by_dt, loss)
        assert by_dt_metrics.keys() == metrics.keys()


def test_every_model_is_its_head_on_its_features():
    """forward(x) == forward_head(forward_features(x), ...) on each model that wraps the trunk."""
    from omni.rl import DecisionTransformer
    from omni.speech import SpeechRecognizer
    from omni.tokenizers.audio import AudioTokenizer
    from omni.vision import ImageClassifier

    torch.manual_seed(0)
    tiny = preset("tiny", n_layers=1)
    image = ImageClassifier(ImageTokenizer(patch_size=4, channels=3, cls=True), TRUNK, 5, pool="cls").eval()
    images = torch.rand(2, 3, 8, 12)
    audio, text = AudioTokenizer(), TextTokenizer()
    asr = SpeechRecognizer(audio, text, tiny, preset("tiny", n_layers=1, cross_attention=True)).eval()
    frames, mask, ids = randn(2, 10, audio.n_mels * audio.kernel), torch.ones(2, 10, dtype=torch.bool), \
        torch.randint(0, 300, (2, 4))
    traj = TrajectoryTokenizer(3, action_dim=2, context=3, action_low=-2, action_high=1)
    dt = DecisionTransformer(traj, tiny).eval()
    steps = torch.zeros(2, 6, traj.feature_dim)
    with torch.no_grad():
        assert image.forward_features(images).shape == (2, 1 + 6, 32)
        torch.testing.assert_close(image(images), image.forward_head(image.forward_features(images)))
        hidden = asr.forward_features(frames, mask, ids)
        assert hidden.shape == (2, 4, tiny.d_model)
        torch.testing.assert_close(asr(frames, mask, ids), asr.forward_head(hidden))
        torch.testing.assert_close(dt(steps), dt.forward_head(dt.forward_features(steps)))
        model, batch, hidden = packed_images(2)
        torch.testing.assert_close(model(batch), hidden)


def test_tasks_give_specs_the_model_builds_and_exports():
    from omni.multitask import ClassifyTask, LMTask, MultitaskModel, pack_mixed

    image, text = ImageTokenizer(patch_size=4, channels=1), TextTokenizer()
    tasks = [ClassifyTask("img", image, [torch.rand(1, 8, 8) for _ in range(2)], [0, 1], 2, pool="cls"),
             LMTask("text", text, ["A few words.", "More words here."])]
    torch.manual_seed(0)
    model = MultitaskModel(tasks, TRUNK)
    specs = {name: spec for t in tasks for name, spec in t.head_specs().items()}
    assert model.export_config()["heads"] == specs == {n: h.spec() for n, h in model.omni.heads.items()}
    rng = np.random.default_rng(0)
    batch = pack_mixed([t.sample(0, rng) for t in tasks], [0, 1], ["img", "text"])
    with torch.no_grad():
        loss, metrics = model(batch)
        again, again_metrics = model.forward_head(model.forward_features(batch), batch)
    torch.testing.assert_close(loss, again)
    assert metrics.keys() == again_metrics.keys()
