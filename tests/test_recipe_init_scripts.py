"""Every README command that fine-tunes with ``--set init=`` runs AS A SCRIPT, the way a user types it: ``python
recipes/whisper.py`` puts recipes/ first on sys.path, where the recipe file hid the real openai-whisper package
(Whisper's and GPT-2's vocabularies) and the Whisper and GPT-2 fine-tunes stopped with a false "openai-whisper is
not installed". Tiny random checkpoints made here stand in for the README's (tests/test_whisper_finetune.py,
tests/test_lm_recipe.py and tests/test_interop_hf_vit.py check what the runs compute)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")
pytest.importorskip("whisper", reason="Whisper's vocabulary ships in openai-whisper (pip install -e '.[interop]')")

# recipe -> the init= kinds this file runs as a script (each README command's checkpoint kind is among them)
COVERED = {"vit": ("hf-vit",), "lm": ("hf-gpt2",), "whisper": ("hf-whisper",)}


def readme_init_commands() -> list[tuple[str, str]]:
    """(recipe, init value) of every README command line that runs a recipe with --set init=."""
    found = []
    for line in (ROOT / "README.md").read_text().splitlines():
        recipe = re.search(r"recipes/(\w+)\.py", line)
        init = re.search(r"--set init=(\S+)", line)
        if recipe and init and not line.lstrip().startswith(("|", "**")):
            found.append((recipe.group(1), init.group(1)))
    return found


def test_every_readme_init_command_is_run_here():
    commands = readme_init_commands()
    assert {r for r, _ in commands} >= {"vit", "lm"}, commands  # the parse still finds the README's commands
    assert {r for r, _ in commands} <= set(COVERED), f"a README init= command no test runs as a script: {commands}"


def run_script(recipe: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONSAFEPATH", None)  # Python's default, as for a user: the script's folder first on sys.path
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not installed" not in proc.stderr
    return proc


@pytest.fixture(scope="module")
def libri(tmp_path_factory) -> Path:
    """4 train + 2 test LibriSpeech-layout utterances as shards (tests/_librispeech.py)."""
    pytest.importorskip("soundfile")
    from omni.data.builders_speech import build_librispeech
    from tests._librispeech import write_tree

    tmp = tmp_path_factory.mktemp("libri-script")
    write_tree(tmp / "LibriSpeech", {"train-clean-5": (19, 26)}, utterances=2)
    write_tree(tmp / "LibriSpeech", {"dev-clean-2": (84,)}, utterances=2)
    build_librispeech(tmp / "shards", src=tmp / "LibriSpeech", quiet=True,
                      rename={"train-clean-5": "train", "dev-clean-2": "test"})
    return tmp / "shards"


def hf_whisper(folder: Path) -> Path:
    """A random HF Whisper of width 64 (2 + 2 layers, the real vocabulary) as a hub directory. (An openai .pt or
    an omni export as init give the same model: tests/test_whisper_finetune.py; sys.path is the same for all.)"""
    torch.manual_seed(0)
    config = transformers.WhisperConfig(vocab_size=51865, num_mel_bins=80, d_model=64, encoder_layers=2,
                                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                        encoder_ffn_dim=256, decoder_ffn_dim=256, max_source_positions=1500,
                                        max_target_positions=448)
    transformers.WhisperForConditionalGeneration(config).save_pretrained(folder / "whisper-small")
    return folder / "whisper-small"


def test_whisper_finetune_as_a_script(libri, tmp_path):
    """README: recipes/whisper.py --preset finetune --data shards/librispeech --set init=whisper-small/ (here the
    tiny preset, one step)."""
    init = hf_whisper(tmp_path)
    proc = run_script("whisper", tmp_path, "--preset", "tiny", "--data", str(libri), "--out", str(tmp_path / "run"),
                      "--set", f"init={str(init)!r}", "text_case='sentence'", "steps=1", "batch_size=2",
                      "eval_batch_size=2", "max_new_tokens=2", "progress=False")
    assert "test WER" in proc.stdout and (tmp_path / "run" / "final" / "config.json").is_file()
    assert "vocab 51865" in proc.stdout  # the init's (Whisper's) vocabulary, read from openai-whisper's files


def test_gpt2_finetune_as_a_script(tmp_path):
    """README: recipes/lm.py --set init=hf-gpt2/ --set "text=['my.txt']" --out runs/gpt2-tuned."""
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=32,
                                                              n_layer=1, n_head=2))
    hf.save_pretrained(tmp_path / "hf-gpt2")
    text = tmp_path / "my.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: it was a truth universally acknowledged." for i in range(40)))
    proc = run_script("lm", tmp_path, "--preset", "tiny", "--out", str(tmp_path / "run"), "--set",
                      f"init={str(tmp_path / 'hf-gpt2')!r}", f"text={[str(text)]!r}", "steps=1", "progress=False",
                      "report_to='none'")
    assert "held out" in proc.stdout and (tmp_path / "run" / "final" / "config.json").is_file()


def test_vit_finetune_from_hf_as_a_script(tiny_corpora, tmp_path):
    """README: recipes/vit.py --preset B/16 --data shards/mine --set init=hf-vit-b16/ (here the tiny preset on
    conftest's Fashion-MNIST stand-in, one step, from an RGB 28-pixel HF ViT)."""
    from omni.data.builders_vision import build_fashion_mnist

    build_fashion_mnist(tmp_path / "shards", source=tiny_corpora.fashion_mnist, quiet=True)
    config = transformers.ViTConfig(image_size=28, patch_size=7, num_channels=3, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=64, num_labels=10)
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path / "hf-vit")
    proc = run_script("vit", tmp_path, "--preset", "tiny", "--data", str(tmp_path / "shards"), "--out",
                      str(tmp_path / "run"), "--set", f"init={str(tmp_path / 'hf-vit')!r}", "steps=1",
                      "progress=False", "workers=0", "limit_eval=64")
    assert "test accuracy" in proc.stdout and (tmp_path / "run" / "final" / "config.json").is_file()


def test_no_recipe_hides_a_package(tmp_path, monkeypatch):
    """Each recipe, run as a script, takes its own folder off sys.path before its other imports: a module next to
    it (recipes/whisper.py) is never found in place of a package of that name."""
    from omni.scripts import without_script_folder

    recipes = ROOT / "recipes"
    script = str(recipes / "whisper.py")
    assert without_script_folder([str(recipes), str(recipes) + "/", "/x"], script) == ["/x"]
    monkeypatch.chdir(tmp_path)
    assert without_script_folder(["", "/x"], script) == ["", "/x"]  # "" is the current directory: another one
    monkeypatch.chdir(recipes)
    assert without_script_folder(["", "/x"], script) == ["/x"]  # `cd recipes; python whisper.py`
    for recipe in sorted(recipes.glob("*.py")):
        text = recipe.read_text()
        first = text.find("sys.path[:] = without_script_folder(sys.path, __file__)")
        assert first > 0, f"{recipe.name} does not take its folder off sys.path"
        others = [m.start() for m in re.finditer(r"(?m)^(import (?!sys$)|from (?!__future__|omni\.scripts ))", text)]
        assert min(others) > first, f"{recipe.name} imports something before taking its folder off sys.path"
