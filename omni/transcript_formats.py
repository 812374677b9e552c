"""Transcripts with word timestamps (omni.timestamps.TimedTranscript) as text: SubRip (.srt), WebVTT (.vtt),
JSON, plain text (``omni transcribe --output-dir`` writes them with omni.files.write_atomic).

SRT (the de facto format, as SubRip and ffmpeg write it): numbered cues from 1, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``,
the text, a blank line; UTF-8. WebVTT (W3C WebVTT, section 4): the ``WEBVTT`` header line, a blank line, then
cues ``HH:MM:SS.mmm --> HH:MM:SS.mmm`` + text + blank line; ``&``, ``<`` and ``>`` in cue text are escaped
(so the text can never hold ``-->``). Cue text is wrapped at word boundaries into lines of at most
``LINE_CHARS`` characters (a subtitle line); a single longer word stays whole.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Sequence

from omni.timestamps import TimedSegment, TimedTranscript

Format = Literal["txt", "json", "srt", "vtt"]
FORMATS: tuple[str, ...] = ("txt", "json", "srt", "vtt")
LINE_CHARS = 42  # the usual subtitle line length (Netflix, BBC guidelines)


def format_timestamp(seconds: float, decimal: str = ",") -> str:
    """Seconds -> ``HH:MM:SS,mmm`` (SRT; ``decimal="."`` for WebVTT), rounded to the millisecond."""
    if not seconds >= 0:  # also refuses NaN
        raise ValueError(f"a timestamp must be >= 0 seconds, got {seconds}")
    ms = int(seconds * 1000 + 0.5)  # half a millisecond up, as people read it (round() goes to even)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def wrap(text: str, width: int = LINE_CHARS) -> list[str]:
    """Greedy word wrap into lines of at most ``width`` characters."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _cue_times(segment: TimedSegment, decimal: str) -> str:
    end = max(segment.end, segment.start + 0.001)  # players drop cues that end where they start
    return f"{format_timestamp(segment.start, decimal)} --> {format_timestamp(end, decimal)}"


def to_srt(segments: Sequence[TimedSegment]) -> str:
    """SubRip text of the segments (empty string for none)."""
    return "".join(f"{i}\n{_cue_times(s, ',')}\n" + "\n".join(wrap(s.text)) + "\n\n"
                   for i, s in enumerate(segments, 1))


def _vtt_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_vtt(segments: Sequence[TimedSegment]) -> str:
    """WebVTT text of the segments (the header alone for none)."""
    return "WEBVTT\n\n" + "".join(f"{_cue_times(s, '.')}\n" + "\n".join(_vtt_escape(x) for x in wrap(s.text)) + "\n\n"
                                  for s in segments)


def transcript_json(t: TimedTranscript) -> dict[str, Any]:
    """The JSON object of a timed transcript: text, duration, method, segments [{start, end, text, words:
    [{word, start, end, probability}]}]; times in seconds rounded to the millisecond."""
    return {
        "text": t.text,
        "duration": round(t.duration, 3),
        "method": t.method,
        "segments": [{"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text,
                      "words": [{"word": w.word, "start": round(w.start, 3), "end": round(w.end, 3),
                                 "probability": round(w.probability, 4)} for w in s.words]}
                     for s in t.segments],
    }


def render(result: TimedTranscript | str, fmt: Format) -> str:
    """One file's result in ``fmt``: srt / vtt need a TimedTranscript; txt and json take a plain text too."""
    if fmt == "txt":
        return (result.text if isinstance(result, TimedTranscript) else result) + "\n"
    if fmt == "json":
        row = transcript_json(result) if isinstance(result, TimedTranscript) else {"text": result}
        return json.dumps(row, indent=2, ensure_ascii=False) + "\n"
    if not isinstance(result, TimedTranscript):
        raise TypeError(f"{fmt} needs word timestamps (a TimedTranscript), got {type(result).__name__}")
    return to_srt(result.segments) if fmt == "srt" else to_vtt(result.segments)
