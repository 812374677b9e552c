"""`omni predict` / `omni transcribe` (omni/cli.py) on tiny random-weight exports: bad options stop at argument
parsing in one line (status 2); good files are reported and each bad one (missing, corrupt, directory, FIFO,
device) is named with its reason (status 1, or 2 when none could be read); --format json; --version; a wrong
kind of export names its builder and the command that fits; the multitask export answers both commands; a
run directory resolves to its export; a damaged export is one line naming the file, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import threading
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from omni.cli import main
from omni.export import save_pretrained
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.image import ImageTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.trunk import preset
from _speech_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SR = 16000
CLASSES = ["zero", "one", "two", "three"]


def image_tokenizer() -> ImageTokenizer:
    return ImageTokenizer(patch_size=7, channels=1, image_size=28, policy="resize")


@pytest.fixture(scope="module")
def vit(tmp_path_factory) -> Path:
    """An ImageClassifier export (recipes/vit.py's builder) with random weights that tell images apart."""
    from omni.vision import ImageClassifier

    tok, trunk = image_tokenizer(), preset("tiny")
    torch.manual_seed(0)
    model = ImageClassifier(tok, trunk, len(CLASSES))
    torch.nn.init.normal_(model.head.proj.weight, std=1.0)  # the zero-init head gives uniform probabilities
    return save_pretrained(model, tmp_path_factory.mktemp("vit") / "final",
                           {"builder": "omni.vision:build_image_classifier", "trunk": trunk.to_dict(),
                            "n_classes": len(CLASSES), "pool": "mean", "class_names": CLASSES},
                           tokenizers={"image": tok})


@pytest.fixture(scope="module")
def whisper(tmp_path_factory) -> Path:
    """A SpeechRecognizer export (recipes/whisper.py's builder) with random weights."""
    audio, text = AudioTokenizer(), TextTokenizer()
    return save_pretrained(tiny_model(audio, text, seed=1), tmp_path_factory.mktemp("asr") / "final",
                           {"builder": "omni.speech:build_speech_recognizer", "encoder": preset("tiny").to_dict(),
                            "decoder": preset("tiny", cross_attention=True).to_dict()},
                           tokenizers={"audio": audio, "text": text})


@pytest.fixture(scope="module")
def multitask(tmp_path_factory):
    """recipes/multimodal.py's export kind (builder "omni"): an image classify task and a prefix-LM transcribe
    task on one trunk, random weights; (export, model, image task, asr task)."""
    from omni.multitask import ClassifyTask, MultitaskModel, TranscribeTask, merge_tokenizers

    image = ClassifyTask("image", image_tokenizer(), [np.zeros((28, 28), np.uint8)], [0], len(CLASSES))
    asr = TranscribeTask("asr", AudioTokenizer(), TextTokenizer(), [noise(0.5)], ["hello"])
    torch.manual_seed(0)
    model = MultitaskModel([image, asr], preset("tiny", positions="rope2d")).eval()
    torch.nn.init.normal_(model.omni.heads["image"].proj.weight, std=1.0)
    export = save_pretrained(model.omni, tmp_path_factory.mktemp("mm") / "final", model.export_config(),
                             tokenizers=merge_tokenizers([image, asr]))
    return export, model, image, asr


def noise(seconds: float, seed: int = 0) -> torch.Tensor:
    return torch.randn(int(SR * seconds), generator=torch.Generator().manual_seed(seed)) * 0.1


def png(path: Path, seed: int = 0) -> Path:
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (28, 28), dtype=np.uint8)).save(path)
    return path


def wav(path: Path, wave: torch.Tensor) -> Path:
    sf.write(path, wave.numpy(), SR, subtype="FLOAT")  # float WAV: the decoded samples are exactly these
    return path


def special_files(tmp_path: Path) -> dict[str, str]:
    """Paths that are no regular file -> the words the CLI must say about them."""
    folder = tmp_path / "folder.in"
    folder.mkdir()
    fifo = tmp_path / "pipe.in"
    os.mkfifo(fifo)
    return {str(tmp_path / "missing.in"): "no such", str(folder): "is a directory",
            str(fifo): "is a FIFO", os.devnull: "is a character device"}


def cli(argv: list[str], capsys, seconds: float = 120.0) -> tuple[int, str, str]:
    """(status, stdout, stderr) of `omni argv`. Run in a thread: a regression that blocks on a FIFO fails the
    test instead of hanging it (opening and closing the FIFO's writer end lets a blocked open() return)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["status"] = main(argv)
        except BaseException as exc:  # noqa: BLE001 (raised again in the test's thread)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for arg in argv:
            if Path(arg).is_fifo():
                os.close(os.open(arg, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(seconds)
        pytest.fail(f"omni {' '.join(argv)} did not finish in {seconds} s")
    out, err = capsys.readouterr()
    if "error" in box:
        raise box["error"]
    assert "Traceback" not in err, err
    return box["status"], out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# ----------------------------------------------------------------------------------------------------


def test_version(capsys):
    assert cli(["--version"], capsys)[:2] == (0, f"omni {version('omni')}\n")


@pytest.mark.parametrize("argv, words", [
    (["transcribe", "--batch-size", "-1"], "argument --batch-size: must be >= 1, got -1"),
    (["transcribe", "--batch-size", "0"], "argument --batch-size: must be >= 1"),
    (["transcribe", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1"),
    (["transcribe", "--beam-size", "0"], "argument --beam-size: must be >= 1"),
    (["transcribe", "--beam-size", "two"], "argument --beam-size: invalid int value: 'two'"),
    (["transcribe", "--length-penalty", "nan"], "argument --length-penalty: must be a finite number"),
    (["transcribe", "--length-penalty", "inf"], "argument --length-penalty: must be a finite number"),
    (["predict", "--top-k", "0"], "argument --top-k: must be >= 1, got 0"),
    (["predict", "--top-k", "-3"], "argument --top-k: must be >= 1"),
    (["predict", "--device", "gpu0"], "argument --device: unknown device 'gpu0'"),
    (["transcribe", "--device", "cuda:banana"], "argument --device: unknown device"),
    (["predict", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
])
def test_bad_options_stop_at_parsing_in_one_line(argv, words, tmp_path, capsys):
    """Before any export is read (the checkpoint does not even exist): one line naming the option, status 2."""
    command, *options = argv
    status, out, err = cli([command, "--checkpoint", str(tmp_path / "nowhere"), *options, "x.wav"], capsys)
    assert status == 2 and out == ""
    line = one_line(err)
    assert line.startswith(f"omni {command}: error: ") and words in line and "nowhere" not in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_a_gpu_stops_at_parsing(tmp_path, capsys):
    status, out, err = cli(["predict", "--checkpoint", str(tmp_path), "--device", "cuda", "x.png"], capsys)
    assert status == 2 and "argument --device: 'cuda': no CUDA GPU is available" in one_line(err)


def test_predict_reports_good_files_and_names_bad_ones(vit, tmp_path, capsys):
    good = [png(tmp_path / "a.png", 0), png(tmp_path / "b.png", 1)]
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good[0].read_bytes()[:60])
    unreadable = "cannot read as an image: could not decode"
    bad = {**special_files(tmp_path), str(corrupt): unreadable, str(truncated): unreadable}
    files = [str(good[0]), *bad, str(good[1])]
    status, out, err = cli(["predict", "--checkpoint", str(vit), "--device", "cpu", "--top-k", "2", *files], capsys)
    assert status == 1
    lines = out.splitlines()
    assert [line.split(": ")[0] for line in lines] == [str(g) for g in good]
    for line in lines:
        top = line.split(": ", 1)[1].split(", ")
        assert len(top) == 2 and all(t.rsplit(" ", 1)[0] in CLASSES for t in top)
    errs = err.splitlines()
    assert len(errs) == len(bad) + 1 and errs[-1] == f"omni predict: {len(bad)} of {len(files)} files failed"
    for line, (path, words) in zip(errs, bad.items()):
        assert line.startswith(f"omni predict: {path}: ") and words in line, line

    status, _, err = cli(["predict", "--checkpoint", str(vit), "--device", "cpu", *bad], capsys)
    assert status == 2 and err.splitlines()[-1] == f"omni predict: {len(bad)} of {len(bad)} files failed"


def test_predict_json(vit, tmp_path, capsys):
    files = [str(png(tmp_path / "a.png")), str(tmp_path / "missing.png")]
    status, out, err = cli(["predict", "--checkpoint", str(vit), "--device", "cpu", "--format", "json", *files],
                           capsys)
    assert status == 1
    rows = json.loads(out)
    assert rows[1] == {"file": files[1], "error": "no such image file"}
    assert rows[0]["file"] == files[0] and set(rows[0]) == {"file", "top_k"}
    top = rows[0]["top_k"]
    assert len(top) == len(CLASSES) and {t["label"] for t in top} == set(CLASSES)  # --top-k 5 > 4 classes
    probs = [t["probability"] for t in top]
    assert probs == sorted(probs, reverse=True) and abs(sum(probs) - 1) < 1e-5 and probs[0] > probs[-1]
    _, txt, _ = cli(["predict", "--checkpoint", str(vit), "--device", "cpu", files[0]], capsys)
    assert txt == f"{files[0]}: " + ", ".join(f"{t['label']} {t['probability']:.3f}" for t in top) + "\n"


def test_transcribe_reports_good_files_and_names_bad_ones(whisper, tmp_path, capsys):
    from omni.pipelines.transcribe import transcribe_files

    good = [wav(tmp_path / "a.wav", noise(0.6, 1)), wav(tmp_path / "b.wav", noise(0.4, 2))]
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    garbage = tmp_path / "garbage.mp3"
    garbage.write_bytes(b"this is not audio at all" * 10)
    silent = wav(tmp_path / "silent.wav", torch.zeros(SR // 2))
    bad = {**special_files(tmp_path), str(empty): "empty", str(garbage): "cannot decode", str(silent): "silent"}
    files = [str(good[0]), *bad, str(good[1])]
    options = ["--checkpoint", str(whisper), "--device", "cpu", "--max-new-tokens", "4", "--batch-size", "1"]
    status, out, err = cli(["transcribe", *options, "--format", "json", *files], capsys)
    assert status == 1
    rows = json.loads(out)
    assert [r["file"] for r in rows] == files
    expected = transcribe_files(whisper, good, device="cpu", max_new_tokens=4)
    assert [{k: r[k] for k in ("file", "text")} for r in rows if "error" not in r] == \
        [{"file": str(g), "text": t} for g, t in zip(good, expected)]  # rows also hold segments (test_timestamps.py)
    errs = err.splitlines()
    assert errs[-1] == f"omni transcribe: {len(bad)} of {len(files)} files failed"
    for row, line, (path, words) in zip(rows[1:-1], errs, bad.items()):
        assert row["file"] == path and words in row["error"] and line == f"omni transcribe: {path}: {row['error']}"

    status, out, _ = cli(["transcribe", *options, *map(str, good)], capsys)
    assert status == 0 and out == "".join(f"{g}: {t}\n" for g, t in zip(good, expected))


def test_wrong_kind_of_export_names_its_builder_and_the_command(vit, whisper, tmp_path, capsys):
    image, clip = str(png(tmp_path / "a.png")), str(wav(tmp_path / "a.wav", noise(0.3)))
    status, _, err = cli(["predict", "--checkpoint", str(whisper), image], capsys)
    line = one_line(err)
    assert status == 2 and "'omni.speech:build_speech_recognizer'" in line and "use `omni transcribe`" in line
    status, _, err = cli(["transcribe", "--checkpoint", str(vit), clip], capsys)
    line = one_line(err)
    assert status == 2 and "'omni.vision:build_image_classifier'" in line and "use `omni predict`" in line
    dt = tmp_path / "dt"
    dt.mkdir()
    (dt / "config.json").write_text(json.dumps({"omni_format": 1, "builder": "omni.rl:build_decision_transformer"}))
    for command, file in (("predict", image), ("transcribe", clip)):
        status, _, err = cli([command, "--checkpoint", str(dt), file], capsys)
        line = one_line(err)
        assert status == 2 and "decision transformer" in line and "none of `omni predict`, `omni transcribe`, `omni generate` reads it" in line
    speech_only = tmp_path / "mm"
    speech_only.mkdir()
    (speech_only / "config.json").write_text(json.dumps({
        "omni_format": 1, "builder": "omni", "tokenizers": ["audio", "text"],
        "heads": {"asr": {"type": "lm", "vocab_size": 300}}, "tasks": {"asr": {"kind": "transcribe"}}}))
    status, _, err = cli(["predict", "--checkpoint", str(speech_only), image], capsys)
    line = one_line(err)
    assert status == 2 and "multitask export" in line and "asr (transcribe)" in line and "use `omni transcribe`" in line


def test_multitask_export_predicts_and_transcribes(multitask, tmp_path, capsys):
    """The image task's head and the prefix-LM transcriber of recipes/multimodal.py's export, through the CLI,
    give what the tasks themselves compute on the same inputs."""
    from omni.multitask import TranscribeTask, pack_mixed
    from omni.segment import Sample

    export, model, image, asr = multitask
    path = png(tmp_path / "a.png", 3)
    status, out, _ = cli(["predict", "--checkpoint", str(export), "--device", "cpu", "--format", "json", str(path)],
                         capsys)
    assert status == 0
    got = json.loads(out)[0]["top_k"]
    seg = image.tokenizer.encode(str(path))
    batch = pack_mixed([Sample([seg], key="a.png")], [0], ("image",))
    with torch.no_grad():
        probs = model.omni.forward_head(model.omni(batch), batch, "image", "image")[0].softmax(-1)
    top = probs.topk(len(CLASSES))
    # no class names recorded: the indices, named as such
    assert [g["label"] for g in got] == [f"class {i}" for i in top.indices.tolist()]
    assert np.allclose([g["probability"] for g in got], top.values.tolist(), atol=1e-6)

    clip = noise(0.7, 5)
    status, out, _ = cli(["transcribe", "--checkpoint", str(export), "--device", "cpu", "--format", "json",
                          "--max-new-tokens", "6", str(wav(tmp_path / "a.wav", clip))], capsys)
    assert status == 0
    alone = TranscribeTask("asr", asr.audio, asr.text, [clip], [""])
    assert json.loads(out)[0]["text"] == alone.transcribe(model.omni, max_new_tokens=6)[0]
    status, beam, _ = cli(["transcribe", "--checkpoint", str(export), "--device", "cpu", "--beam-size", "2",
                           "--max-new-tokens", "6", str(tmp_path / "a.wav")], capsys)
    assert status == 0 and beam.startswith(f"{tmp_path / 'a.wav'}: ")


def test_run_directory_resolves_to_its_export(vit, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(vit, run / "final")
    step = run / "checkpoints" / "step-000100"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    image = str(png(tmp_path / "a.png"))
    status, out, err = cli(["predict", "--checkpoint", str(run), "--device", "cpu", image], capsys)
    assert status == 0 and out.startswith(f"{image}: ")
    assert one_line(err) == f"omni predict: using the export {run / 'final'} of the run directory {run}"
    status, out, err = cli(["predict", "--checkpoint", str(step), image], capsys)
    line = one_line(err)
    assert status == 2 and out == "" and "training checkpoint" in line and str(run / "final") in line
    shutil.rmtree(run / "final")
    status, _, err = cli(["predict", "--checkpoint", str(run), image], capsys)
    assert status == 2 and str(run / "final") in one_line(err)


@pytest.mark.parametrize("damage", ["model.safetensors", "config.json", "weights that do not fit"])
def test_damaged_export_is_one_line_naming_the_file(vit, damage, tmp_path, capsys):
    export = shutil.copytree(vit, tmp_path / "final")
    if damage == "weights that do not fit":  # its config edited (1 layer, not 2) and checksummed again
        from omni.export import write_checksums

        config = json.loads((export / "config.json").read_text())
        config["trunk"]["n_layers"] = 1
        (export / "config.json").write_text(json.dumps(config))
        write_checksums(export)  # so the weights' shapes, not a checksum, are what is refused
        target = export / "model.safetensors"
    else:
        target = export / damage
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    status, out, err = cli(["predict", "--checkpoint", str(export), "--device", "cpu", str(png(tmp_path / "a.png"))],
                           capsys)
    assert status == 2 and out == ""
    line = one_line(err)
    assert line.startswith("omni predict: error: ") and str(target) in line
    if damage == "weights that do not fit":
        assert "checksum" not in line and "corrupt" not in line, line


def test_warnings_are_one_line_naming_the_command() -> None:
    import warnings

    from omni.cli import plain_warnings

    before = warnings.formatwarning
    with plain_warnings("omni data images"):
        assert warnings.formatwarning("x.jpg: skipped", UserWarning, "/src/omni/data/cli.py", 94) == \
            "omni data images: warning: x.jpg: skipped\n"
    assert warnings.formatwarning is before  # in-process callers keep their own format


def test_closed_stdout_is_no_traceback():
    """`omni ... | head`: the reader leaves before omni writes; omni ends quietly (141, as SIGPIPE), no traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "omni.cli", "tokenizers"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # long before the child has imported omni and printed
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_predict_inverts_a_photo_whose_background_is_the_opposite_of_the_training_images(vit, tmp_path, capsys):
    """#30: a Fashion-MNIST model (light garments on black, recorded as the export's image_domain) given a dark
    shape on white reads it with its grey levels inverted, and says so; --invert no keeps the photo as it is."""
    from PIL import Image

    from omni.export import write_checksums
    from omni.pipelines.predict import predict_files

    export = shutil.copytree(vit, tmp_path / "final")
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "image_domain": {"border": 0.0, "mean": 0.29}}))
    write_checksums(export)
    photo = np.full((40, 40), 255, np.uint8)
    photo[8:32, 12:28] = 30  # a dark garment on a white background
    Image.fromarray(photo).save(tmp_path / "photo.png")
    Image.fromarray(255 - photo).save(tmp_path / "negative.png")

    auto = predict_files(export, [tmp_path / "photo.png"], device="cpu")[0]
    assert "its background is light where the model's training images are dark" in capsys.readouterr().err
    def same(a, b):  # inverting after the resize to 28 px, or the 8-bit file before it: within rounding
        return [n for n, _ in a] == [n for n, _ in b] and all(abs(p - q) < 1e-3 for (_, p), (_, q) in zip(a, b))

    negative = predict_files(export, [tmp_path / "negative.png"], device="cpu", invert="no")[0]
    assert same(auto, negative)
    kept = predict_files(export, [tmp_path / "photo.png"], device="cpu", invert="no")[0]
    assert not same(kept, auto) and capsys.readouterr().err == ""
    assert predict_files(export, [tmp_path / "negative.png"], device="cpu")[0] == negative  # already dark: as it is
    status, out, err = cli(["predict", "--checkpoint", str(export), "--device", "cpu", "--invert", "no",
                            str(tmp_path / "photo.png")], capsys)
    assert status == 0 and "inverted" not in err


def test_transcribe_says_when_it_recognised_nothing(whisper, tmp_path, capsys, monkeypatch):
    """#30: a model that recognises nothing in a file (an empty transcript: an empty SRT) is said on stderr, naming
    the file, while what was asked for is still written; a file with text says nothing of the kind."""
    import omni.pipelines.transcribe as pipeline

    clip, other = wav(tmp_path / "hum.wav", noise(1.0)), wav(tmp_path / "talk.wav", noise(1.0, seed=1))
    monkeypatch.setattr(pipeline, "transcribe_files", lambda checkpoint, files, **kw: ["", "some words"])
    status, out, err = cli(["transcribe", "--checkpoint", str(whisper), "--device", "cpu", str(clip), str(other)],
                           capsys)
    assert status == 0 and out.splitlines() == [f"{clip}: ", f"{other}: some words"]
    assert err.strip().splitlines() == [f"omni transcribe: {clip}: no speech recognised: the transcript is empty"]
