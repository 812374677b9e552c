"""One-line messages that name the real cause, and the interop parity cases of issue #29: a config.json that is not
JSON, `--from timm` on a Hugging Face directory, `init=` a run or checkpoint directory, `omni generate --head` a
head that is no text LM head, `omni predict` on a multitask export (class names, or indices named as such) and on a
backbone export (no classifier), GPT-2 in bf16 back in bf16. CPU, tiny models."""

from __future__ import annotations

import json

import pytest
import torch

from _interop import cli_error

from omni.cli import main as omni_main
from conftest import load_recipe

transformers = pytest.importorskip("transformers")
from transformers import ViTConfig, ViTModel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=16,
             patch_size=8)


def hf_backbone(path, seed: int = 0):
    torch.manual_seed(seed)
    ViTModel(ViTConfig(**SMALL)).save_pretrained(path)
    return path


@pytest.mark.parametrize("peer", [None, "hf", "timm"])
def test_a_config_json_that_is_not_json_says_so(tmp_path, capsys, peer):
    src = hf_backbone(tmp_path / "hf")
    (src / "config.json").write_text('{"model_type": "vit",\n "hidden_size": 32,,}')
    err = cli_error(["convert", str(src), str(tmp_path / "out"), *(["--from", peer] if peer else [])], capsys)
    assert f"{src / 'config.json'} is not JSON: Expecting property name enclosed in double quotes: line 2 column " \
           "20 (char 41)" in err, err
    (src / "config.json").write_text("[1, 2]")
    assert f"{src / 'config.json'} is not a JSON object (it holds a list)" in cli_error(
        ["convert", str(src), str(tmp_path / "out"), *(["--from", peer] if peer else [])], capsys)
    assert not (tmp_path / "out").exists()


def test_from_timm_on_a_hugging_face_directory_says_what_it_is(tmp_path, capsys):
    src = hf_backbone(tmp_path / "hf")
    err = cli_error(["convert", str(src), str(tmp_path / "out"), "--from", "timm"], capsys)
    assert err.endswith(f"{src / 'config.json'} is a Hugging Face config (model_type 'vit'), not timm's: convert it "
                        "with --from hf"), err
    (src / "config.json").write_text(json.dumps({"hidden_size": 32}))
    err = cli_error(["convert", str(src), str(tmp_path / "out"), "--from", "timm"], capsys)
    assert 'names no timm "architecture": --from timm reads a timm hub directory' in err, err
    assert "unknown" not in err and "None" not in err


# ----------------------------------------------------------------------------------------------------
# init= a run directory or one of its checkpoints: resolved as `omni predict` resolves them


def tiny_classifier_export(path, n_classes: int = 3, class_names=None):
    from omni.export import save_pretrained
    from omni.tokenizers.image import ImageTokenizer
    from omni.trunk import TrunkConfig
    from omni.vision import ImageClassifier

    image = ImageTokenizer(8, channels=1, image_size=16, policy="resize")
    torch.manual_seed(0)
    model = ImageClassifier(image, TrunkConfig(d_model=16, n_layers=1, n_heads=2), n_classes)
    torch.nn.init.normal_(model.head.proj.weight)
    return save_pretrained(model, path, model.export_config(class_names), tokenizers={"image": image})


def test_init_a_run_directory_is_its_export_and_a_checkpoint_names_it(tmp_path, capsys):
    from omni.init import read_init
    from omni.vision import BUILDER

    export = tiny_classifier_export(tmp_path / "run" / "final")
    step = tmp_path / "run" / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    config, state, tokenizers = read_init(tmp_path / "run", BUILDER, "recipes/vit.py", "an image classifier")
    assert config["builder"] == BUILDER and set(tokenizers) == {"image"}
    from safetensors.torch import load_file

    assert all(torch.equal(state[k], v) for k, v in load_file(str(export / "model.safetensors")).items())
    assert f"init {tmp_path / 'run'}: using the export {export} of the run directory" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"^init: .*step-2 is a training checkpoint \(optimizer, RNG and data state "
                                         rf"for resuming\), not an export; its export is {export}$"):
        read_init(step, BUILDER, "recipes/vit.py", "an image classifier")
    (tmp_path / "unfinished" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"is a run directory; the run .*unfinished has no export yet"):
        read_init(tmp_path / "unfinished", BUILDER, "recipes/vit.py", "an image classifier")
    (tmp_path / "other").mkdir()  # any other folder: the converters' message, as before
    with pytest.raises(ValueError, match="not a checkpoint any converter recognises"):
        read_init(tmp_path / "other", BUILDER, "recipes/vit.py", "an image classifier")


# ----------------------------------------------------------------------------------------------------
# omni generate --head: only a text LM head generates


@pytest.fixture(scope="module")
def lm_and_asr(tmp_path_factory):
    """A multitask export with an LM task "text" and a transcribe task "asr" with a CTC head ("asr_ctc"): three
    "lm" heads, one of which continues text."""
    from omni.export import save_pretrained
    from omni.multitask import LMTask, MultitaskModel, TranscribeTask, merge_tokenizers
    from omni.tokenizers.audio import AudioTokenizer
    from omni.tokenizers.text import TextTokenizer
    from omni.trunk import preset

    text = TextTokenizer()
    clip = torch.randn(8000, generator=torch.Generator().manual_seed(0)) * 0.1
    tasks = [LMTask("text", text, ["a short text to model"]),
             TranscribeTask("asr", AudioTokenizer(), text, [clip], ["hello"], ctc_weight=0.3)]
    torch.manual_seed(0)
    model = MultitaskModel(tasks, preset("tiny", positions="rope")).eval()
    return save_pretrained(model.omni, tmp_path_factory.mktemp("mm") / "final", model.export_config(),
                           tokenizers=merge_tokenizers(tasks))


def test_generate_head_must_be_a_text_lm_head(lm_and_asr, capsys):
    export = lm_and_asr
    config = json.loads((export / "config.json").read_text())
    assert {n: h["type"] for n, h in config["heads"].items()} == {"text": "lm", "asr": "lm", "asr_ctc": "lm"}
    base = ["generate", "--checkpoint", str(export), "--max-new-tokens", "2"]
    err = cli_error([*base, "--head", "asr_ctc", "hi"], capsys, prog="omni generate")
    assert err.endswith("--head asr_ctc: the CTC head of the transcribe task 'asr' (audio frames -> characters), "
                        f"which does not generate text; the text LM heads of {export}: text"), err
    err = cli_error([*base, "--head", "asr", "hi"], capsys, prog="omni generate")
    assert "--head asr: the head of the transcribe task 'asr', which does not generate text" in err, err
    err = cli_error([*base, "--head", "nope", "hi"], capsys, prog="omni generate")
    assert "--head nope: no head of that name" in err, err
    # no --head: the one text LM head (it was "several LM heads (text, asr, asr_ctc)")
    assert omni_main([*base, "--format", "json", "hi"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and len(rows[0]["ids"]) == 2
    assert omni_main([*base, "--head", "text", "--format", "json", "hi"]) == 0
    assert json.loads(capsys.readouterr().out) == rows


# ----------------------------------------------------------------------------------------------------
# omni predict: the classes of a multitask export; a backbone has none


def test_predict_names_a_multitask_exports_classes(tmp_path, capsys):
    """A classify task given class names records them in the export (config.json tasks.<name>.class_names) and
    `omni predict` prints them; without names it prints "class <index>"."""
    import numpy as np
    from PIL import Image

    from omni.export import save_pretrained
    from omni.multitask import ClassifyTask, MultitaskModel, merge_tokenizers
    from omni.tokenizers.image import ImageTokenizer
    from omni.trunk import preset

    image = ImageTokenizer(patch_size=7, channels=1, image_size=28, policy="resize")
    path = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8)).save(path)
    with pytest.raises(ValueError, match="task 'image': 2 class names for 3 classes"):
        ClassifyTask("image", image, [np.zeros((28, 28), np.uint8)], [0], 3, class_names=["ant", "bee"])
    tops = {}
    for names in (["ant", "bee", "cat"], None):
        task = ClassifyTask("image", image, [np.zeros((28, 28), np.uint8)], [0], 3, class_names=names)
        torch.manual_seed(0)
        model = MultitaskModel([task], preset("tiny", positions="rope2d")).eval()
        torch.nn.init.normal_(model.omni.heads["image"].proj.weight, std=1.0)
        export = save_pretrained(model.omni, tmp_path / f"mm-{bool(names)}", model.export_config(),
                                 tokenizers=merge_tokenizers([task]))
        assert json.loads((export / "config.json").read_text())["tasks"]["image"].get("class_names") == names
        assert omni_main(["predict", "--checkpoint", str(export), "--device", "cpu", "--format", "json",
                          str(path)]) == 0
        tops[bool(names)] = [g["label"] for g in json.loads(capsys.readouterr().out)[0]["top_k"]]
    index = [int(label.removeprefix("class ")) for label in tops[False]]
    assert sorted(index) == [0, 1, 2] and tops[True] == [["ant", "bee", "cat"][i] for i in index]


def test_predict_on_a_backbone_export_says_it_has_no_classifier(tmp_path, capsys):
    import warnings

    from omni.interop import convert

    with warnings.catch_warnings():  # a 0-class head once warned "Initializing zero-element tensors is a no-op"
        warnings.simplefilter("error")
        export = convert(hf_backbone(tmp_path / "hf"), tmp_path / "omni")
    from PIL import Image

    Image.new("RGB", (16, 16)).save(tmp_path / "a.png")
    err = cli_error(["predict", "--checkpoint", str(export), "--device", "cpu", str(tmp_path / "a.png")], capsys,
                    prog="omni predict")
    assert err.endswith(f"{export}: this export has no classifier head (a backbone, 0 classes): fine-tune it on "
                        "labelled images first (recipes/vit.py --set init=...)"), err


# ----------------------------------------------------------------------------------------------------
# GPT-2: the source dtype goes back; generate fills the position table


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_gpt2_goes_back_to_hf_in_its_own_dtype(tmp_path, dtype):
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    from omni.interop import convert, to_peer

    torch.manual_seed(0)
    peer = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=16, n_embd=32, n_layer=1, n_head=2)).to(dtype)
    peer.save_pretrained(tmp_path / "hf")
    export = convert(tmp_path / "hf", tmp_path / "omni")
    recorded = json.loads((export / "config.json").read_text())["source"]
    assert recorded.get("dtype") == (None if dtype == torch.float32 else str(dtype).removeprefix("torch."))
    back = to_peer(export, tmp_path / "back", "hf")
    original, again = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "hf", back))
    assert {v.dtype for v in again.values()} == {dtype}  # bf16 came back as float32 before
    assert set(again) <= set(original) and all(torch.equal(again[k], original[k]) for k in again)
    source, written = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", back))
    assert written.get("dtype") == source.get("dtype")


def test_a_hf_vit_goes_back_in_its_own_dtype(tmp_path):
    from safetensors.torch import load_file

    from omni.interop import convert, to_peer

    torch.manual_seed(0)
    ViTModel(ViTConfig(**SMALL)).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    back = to_peer(convert(tmp_path / "hf", tmp_path / "omni"), tmp_path / "back", "hf")
    original, again = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "hf", back))
    assert set(again) == set(original) and all(torch.equal(again[k], v) for k, v in original.items())
    assert {v.dtype for v in again.values()} == {torch.bfloat16}


# ----------------------------------------------------------------------------------------------------
# Checkpoints of a tied LM head: no "Removed shared tensor" warning; another shared tensor still warns


def test_a_tied_lm_head_checkpoints_without_the_shared_tensor_warning(tmp_path, caplog):
    import logging

    from accelerate import Accelerator

    from omni.multitask import LMTask, MultitaskModel
    from omni.tokenizers.text import TextTokenizer
    from omni.trunk import preset

    torch.manual_seed(0)
    model = MultitaskModel([LMTask("text", TextTokenizer(), ["hello there"])], preset("tiny"))
    acc = Accelerator(cpu=True)
    prepared = acc.prepare(model)
    with caplog.at_level(logging.WARNING):
        acc.save_state(str(tmp_path / "ckpt"))
    assert "Removed shared tensor" not in caplog.text
    table = model.omni.embedders["text"].token.weight
    saved = table.detach().clone()
    with torch.no_grad():
        table.zero_()
    acc.load_state(str(tmp_path / "ckpt"))  # the head is the table again, with the saved values
    head = acc.unwrap_model(prepared).omni.heads["text"].proj.weight
    assert head is table and torch.equal(head, saved)

    class Shared(torch.nn.Module):  # a shared tensor that is no MultitaskModel's tie: Accelerate's warning stays
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
            self.b.weight = self.a.weight

    other = Accelerator(cpu=True)
    other.prepare(Shared())
    with caplog.at_level(logging.WARNING):
        other.save_state(str(tmp_path / "other"))
    assert "Removed shared tensor {'b.weight'} while saving" in caplog.text


def test_the_multimodal_recipes_image_task_records_fashion_mnists_class_names(fashion_mnist_env, tmp_path):
    from omni.data.builders_vision import FASHION_MNIST_CLASSES
    from omni.multitask import MultitaskModel
    from omni.trunk import preset

    recipe = load_recipe("multimodal", "multimodal_recipe")
    cfg = recipe.parse_args(["--preset", "tiny", "--set", f"cache={str(tmp_path)!r}", "only='image'"])
    tasks = recipe.build_tasks(cfg)
    model = MultitaskModel(tasks["train"], preset("tiny", positions="rope2d"))
    assert model.export_config()["tasks"]["image"]["class_names"] == list(FASHION_MNIST_CLASSES)
