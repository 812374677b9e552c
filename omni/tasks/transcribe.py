"""Speech recognition as a prefix-LM: ``TranscribeTask`` (its transcribe head is decoded through
``omni.prefix_lm.PrefixLMTranscriber``, an ``omni.interfaces.Seq2SeqDecoder``, as recipes/whisper.py's model is)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from omni.asr_text import CTC_BLANK, ctc_greedy_decode, ctc_labels, error_rates
from omni.mixture import MixedBatch
from omni.model import OmniModel
from omni.prefix_lm import PrefixLMTranscriber
from omni.segment import Sample, Segment
from omni.tasks.base import NextTextTokenTask, Row, inference, masked_mean, register_task
from omni.tokenizers.base import Tokenizer
from omni.tokenizers.text import IGNORE_INDEX, TextTokenizer


@register_task("transcribe")
class TranscribeTask(NextTextTokenTask):
    """Speech recognition as a prefix-LM: [audio, <bos><|transcribe|> text <eos>] in one document.

    ``clips[i]`` is raw audio for ``audio.encode`` or an encoded audio Segment (pre-encode small sets:
    log-mel extraction dominates the CPU cost of a batch).

    ``ctc_weight`` > 0 adds hybrid CTC/attention training (``omni.speech.SpeechRecognizer``'s reason: trained
    from scratch, the text part can learn the transcripts' language and ignore the audio; a CTC loss on the
    audio span makes its hidden states line up with the transcript): a byte-level CTC head (``{name}_ctc``,
    257 outputs, ``omni.speech.CTC_BLANK`` the blank) on every audio token, task loss = (1 - ctc_weight) x
    text cross-entropy + ctc_weight x CTC (as ``omni.speech.SpeechLoss``). The CTC labels
    (``omni.speech.ctc_labels``) travel as the audio segment's per-token targets: label byte k at frame k,
    ``IGNORE_INDEX`` after the label, so they are collated and moved with the batch like ClassifyTask's labels."""

    metric_names = ("token_accuracy",)

    def __init__(self, name: str, audio: Tokenizer, text: TextTokenizer, clips: Sequence[Any],
                 transcripts: Sequence[str], *, weight: float = 1.0, loss_weight: float = 1.0,
                 task_token: str = "transcribe", ctc_weight: float = 0.0) -> None:
        super().__init__(name, weight, loss_weight)
        if len(clips) != len(transcripts) or not len(clips):
            raise ValueError(f"task {name!r}: {len(clips)} clips but {len(transcripts)} transcripts")
        if not (ctc_weight >= 0 and math.isfinite(ctc_weight)):
            raise ValueError(f"task {name!r}: ctc_weight must be a finite number >= 0, got {ctc_weight!r}")
        self.audio, self.text, self.clips, self.transcripts = audio, text, clips, transcripts
        self.text_tokenizer = text
        self.task_token = task_token
        self.ctc_weight = float(ctc_weight)
        self.ctc_head = f"{name}_ctc"  # the CTC head's name in model.heads (when ctc_weight > 0)
        if self.ctc_weight > 0:
            self.metric_names = ("token_accuracy", "ctc_loss")

    def tokenizers(self) -> dict[str, Tokenizer]:
        return {"audio": self.audio, "text": self.text}

    def __len__(self) -> int:
        return len(self.clips)

    def audio_segment(self, i: int) -> Segment:
        clip = self.clips[i]
        return clip if isinstance(clip, Segment) else self.audio.encode(clip, key=f"{self.name}/{i}")

    def sample(self, i: int, rng: np.random.Generator) -> Sample:
        key = f"{self.name}/{i}"
        text = self.text.encode(self.transcripts[i], key=key, task=self.task_token)
        audio = self.audio_segment(i)
        if self.ctc_weight > 0:
            audio = Segment(audio.modality, audio.tokens, audio.positions, audio.role,
                            targets=self._ctc_targets(i, len(audio), key), meta=audio.meta)
        return Sample([audio, text], key=key, label=self.transcripts[i])

    def _ctc_targets(self, i: int, frames: int, key: str) -> Tensor:
        """(frames,) CTC labels of transcript ``i`` laid along its audio frames, IGNORE_INDEX after them. A
        label longer than the clip cannot be aligned (and cannot be laid out): warned, and left all
        IGNORE_INDEX, which the loss reads as "no CTC term" for this sample."""
        labels = ctc_labels(self.transcripts[i])
        out = torch.full((frames,), IGNORE_INDEX, dtype=torch.long)
        if labels.shape[0] > frames:
            warnings.warn(f"task {self.name!r}: sample {key!r} has {labels.shape[0]} CTC label bytes but only "
                          f"{frames} audio tokens: trained without its CTC term")
        else:
            out[:labels.shape[0]] = labels
        return out

    def head_specs(self) -> dict[str, dict[str, Any]]:
        specs = super().head_specs()
        if self.ctc_weight > 0:  # an untied "lm" head: a Linear(d, 257) without bias
            specs[self.ctc_head] = {"type": "lm", "vocab_size": CTC_BLANK + 1}
        return specs

    def loss(self, model: OmniModel, hidden: Tensor, batch: MixedBatch,
             index: int) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = super().loss(model, hidden, batch, index)
        if self.ctc_weight == 0:
            return loss, metrics
        ctc = self.ctc_loss(model, hidden, batch, index)
        metrics["ctc_loss"] = ctc
        # the weighting of omni.speech.SpeechLoss, so ctc_weight means the same in both recipes
        return (1.0 - self.ctc_weight) * loss + self.ctc_weight * ctc, metrics

    # Eager under torch.compile: F.ctc_loss is a dynamic-shape op and needs host lengths (a sync) anyway;
    # traced, this would break the graph twice and recompile as the segment count changes.
    @torch.compiler.disable
    def ctc_loss(self, model: OmniModel, hidden: Tensor, batch: MixedBatch, index: int) -> Tensor:
        """CTC loss of this task's audio spans in a packed batch: every audio segment's head log-probs padded
        into (T_max, S, 257) by (frame, segment) index tensors, ``F.ctc_loss`` per segment / label length,
        averaged over this task's segments that carry labels (infeasible alignments: 0, ``zero_infinity``)."""
        if "audio" not in batch.targets:
            raise ValueError(f"task {self.name!r} has ctc_weight > 0 but the batch's audio segments carry no CTC "
                             "labels (targets): build its samples with TranscribeTask.sample")
        seg = batch.segment_of["audio"]  # (N_a,) audio segment of every audio token, tokens in segment order
        n_seg = batch.segment_document["audio"].shape[0]
        frames = torch.zeros(n_seg, dtype=torch.long, device=seg.device).index_add_(0, seg, torch.ones_like(seg))
        t = torch.arange(seg.shape[0], device=seg.device) - (frames.cumsum(0) - frames)[seg]  # frame in segment
        targets = batch.targets["audio"].long()
        mine = batch.segment_task("audio") == index
        # other tasks' audio segments (their targets are not CTC labels) get an empty label and weight 0
        lengths = torch.zeros_like(frames).index_add_(0, seg, (targets != IGNORE_INDEX).long()) * mine
        T = int(frames.max())
        logp = model.forward_head(hidden, batch, self.ctc_head, "audio").float().log_softmax(-1)
        padded = logp.new_zeros(T, n_seg, logp.shape[-1]).index_put((t, seg), logp)
        labels = torch.zeros(n_seg, T, dtype=torch.long, device=seg.device).index_put((seg, t), targets.clamp_min(0))
        per = F.ctc_loss(padded, labels, frames, lengths, blank=CTC_BLANK, reduction="none", zero_infinity=True)
        return masked_mean(per / lengths.clamp_min(1), (lengths > 0).float())

    def ctc_transcribe(self, model: OmniModel, indices: Sequence[int] | None = None, *,
                       batch_size: int = 64) -> list[str]:
        """Best-path CTC transcripts (``omni.speech.ctc_greedy_decode``) of clips ``indices`` (default all):
        the audio alone through the trunk, bidirectional over each clip's real frames (padding masked out of
        the keys), as in a packed training document (the audio never sees its text), then the CTC head."""
        idx = list(range(len(self))) if indices is None else [int(i) for i in indices]
        texts: dict[int, str] = {}
        with inference(model) as dev:
            for chunk, frames, mask in self._audio_batches(idx, batch_size, dev):
                positions = torch.arange(frames.shape[1], device=dev).expand(frames.shape[:2])
                h = model.trunk(model.embedders["audio"](frames), positions, mask[:, None, None, :])
                texts.update(zip(chunk, ctc_greedy_decode(model.heads[self.ctc_head](h).float(), mask)))
        return [texts[i] for i in idx]

    def _audio_batches(self, indices: Sequence[int], batch_size: int,
                       device: torch.device) -> Iterator[tuple[list[int], Tensor, Tensor]]:
        """(clip indices, right-padded audio tokens (B, S, F), mask (B, S)) on ``device``, ``batch_size`` clips
        at a time, sorted by length (little padding); each clip once."""
        from omni.speech import pad_audio  # decoding is not on the training import path

        audio = {i: self.audio_segment(i).tokens for i in indices}
        order = sorted(audio, key=lambda i: audio[i].shape[0])
        for lo in range(0, len(order), batch_size):
            chunk = order[lo:lo + batch_size]
            frames, mask = pad_audio([audio[i] for i in chunk])
            yield chunk, frames.to(device), mask.to(device)

    def transcribe(self, model: OmniModel, indices: Sequence[int] | None = None, *, batch_size: int = 64,
                   use_cache: bool = True, **guards: Any) -> list[str]:
        """Greedy transcripts of clips ``indices`` (default all), by ``omni.speech.greedy_decode`` with its
        defaults (max_new_tokens 224, 25 tokens/s + 8 per clip, repetition guard) unless ``guards`` say
        otherwise. Clips are sorted by length and decoded ``batch_size`` at a time (little padding)."""
        from omni.speech import greedy_decode  # decoding is not on the training import path

        idx = list(range(len(self))) if indices is None else [int(i) for i in indices]
        texts: dict[int, str] = {}
        with inference(model) as dev:
            decoder = PrefixLMTranscriber.for_task(model, self)
            for chunk, frames, mask in self._audio_batches(idx, batch_size, dev):
                ids = greedy_decode(decoder, decoder.encode(frames, mask), mask, use_cache=use_cache,
                                    check_every=8 if use_cache else 1, **guards)
                texts.update(zip(chunk, (self.text.decode(row) for row in ids)))
        return [texts[i] for i in idx]

    def evaluate(self, model: OmniModel, *, batch_size: int = 64, **guards: Any) -> dict[str, float]:
        """Corpus CER and WER of greedy transcripts of every clip (``omni.speech.error_rates``: texts
        normalised by ``normalize_text``, total edits / total reference characters or words), as
        recipes/whisper.py reports on its test split; with a CTC head in ``model`` also ``ctc_cer``, the CER
        of its best-path transcripts (``ctc_transcribe``), as recipes/whisper.py's ``ctc_cer``."""
        hyps = self.transcribe(model, batch_size=batch_size, **guards)
        out = {**error_rates(list(self.transcripts), hyps), "utterances": float(len(hyps))}
        if self.ctc_head in model.heads:  # what the audio span alone says, through the CTC head
            heard = self.ctc_transcribe(model, batch_size=batch_size)
            out["ctc_cer"] = error_rates(list(self.transcripts), heard)["cer"]
        return out

    def samples(self, model: OmniModel, count: int = 4, max_new_tokens: int = 224) -> list[Any]:
        """The first ``count`` held-out clips with their reference and greedy transcript: the audio itself
        (``omni.plots.Clip``) when the clip is raw audio, else (a pre-encoded log-mel Segment) its log-mel as a
        picture with the texts beside it (``Picture`` + ``Note``)."""
        from omni.plots import Clip, Note, Picture, spectrogram

        idx = list(range(min(count, len(self))))
        if not idx:
            return []
        heard = self.transcribe(model, idx, max_new_tokens=max_new_tokens)
        items: list[Any] = []
        for i, hyp in zip(idx, heard):
            tag, text = f"{self.name}/clip{i}", transcript_note(self.transcripts[i], hyp)
            clip = self.clips[i]
            if isinstance(clip, Segment):
                mel = log_mel_frames(clip.tokens, getattr(self.audio, "n_mels", 80), getattr(self.audio, "kernel", 1))
                items += [Picture(f"{tag}/log_mel", spectrogram(mel, title=f"reference: {self.transcripts[i]}",
                                                                frames_per_second=self.audio.tokens_per_second)),
                          Note(tag, text)]
            else:
                from omni.tokenizers.audio import load_audio

                rate = int(getattr(self.audio, "sample_rate", 16000))
                wave = load_audio(clip, sample_rate=rate, key=tag).numpy()
                items.append(Clip(tag, wave, rate, text))
        return items

    @staticmethod
    def eval_options(entry: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
        """The entry's ``eval_batch_size`` and ``max_new_tokens`` (recipes/whisper.py's decoding limit)."""
        return {"batch_size": entry.get("eval_batch_size", 64), "max_new_tokens": entry.get("max_new_tokens", 224)}

    def result_row(self, r: Mapping[str, float]) -> Row:
        also = f"WER {100 * r['wer']:.2f}%" + (f", CTC CER {100 * r['ctc_cer']:.2f}%" if "ctc_cer" in r else "")
        return "CER (%)", f"{100 * r['cer']:.2f}", also, f"{r['utterances']:.0f} test utterances, greedy"


def transcript_note(reference: str, heard: str) -> str:
    """Reference and transcript as TensorBoard Markdown (two lines)."""
    return f"**reference:** {reference}  \n**transcript:** {heard}"


def log_mel_frames(tokens: Tensor, n_mels: int, kernel: int) -> Tensor:
    """Audio tokens (n, n_mels * kernel), each a window of ``kernel`` log-mel frames flattened mel-major
    (``omni.tokenizers.audio.unfold_tokens``) -> (n, n_mels): each window's centre frame, one per token."""
    return tokens.reshape(tokens.shape[0], n_mels, kernel)[:, :, kernel // 2]
