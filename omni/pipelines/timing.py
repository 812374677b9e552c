"""The word timer of ``omni transcribe`` (``omni.pipelines.transcribe`` passes it to its long-form loop): a decoded
window's words -> their times, from the model's own outputs (a CTC head's forced alignment, decoder cross-attention
or a prefix-LM's text-to-audio self-attention), by ``omni.timestamps``' model-free algorithms. Whisper's layering:
``transcribe.py`` on top, ``timing.py`` below it, the model below both."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch
from torch import Tensor

from omni.introspect import capture, segment_attention
from omni.model import OmniModel
from omni.packing import Packer
from omni.segment import Sample, Segment
from omni.speech import SpeechRecognizer, pad_audio
from omni.prefix_lm import PrefixLMTranscriber
from omni.timestamps import (Method, WindowAlignment, WordTiming, attention_word_timings, ctc_word_timings,
                             frame_energy, real_frames, text_ids, transcript_words)


def is_prefix_lm(model: Any) -> bool:
    """A multitask export's prefix-LM transcriber (``omni.prefix_lm.PrefixLMTranscriber``)?"""
    return isinstance(model, PrefixLMTranscriber)


def timing_method(model: Any, method: Method = "auto") -> str:
    """"ctc" or "attention" for this model (``auto``: CTC where it has a CTC head; a prefix-LM transcriber:
    attention, its text-to-audio self-attention); ValueError when the model cannot be timed that way."""
    if is_prefix_lm(model):
        if method not in ("auto", "attention"):
            raise ValueError(f"a multitask export's prefix-LM transcriber is timed by its text-to-audio attention "
                             f"(--timestamps attention or auto), not {method!r}")
        return "attention"
    if not isinstance(model, SpeechRecognizer):
        raise ValueError("word timestamps need a speech recognition export (recipes/whisper.py or a multitask "
                         f"export's transcribe task): this model ({type(model).__name__}) has neither a CTC head, "
                         "decoder cross-attention nor a prefix-LM transcriber")
    if method == "auto":
        return "ctc" if model.ctc_head is not None else "attention"
    if method == "ctc" and model.ctc_head is None:
        raise ValueError("this export has no CTC head (recipes/whisper.py with ctc_weight=0): use the attention "
                         "alignment")
    if method not in ("ctc", "attention"):
        raise ValueError(f"timing method must be auto, ctc or attention, got {method!r}")
    return method


@torch.no_grad()
def prefix_lm_attention(model: Any, audio_tokens: Tensor, ids: Sequence[int],
                        layers: Sequence[int] | None = None) -> tuple[list[Tensor], list[float]]:
    """A prefix-LM transcriber (``omni.prefix_lm.PrefixLMTranscriber``), one window's audio tokens (S, F) and the
    transcript's ids -> (per chosen trunk layer the text-to-audio self-attention (H, P + n + 1, S), each row
    renormalised over the audio; the teacher-forced probability of each id).

    One packed forward of the document [audio, prompt (P), ids (n), eos], as training packs it, recorded by
    ``omni.introspect.capture``: rows are the text queries, columns the audio keys (``segment_attention``), the
    layout ``attention_word_timings`` reads (row P - 1 + k predicts ids[k]). ``layers``: trunk layers recorded
    (default: the second half, as for cross-attention); only those take the reference attention path."""
    trunk = model.omni.trunk
    L = len(trunk.blocks)
    layers = list(range(L // 2, L)) if layers is None else list(layers)
    names = [f"trunk.blocks.{i}.attn" for i in layers]
    dev = next(model.parameters()).device
    text = torch.tensor([*model.prompt, *ids, model.eos_id], dtype=torch.int64)
    n = int(audio_tokens.shape[0])
    sample = Sample([Segment("audio", audio_tokens.detach().cpu(), torch.arange(n), model.audio.role),
                     Segment("text", text, torch.arange(len(text)), model.text.role)], key="align")
    batch = Packer()([sample]).to(dev)
    with capture(model.omni, hidden_states=False, layers=names) as rec:
        hidden = model.omni(batch)
    probs = model.head(OmniModel.gather(hidden, batch, "text")).float().softmax(-1).cpu()  # (P + n + 1, V)
    P = len(model.prompt)
    token_probs = [float(probs[P - 1 + k, tok]) for k, tok in enumerate(ids)]
    maps = []
    for name in names:
        a = segment_attention(rec.attention[name], batch, 0, "text", "audio").float().cpu()  # (H, P + n + 1, S)
        maps.append(a / a.sum(-1, keepdim=True).clamp_min(1e-12))
    return maps, token_probs


@torch.no_grad()
def time_windows(model: Any, audio_tok: Any, text_tok: Any, windows: Sequence[Tensor], texts: Sequence[str],
                 offsets: Sequence[float], *, method: Method = "auto", batch_size: int = 16, refine: bool = True,
                 keep_alignment: bool = False, alignment_heads: Sequence[Sequence[int]] | None = None
                 ) -> list[tuple[list[WordTiming], WindowAlignment | None]]:
    """Word timings of transcribed windows: waveforms (each at most the tokenizer's max_seconds), the text
    decoded from each and its start in its file (seconds) -> per window (words, alignment or None).
    ``alignment_heads``: the decoder's (layer, head) pairs for the cross-attention DTW; default the model's own
    (``model.alignment_heads``: a converted Whisper's, set by ``load_recognizer``), else every head
    of the second half of the layers. A prefix-LM
    transcriber is timed one window at a time (``prefix_lm_attention``: its attention maps span the whole
    document, audio included, so windows are not batched)."""
    how = timing_method(model, method)
    if alignment_heads is None:
        alignment_heads = getattr(model, "alignment_heads", None)
    dev = next(model.parameters()).device
    tps = audio_tok.tokens_per_second
    out: list[tuple[list[WordTiming], WindowAlignment | None]] = [([], None)] * len(windows)
    todo = [i for i, t in enumerate(texts) if transcript_words(t)]
    if is_prefix_lm(model):
        for i in todo:
            tokens = audio_tok.encode((windows[i], audio_tok.sample_rate), key=str(i)).tokens
            n = real_frames(windows[i].shape[0], audio_tok.sample_rate, tps, tokens.shape[0])
            body = text_ids(text_tok, texts[i])
            maps, p = prefix_lm_attention(model, tokens, body)
            out[i] = attention_word_timings(maps, p, text_tok, body, n, tps, offset=offsets[i],
                                            layers=range(len(maps)), keep_alignment=keep_alignment,
                                            label="self-attention")
        todo = []
    for lo in range(0, len(todo), batch_size):
        chunk = todo[lo:lo + batch_size]
        tokens = [audio_tok.encode((windows[i], audio_tok.sample_rate), key=str(i)).tokens for i in chunk]
        frames = [real_frames(windows[i].shape[0], audio_tok.sample_rate, tps, t.shape[0])
                  for i, t in zip(chunk, tokens)]
        audio, mask = pad_audio(tokens)
        audio, mask = audio.to(dev), mask.to(dev)
        if how == "ctc":
            log_probs = model.ctc_head(model.encode(audio, mask)).float().log_softmax(-1).cpu()
            for row, i in enumerate(chunk):
                n = frames[row]
                energy = frame_energy(windows[i], audio_tok.sample_rate, tps, n) if refine else None
                out[i] = ctc_word_timings(log_probs[row, :n], texts[i], tps, offset=offsets[i], energy=energy,
                                          keep_alignment=keep_alignment)
            continue
        prompt = list(model.prompt)
        ids = [torch.tensor(prompt + text_ids(text_tok, texts[i]) + [model.eos_id]) for i in chunk]
        width = max(len(t) for t in ids)
        text = torch.full((len(chunk), width), text_tok.pad_id, dtype=torch.int64)
        for row, t in enumerate(ids):
            text[row, :len(t)] = t
        with capture(model, hidden_states=False,
                     layers=lambda name: name.startswith("decoder.") and name.endswith(".cross")) as rec:
            logits = model(audio, mask, text.to(dev))
        cross = rec.layers("cross", "decoder")  # per layer (B, H, T, S)
        probs = logits.float().softmax(-1).cpu()
        for row, i in enumerate(chunk):
            full = ids[row].tolist()
            body = full[len(prompt):-1]
            p = [float(probs[row, len(prompt) - 1 + k, tok]) for k, tok in enumerate(body)]
            out[i] = attention_word_timings([c[row, :, :len(full)].cpu() for c in cross], p, text_tok, body,
                                            frames[row], tps, offset=offsets[i], heads=alignment_heads,
                                            keep_alignment=keep_alignment)
    for i, (words, alignment) in enumerate(out):  # frames are 20 ms: the last may reach past the audio's end
        end = offsets[i] + windows[i].shape[0] / audio_tok.sample_rate
        out[i] = ([replace(w, start=min(w.start, end), end=min(w.end, end)) for w in words], alignment)
    return out


__all__ = ["is_prefix_lm", "prefix_lm_attention", "time_windows", "timing_method"]
