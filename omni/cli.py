"""The `omni` command line: dataset builders, tokenizer fitting, inference entry points.

Exit status: 0 success; 1 some input files could not be read (the others are reported; each bad file is named
on stderr with its reason); 2 a usage error, said in one line (a bad option, a missing, unreadable or wrong
kind of export), or no input file could be read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from omni.console import UsageError, number, one_line, plain_warnings, writable_dir, write_error, writing
from omni.export_kinds import check_command, describe, generation_head, is_multitask

_positive_int = number(int, at_least=1)
_finite_float = number(float)

class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: "omni predict: error: ... (see omni predict --help)", status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("omni")
    except PackageNotFoundError:  # a source tree that is not installed
        import omni

        return getattr(omni, "__version__", "unknown")


def _device(text: str) -> str:
    """A torch device string that exists on this machine (else the model would fail after loading)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r} (expected cpu, cuda, cuda:N, mps ...)") from None
    if device.type == "cpu":
        return text
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA GPU is available (torch {torch.__version__}, {build})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
        return text
    available = torch.backends.mps.is_available if device.type == "mps" else \
        getattr(getattr(torch, device.type, None), "is_available", None)
    if available is None or not available():
        raise argparse.ArgumentTypeError(f"device {text!r} is not available on this machine")
    return text


# -- exports ------------------------------------------------------------------------------------------------
def _check_export(command: str, checkpoint: str | Path) -> None:
    """Refuse an export that ``omni <command>`` cannot read, naming its kind and the command that fits."""
    from omni.export import load_config

    try:
        check_command(load_config(checkpoint), command, str(checkpoint))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _export_errors() -> tuple[type[BaseException], ...]:
    """What reading a missing, truncated or unreadable export raises."""
    from safetensors import SafetensorError

    return OSError, ValueError, KeyError, SafetensorError


# -- predict / transcribe: one result per file ----------------------------------------------------------------
def _run_on_files(args: argparse.Namespace, files: Sequence[str], run: Callable[[Path], list[Any]],
                  text: Callable[[Any], str], entry: Callable[[Any], dict[str, Any]],
                  emit: Callable[[str, Any], None] | None = None) -> int:
    """Check the export, ``run(checkpoint)`` (one result or exception per file), print the good files (txt: one
    "file: text" line each; json: one list of {"file", ...} objects, bad files {"file", "error"}; or, given
    ``emit``, ``emit(file, result)`` instead) and name each bad file with its reason on stderr. The exit status of
    the module docstring."""
    from omni.export import resolve_export_dir

    prog = f"omni {args.command}"
    try:
        checkpoint = resolve_export_dir(args.checkpoint)
        if checkpoint != Path(args.checkpoint):
            print(f"{prog}: using the export {checkpoint} of the run directory {args.checkpoint}", file=sys.stderr)
        _check_export(args.command, checkpoint)
        results = run(checkpoint)
    except Exception as exc:
        message = one_line(exc)
        named = str(args.checkpoint) in message  # e.g. load_pretrained's RuntimeError: weights that do not fit
        if not (named or isinstance(exc, _export_errors())):
            raise  # a bug: its traceback
        raise UsageError(message if named else f"cannot load the export {args.checkpoint}: {message}") from exc
    rows, bad = [], 0
    for f, result in zip(files, results):
        if isinstance(result, Exception):
            bad += 1
            reason = one_line(result).removeprefix(f"{f}: ")  # library messages start with the file
            print(f"{prog}: {f}: {reason}", file=sys.stderr)
            rows.append({"file": f, "error": reason})
        elif emit is not None:
            emit(f, result)
        else:
            rows.append({"file": f, **entry(result)})
            if args.format == "txt":
                print(f"{f}: {text(result)}")
    if args.format == "json" and emit is None:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
    if bad:
        print(f"{prog}: {bad} of {len(files)} file{'s' if len(files) > 1 else ''} failed", file=sys.stderr)
    return 0 if not bad else 2 if bad == len(files) else 1


def _predict(args: argparse.Namespace) -> int:
    from omni.pipelines.predict import attention_paths, predict_files

    pictures: dict[str, str] = {}
    if args.attention is not None:
        from omni.deps import MissingDependency, require

        try:
            require("matplotlib", "viz")
        except MissingDependency as exc:
            raise UsageError(f"--attention draws pictures: {exc}") from exc
        writable_dir("--attention", args.attention)
        pictures = {f: str(p) for f, p in zip(args.images, attention_paths(args.images, args.attention))}

    def run(checkpoint: Path) -> list[Any]:  # (file, top-k) per readable file: its json entry names its picture
        try:
            results = predict_files(checkpoint, args.images, top_k=args.top_k, device=args.device,
                                    return_exceptions=True, attention=args.attention,
                                    attention_method=args.attention_method, invert=args.invert)
        except OSError as exc:  # a picture that could not be written (the disk filled meanwhile)
            if writing("--attention", args.attention, exc):
                raise UsageError(write_error("--attention", args.attention, exc)) from exc
            raise
        return [r if isinstance(r, Exception) else (f, r) for f, r in zip(args.images, results)]

    def entry(result: tuple[str, list[tuple[str, float]]]) -> dict[str, Any]:
        f, top = result
        row: dict[str, Any] = {"top_k": [{"label": name, "probability": p} for name, p in top]}
        if f in pictures:
            row["attention"] = pictures[f]
        return row

    return _run_on_files(args, args.images, run, text=lambda r: ", ".join(f"{name} {p:.3f}" for name, p in r[1]),
                         entry=entry)


def _transcribe(args: argparse.Namespace) -> int:
    from omni.files import output_paths, write_atomic
    from omni.pipelines.transcribe import transcribe_files
    from omni.transcript_formats import render, transcript_json

    if args.decode is None:
        args.decode = "beam" if args.beam_size > 1 else "greedy"
    elif args.decode == "beam" and args.beam_size == 1:
        args.beam_size = 5  # --decode beam alone: Whisper's beam width
    elif args.decode != "beam" and args.beam_size != 1:
        raise UsageError(f"--beam-size {args.beam_size} is beam search: use it with --decode beam, not --decode "
                         f"{args.decode}")
    if args.mask_threshold is not None and args.decode != "mask-ctc":
        raise UsageError(f"--mask-threshold {args.mask_threshold} picks the tokens Mask-CTC re-predicts: use it with "
                         f"--decode mask-ctc, not --decode {args.decode}")
    if args.iterations is not None and args.decode != "mask-ctc":
        raise UsageError(f"--iterations {args.iterations} counts Mask-CTC's decoder passes: use it with --decode "
                         f"mask-ctc, not --decode {args.decode}")
    if args.draft is not None and args.decode != "greedy":
        raise UsageError(f"--draft decodes greedily (the same text in fewer passes): not with --decode {args.decode}"
                         + (f" --beam-size {args.beam_size}" if args.decode == "beam" else ""))
    _check_draft_option(args.draft, ("ctc", "ngram"))
    if args.long_form == "one-pass" and args.decode != "ctc":
        raise UsageError(f"--long-form one-pass gives the CTC head's text (the decoder reads 30 s at most): add "
                         f"--decode ctc (not --decode {args.decode})")
    if args.long_form == "one-pass" and args.alignment is not None:
        raise UsageError("--alignment draws each window's alignment; --long-form one-pass has no windows: use "
                         "--long-form pauses (or auto) with --alignment")
    if args.format in ("srt", "vtt") and len(args.files) > 1 and args.output_dir is None:
        raise UsageError(f"--format {args.format} is one document per file: give --output-dir DIR for "
                         f"{len(args.files)} files")
    outputs: dict[str, Path] = {}
    pictures: dict[str, Path] = {}
    for option, directory in (("--output-dir", args.output_dir), ("--alignment", args.alignment)):
        if directory is not None:
            writable_dir(option, directory)
    if args.alignment is not None:
        from omni.deps import MissingDependency, require

        try:
            require("matplotlib", "viz")
        except MissingDependency as exc:
            raise UsageError(f"--alignment draws pictures: {exc}") from exc
        pictures = dict(zip(args.files, output_paths(args.files, args.alignment, ".png", fallback="audio")))
    if args.output_dir is not None:
        outputs = dict(zip(args.files, output_paths(args.files, args.output_dir, f".{args.format}", fallback="audio")))
    timed = False

    def run(checkpoint: Path) -> list[Any]:
        nonlocal timed
        from omni.export import load_config

        config = load_config(checkpoint)
        # _check_export let through a speech recognizer (cross-attention, maybe CTC) or a multitask export's
        # transcribe task (builder "omni": a prefix-LM, timed by its text-to-audio self-attention)
        prefix_lm = is_multitask(config)
        timed = args.format != "txt" or args.alignment is not None  # txt alone needs no times
        if prefix_lm and args.timestamps not in ("auto", "attention"):
            raise UsageError(f"--timestamps {args.timestamps}: {checkpoint} is {describe(config)[0]}, whose prefix-LM "
                             "transcriber is timed by its text-to-audio attention: use --timestamps attention (or "
                             "auto)")
        if args.timestamps == "ctc" and not config.get("ctc"):
            raise UsageError(f"--timestamps ctc: {checkpoint} has no CTC head (trained with ctc_weight=0); "
                             "use --timestamps attention")
        if args.decode in ("ctc", "mask-ctc") and (prefix_lm or not config.get("ctc")):
            raise UsageError(f"--decode {args.decode}: {checkpoint} has no CTC head (trained with ctc_weight=0); use "
                             "--decode greedy or beam")
        if args.decode == "mask-ctc" and not config.get("mask_token"):
            raise UsageError(f"--decode mask-ctc: {checkpoint} was not trained for it (no masked-LM objective: "
                             "recipes/whisper.py --set mask_weight=0.5 trains one); use --decode ctc, greedy or beam")
        if args.timestamps == "tokens" and args.decode in ("ctc", "mask-ctc"):
            raise UsageError(f"--decode {args.decode} writes no timestamp tokens: use --timestamps ctc or auto")
        results = transcribe_files(checkpoint, args.files, beam_size=args.beam_size,
                                   length_penalty=args.length_penalty, batch_size=args.batch_size, device=args.device,
                                   max_new_tokens=args.max_new_tokens, return_exceptions=True, timestamps=timed,
                                   timing={"method": args.timestamps, "keep_alignment": bool(pictures)},
                                   draft=args.draft, draft_tokens=args.draft_tokens, decode=args.decode,
                                   iterations=args.iterations, mask_threshold=args.mask_threshold,
                                   windows=args.long_form)
        if pictures:
            from omni.alignment_plot import write_alignment_png
            from omni.export import load_tokenizers
            from omni.pipelines.transcribe import read_audio_file

            sr = load_tokenizers(checkpoint)["audio"].sample_rate
            for f, result in zip(args.files, results):
                if not isinstance(result, Exception):
                    try:
                        pictures[f].parent.mkdir(parents=True, exist_ok=True)
                        write_alignment_png(pictures[f], read_audio_file(f, sr), sr, result,
                                            title=f"{f}: {result.text}")
                    except OSError as exc:
                        if writing("--alignment", args.alignment, exc):
                            raise UsageError(write_error("--alignment", args.alignment, exc)) from exc
                        raise
        # (file, result) per readable file: its json entry names its picture
        items = [r if isinstance(r, Exception) else (f, r) for f, r in zip(args.files, results)]
        for item in items:  # an empty transcript (an empty subtitle file) is said, not left to be found
            if not isinstance(item, Exception) and not (item[1].text if timed else item[1]).strip():
                print(f"omni transcribe: {item[0]}: no speech recognised: the transcript is empty", file=sys.stderr)
        return items

    def entry(item: tuple[str, Any]) -> dict[str, Any]:
        f, result = item
        row = transcript_json(result) if timed else {"text": result}
        if f in pictures:
            row["alignment"] = str(pictures[f])
        return row

    def save(f: str, item: tuple[str, Any]) -> None:
        if args.output_dir is not None:
            body = render(item[1], args.format) if args.format != "json" else \
                json.dumps({"file": f, **entry(item)}, indent=2, ensure_ascii=False) + "\n"
            try:
                outputs[f].parent.mkdir(parents=True, exist_ok=True)
                written = write_atomic(outputs[f], body)
            except OSError as exc:  # the disk filled meanwhile: the files printed before are whole
                raise UsageError(write_error("--output-dir", args.output_dir, exc)) from exc
            print(written)
        else:  # one srt / vtt document on stdout
            sys.stdout.write(render(item[1], args.format))

    return _run_on_files(args, args.files, run, text=lambda r: r[1].text if timed else r[1], entry=entry,
                         emit=save if args.output_dir is not None or args.format in ("srt", "vtt") else None)


def _check_draft_option(draft: str | None, names: Sequence[str]) -> None:
    """--draft is one of ``names`` or an export directory (a draft model): else one line."""
    if draft is None or draft in names:
        return
    if not Path(draft).is_dir():
        raise UsageError(f"--draft {draft}: not {' or '.join(names)} and no such export directory (a smaller model "
                         "with the same vocabulary)")


def _convert(args: argparse.Namespace) -> int:
    """omni convert SRC OUT (a peer checkpoint -> an export) or --to PEER EXPORT OUT; prints OUT."""
    from omni.interop import ConversionError, convert, to_peer

    try:
        if args.to:
            out = to_peer(args.src, args.out, args.to, arch=args.arch)
        else:
            out = convert(args.src, args.out, args.peer, arch=args.arch, context=args.context,
                          rtg_scale=args.rtg_scale, language=args.language, task=args.task)
    except (ConversionError, ImportError, *_export_errors()) as exc:  # ImportError: the peer library is missing
        raise UsageError(one_line(exc)) from exc
    print(out)
    return 0


def _generate(args: argparse.Namespace) -> int:
    """omni generate --checkpoint EXPORT PROMPT...: each prompt's continuation by a text LM export, greedy (Hugging
    Face's do_sample=False) or sampled with --temperature (and --top-k, --seed)."""
    import torch

    from omni.export import resolve_export_dir
    from omni.generate import generate_ids
    from omni.pipelines.generate import load_lm

    try:
        checkpoint = resolve_export_dir(args.checkpoint)
        if checkpoint != Path(args.checkpoint):
            print(f"omni generate: using the export {checkpoint} of the run directory {args.checkpoint}",
                  file=sys.stderr)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        from omni.export import load_config

        head = generation_head(load_config(checkpoint), args.head, where=str(checkpoint), option="--head")
        lm = load_lm(checkpoint, device=device, head=head)
    except _export_errors() as exc:  # not an export, not a text LM, damaged files
        message = one_line(exc)
        raise UsageError(message if str(args.checkpoint) in message
                         else f"cannot load the export {args.checkpoint}: {message}") from exc
    if args.draft is not None and args.temperature > 0:
        raise UsageError("--draft decodes greedily (the same text in fewer passes): not with --temperature > 0")
    _check_draft_option(args.draft, ("ngram",))
    from omni.speculative import DraftStats, check_draft_vocabulary

    draft: Any = args.draft
    if draft is not None and draft != "ngram":
        try:
            draft_dir = resolve_export_dir(draft)
            draft = load_lm(draft_dir, device=device, head=generation_head(load_config(draft_dir), None,
                                                                           where=str(draft_dir), option="--draft"))
            check_draft_vocabulary(lm.tokenizer, draft.tokenizer, args.draft)
        except _export_errors() as exc:
            message = one_line(exc)
            raise UsageError(message if message.startswith("--draft") else f"--draft {args.draft}: {message}") from exc
    stats = DraftStats()
    try:
        prompts = [lm.encode(text) for text in args.prompts]
        outputs = generate_ids(lm, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_k=args.top_k, seed=args.seed, draft=draft, draft_tokens=args.draft_tokens,
                               stats=stats)
    except ValueError as exc:  # a prompt too long for the model, top-k without sampling
        raise UsageError(one_line(exc)) from exc
    if args.draft is not None:
        print(f"omni generate: --draft {args.draft}: {stats.passes} decoder passes for {stats.tokens} tokens, "
              f"{stats.accepted} of {stats.proposed} drafted tokens accepted", file=sys.stderr)
    rows = [{"prompt": text, "completion": lm.decode(ids), "prompt_ids": p, "ids": ids}
            for text, p, ids in zip(args.prompts, prompts, outputs)]
    if args.format == "json":
        print(json.dumps(rows, indent=2, ensure_ascii=False))
    else:
        for row in rows:
            print(row["prompt"] + row["completion"])
    return 0


def _list_tokenizers(args: argparse.Namespace) -> int:
    from omni.tokenizers import available_tokenizers, get_tokenizer

    for name in available_tokenizers():
        klass = get_tokenizer(name)
        doc = (klass.__doc__ or "").strip().splitlines()
        print(f"{name:12s} {klass.__module__}.{klass.__qualname__}  {doc[0] if doc else ''}")
    return 0


def _add_inference_options(p: argparse.ArgumentParser, example: str, formats: Sequence[str] = ("txt", "json"),
                           format_help: str = "") -> None:
    """--checkpoint, --device and --format, shared by predict and transcribe."""
    p.epilog = ("exit status: 0 every file read; 1 some files could not be read (each named on stderr with its "
                "reason); 2 a usage error (one line) or no file could be read")
    p.add_argument("--checkpoint", required=True,
                   help=f"an export directory, e.g. {example}, or a run directory (its final/ is used)")
    p.add_argument("--device", type=_device, default=None, help="cpu, cuda, cuda:N, mps (default: cuda when available)")
    p.add_argument("--format", choices=formats, default="txt",
                   help="txt: a 'file: result' line per file; json: a list of {file, ...} objects"
                        f"{format_help} (default: txt)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="omni", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"omni {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("tokenizers", help="list registered tokenizers (built-in and plug-in)")
    p.set_defaults(func=_list_tokenizers)
    p = sub.add_parser("predict", help="classify image files with an exported image classifier (recipes/vit.py)")
    _add_inference_options(p, "runs/vit/final")
    p.add_argument("--top-k", type=_positive_int, default=5, help="classes shown per image (default: 5)")
    p.add_argument("--attention", metavar="DIR", default=None,
                   help="also write DIR/<name>.png per image: the image under its attention heat map (over the "
                        "patch grid) with its top-k in the title (needs matplotlib: pip install -e \".[viz]\")")
    p.add_argument("--attention-method", choices=("auto", "rollout", "last"), default="auto",
                   help="rollout: attention rollout over every layer; last: the last layer's attention, read by "
                        "the query the head pools (CLS or the mean of all tokens); auto (default): rollout unless "
                        "its per-layer maps would pass 256 MB (large images), then last")
    p.add_argument("--invert", choices=("auto", "yes", "no"), default="auto",
                   help="grey levels inverted: auto (default) when the photo's background is the opposite of the "
                        "model's training images' (a dark garment on white, for a Fashion-MNIST model), saying so")
    p.add_argument("images", nargs="+", help="image files of any size, mode and format (PNG, JPEG, ...)")
    p.set_defaults(func=_predict)
    p = sub.add_parser("transcribe", help="speech to text with an exported speech recognizer (recipes/whisper.py)")
    _add_inference_options(p, "runs/whisper/final", ("txt", "json", "srt", "vtt"),  # transcript_formats.FORMATS
                           " (text, segments with start / end / text, their words with start / end / probability); "
                           "srt, vtt: subtitles, one cue per segment (one file, or --output-dir)")
    p.add_argument("--output-dir", metavar="DIR", default=None,
                   help="write DIR/<name>.<format> per file (written whole or not at all) and print its path, "
                        "instead of stdout")
    p.add_argument("--alignment", metavar="DIR", default=None,
                   help="also write DIR/<name>.png per file: the log-mel with the words' spans over the alignment "
                        "the times come from (CTC posteriors, cross-attention, or a multitask export's text-to-audio "
                        "self-attention, with the path); --format json names it (needs matplotlib: "
                        "pip install -e \".[viz]\")")
    p.add_argument("--timestamps", choices=("auto", "ctc", "attention", "tokens"), default="auto",
                   help="where word times come from: ctc: forced alignment on the encoder's CTC head; attention: "
                        "DTW over the decoder's cross-attention (Whisper's way); auto: ctc when the export has a "
                        "CTC head; tokens (converted Whispers): segments from the model's own timestamp tokens "
                        "(decoded in Whisper's timestamp mode), word times inside them from cross-attention "
                        "(default: auto)")
    p.add_argument("--beam-size", type=_positive_int, default=1, help="beam width (1 = greedy)")
    p.add_argument("--length-penalty", type=_finite_float, default=None,
                   help="GNMT length penalty alpha for beam search (0 = none); default: the model's ranking "
                   "(a converted Whisper's: score / length, as whisper.decode; omni's models: GNMT 1.0)")
    p.add_argument("--batch-size", type=_positive_int, default=16, help="30 s windows decoded together")
    p.add_argument("--max-new-tokens", type=_positive_int, default=224, help="most tokens per 30 s window")
    p.add_argument("--long-form", choices=("auto", "pauses", "whisper", "one-pass"), default="auto",
                   help="how a long file is read: pauses (omni's windows cut at pauses), whisper (whisper.transcribe's "
                        "loop), one-pass (the whole file in ONE encoder pass, the CTC head's text: exports whose "
                        "encoder attends locally, recipes/whisper.py --preset cpu-long; needs --decode ctc); auto: "
                        "one-pass for such exports with --decode ctc, else the export's own")
    p.add_argument("--decode", choices=("greedy", "beam", "ctc", "mask-ctc"), default=None,
                   help="greedy (default), beam (--beam-size, default 5), ctc (the CTC head's own text: no decoder "
                   "pass; word times from CTC), mask-ctc (the CTC text's unsure tokens re-predicted by the decoder in "
                   "--iterations parallel passes; needs an export trained with mask_weight > 0)")
    p.add_argument("--iterations", type=number(int, at_least=1, below=65), default=None,  # mask_ctc.MAX_ITERATIONS
                   help="--decode mask-ctc: decoder passes that fill the masked tokens, 1 .. 64 (default: 3)")
    p.add_argument("--mask-threshold", type=number(float, at_least=0.0), default=None,
                   help="--decode mask-ctc: tokens whose CTC confidence is under this are re-predicted (default: "
                   "0.999, the paper's)")
    p.add_argument("--draft", metavar="ctc|ngram|PATH", default=None, help="speculative decoding, the greedy text in "
                   "fewer sequential decoder passes: ctc drafts with the export's CTC head, ngram by copying what "
                   "followed the last words earlier in the text, PATH: a smaller speech export with the same "
                   "vocabulary and audio features drafts")
    p.add_argument("--draft-tokens", type=number(int, at_least=1, below=33), default=4,  # speculative.MAX_DRAFT_TOKENS
                   help="tokens drafted and verified per pass with --draft, 1 .. 32 (default: 4)")
    p.add_argument("files", nargs="+", help="audio files (WAV, FLAC, MP3, OGG ...): any sample rate, channels, length")
    p.set_defaults(func=_transcribe)
    from omni.interop import CONVERTERS

    p = sub.add_parser("convert", help="a peer library's checkpoint (timm ViT; Hugging Face ViT, Whisper, GPT-2, "
                       "Decision Transformer; openai-whisper .pt) -> an omni export, or back with --to",
                       description="omni convert SRC OUT: SRC a peer checkpoint (a timm hub directory: config.json "
                       "+ model.safetensors or pytorch_model.bin; or a state dict file with --arch; a Hugging Face "
                       "directory whose config.json says model_type vit, whisper, gpt2 or decision_transformer; an "
                       "openai-whisper .pt with its dims inside), OUT a new omni export that `omni predict`, "
                       "`omni transcribe`, `omni generate`, DT rollouts and load_pretrained read. omni convert --to "
                       "PEER EXPORT OUT: the export in the peer's format (timm / hf: config.json + model.safetensors; "
                       "openai-whisper: one .pt that whisper.load_model reads).")
    p.add_argument("src", help="the checkpoint (or with --to, the omni export) to convert")
    p.add_argument("out", help="the directory to write (must not exist, or be empty)")
    direction = p.add_mutually_exclusive_group()
    direction.add_argument("--from", dest="peer", choices=sorted(CONVERTERS),
                           help="the library SRC comes from (default: recognised from SRC)")
    direction.add_argument("--to", choices=sorted(CONVERTERS),
                           help="write the omni export SRC in this library's format")
    p.add_argument("--arch", help="timm architecture (e.g. vit_base_patch16_224): of a bare state dict SRC; with "
                                  "--to timm, instead of the one the export was converted from")
    p.add_argument("--context", type=_positive_int, help="Decision Transformer: timesteps per window (default: "
                                                         "config.json's 'context', else 20)")
    p.add_argument("--rtg-scale", type=number(float, at_least=1e-12), help="Decision Transformer: returns-to-go are "
                   "divided by this (default: config.json's 'rtg_scale', else 1000)")
    p.add_argument("--language", help="Whisper: the language token of the decoder prompt `omni transcribe` uses "
                   "(a Whisper language code: en, de, ja, ...; default en; English-only models have none)")
    p.add_argument("--task", choices=("transcribe", "translate"), help="Whisper: the task token of the prompt "
                   "(default transcribe; translate: speech to English text)")
    p.set_defaults(func=_convert)
    p = sub.add_parser("generate", help="continue text prompts with an exported language model (a converted GPT-2, "
                       "an LM task's export)",
                       description="omni generate --checkpoint EXPORT PROMPT...: each prompt followed by its "
                       "continuation. Greedy by default (token for token Hugging Face's generate(do_sample=False)); "
                       "--temperature > 0 samples. A row ends at the model's eos or after --max-new-tokens.")
    p.add_argument("--checkpoint", required=True, help="a text LM export (omni convert of a Hugging Face GPT-2, or "
                   "a run with an LM task), or a run directory (its final/ is used)")
    p.add_argument("--device", type=_device, default=None, help="cpu, cuda, cuda:N, mps (default: cuda when available)")
    p.add_argument("--format", choices=("txt", "json"), default="txt", help="txt: each prompt and its continuation; "
                   "json: a list of {prompt, completion, prompt_ids, ids} (default: txt)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64, help="most tokens per prompt (default: 64)")
    p.add_argument("--temperature", type=number(float, at_least=0.0), default=0.0,
                   help="0: greedy (default); > 0: sample from softmax(logits / temperature)")
    p.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k most likely tokens only")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: a fresh one)")
    p.add_argument("--head", default=None, help="the text LM head to use (an LM task's), when the export has several")
    p.add_argument("--draft", metavar="ngram|PATH", default=None, help="speculative decoding, the greedy text in "
                   "fewer sequential passes: ngram drafts by copying what followed the last words earlier in the "
                   "prompt; PATH: a smaller text LM export with the same vocabulary drafts")
    p.add_argument("--draft-tokens", type=number(int, at_least=1, below=33), default=4,  # speculative.MAX_DRAFT_TOKENS
                   help="tokens drafted and verified per pass with --draft, 1 .. 32 (default: 4)")
    p.add_argument("prompts", nargs="+", metavar="prompt", help="text to continue ('' starts a new document)")
    p.set_defaults(func=_generate)
    from omni.data.cli import add_data_commands, add_tokenizer_commands

    add_data_commands(sub)
    add_tokenizer_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors end in argparse: hand back their status
        return int(exc.code or 0)
    try:
        with plain_warnings(f"omni {args.command}"):
            return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"omni {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `omni transcribe ... | head`: the reader left; no traceback, and none at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by it


if __name__ == "__main__":
    sys.exit(main())
