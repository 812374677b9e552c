"""Pictures a person looks at: training curves, Decision Transformer returns, labelled image grids and attention
heat maps. Each function draws one figure and returns it as an RGB array (H, W, 3) uint8 (what TensorBoard's
``add_image(..., dataformats="HWC")`` takes); with ``path`` it also writes it as a PNG, atomically (a temporary
file in the same folder, then ``os.replace``: a reader never sees half a picture).

    rgb = training_curves(history, "runs/vit/curves.png")      # history: omni.evaluation.MetricHistory.records
    returns_plot(rows, (random, expert), "runs/dt/returns.png")
    image_grid(images, labels, predicted, class_names)
    attention_overlay(image, heat, [("Sneaker", 0.91), ...], "attention/shoe.png")
    attention_grid(images, heats, labels, [[(7, 0.91), (5, 0.04)], ...], class_names)   # a few, side by side

matplotlib is optional (the ``viz`` extra). It is imported when the first picture is drawn, with the Agg canvas
and no pyplot, so no global backend or figure state changes in the caller's process; a missing matplotlib is
``omni.deps.MissingDependency``: 'matplotlib is not installed: pip install -e ".[viz]"'.

``Picture``, ``Clip`` and ``Note`` are the sample items a task (``omni.tasks.Task.samples``) or a recipe's ``samples_fn``
hands the Trainer for TensorBoard; building them needs no matplotlib unless a picture is drawn.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from omni.files import write_atomic

DPI = 100
EXTRA = "viz"


@dataclass(frozen=True)
class Picture:
    """An RGB image (H, W, 3) uint8 for TensorBoard under ``tag`` (``add_image``)."""

    tag: str
    image: np.ndarray


@dataclass(frozen=True)
class Clip:
    """A mono waveform (float, [-1, 1]) at ``sample_rate`` and its ``text`` (e.g. reference and transcript),
    for TensorBoard under ``tag`` (``add_audio`` + ``add_text``)."""

    tag: str
    waveform: np.ndarray
    sample_rate: int
    text: str


@dataclass(frozen=True)
class Note:
    """A text for TensorBoard under ``tag`` (``add_text``, Markdown)."""

    tag: str
    text: str


Item = Picture | Clip | Note


def _figure(width: float, height: float) -> Any:
    """A matplotlib Figure on its own Agg canvas (no pyplot: nothing global changes)."""
    from omni.deps import require

    require("matplotlib", EXTRA)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _finish(fig: Any, path: str | os.PathLike | None) -> np.ndarray:
    """Render ``fig``; write it to ``path`` (PNG, atomic) when given; return its RGB pixels."""
    fig.canvas.draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    if path is not None:
        write_png(rgb, path)
    return rgb


def as_array(x: Any, dtype: Any = None) -> np.ndarray:
    """A tensor (any device, bf16 too: through float32) or array-like as a numpy array."""
    return np.asarray(x.detach().cpu().float().numpy() if hasattr(x, "detach") else x, dtype=dtype)


def write_png(rgb: np.ndarray, path: str | os.PathLike) -> Path:
    """Write an (H, W, 3) uint8 array as a PNG at ``path`` atomically (omni.files.write_atomic)."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb)).save(png, format="PNG", optimize=True)
    return write_atomic(path, png.getvalue())


# ----------------------------------------------------------------------------------------------------
# Training curves


def ema(values: Sequence[float], weight: float) -> np.ndarray:
    """TensorBoard's smoothing: an exponential moving average, debiased so the first points are not pulled
    towards zero. Non-finite values are skipped (they keep the previous average)."""
    out, last, n = np.empty(len(values)), 0.0, 0
    for i, v in enumerate(values):
        if math.isfinite(v):
            last, n = last * weight + (1 - weight) * v, n + 1
        out[i] = last / (1 - weight ** n) if n else math.nan
    return out


# Eval metrics that count what was measured rather than how well: left off the curves.
# bookkeeping a task logs beside its metrics (how many items were scored, the time it took): not drawn
_COUNTS = frozenset({"words", "items", "episodes", "target", "utterances", "tokens", "bytes", "documents", "seconds"})


def curve_metrics(series: Mapping[str, Any], max_metrics: int) -> list[str]:
    """The eval metrics ``training_curves`` draws, in the order logged: not the loss (its own panel), spreads
    (``_std``) or bookkeeping counts (``_COUNTS``, also as a multimodal task's ``test_<count>``)."""
    def count(name: str) -> bool:
        return name.rsplit("/", 1)[-1].removeprefix("test_") in _COUNTS

    return [n.removeprefix("eval/") for n in series if n.startswith("eval/") and n != "eval/loss"
            and not n.endswith("_std") and not count(n)][:max_metrics]


def curve_series(history: Sequence[Mapping[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """{scalar name: (steps, values)} of history records ({"step": s, name: value, ...}); a name logged again at
    a step (a resumed run) keeps its last value. Per-step training losses (``train/loss_per_step``: the losses
    of the steps up to a logged step) become the series ``train/loss_step``."""
    series: dict[str, dict[int, float]] = {}
    for rec in history:
        step = int(rec["step"])
        for name, value in rec.items():
            if name == "step":
                continue
            if name == "train/loss_per_step":
                per = series.setdefault("train/loss_step", {})
                for k, v in enumerate(value):
                    per[step - len(value) + 1 + k] = float(v)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(name, {})[step] = float(value)
    return {name: (sorted(points), [points[s] for s in sorted(points)]) for name, points in series.items()}


def training_curves(history: Sequence[Mapping[str, Any]], path: str | os.PathLike | None = None, *,
                    title: str | None = None, max_metrics: int = 12) -> np.ndarray:
    """The loss (training: every step raw and smoothed, or the logged means; eval loss when logged) and each
    eval metric (with its training counterpart when there is one, e.g. train/accuracy beside eval/accuracy;
    a ``*_std`` metric is drawn as error bars on its ``*_mean``) against the optimizer step, one panel each, all
    over the run's steps."""
    series = curve_series(history)
    metrics = curve_metrics(series, max_metrics)
    panels = 1 + len(metrics)
    cols = min(panels, 3)
    rows = math.ceil(panels / cols)
    fig = _figure(4.6 * cols, 3.4 * rows + (0.4 if title else 0))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    ax = axes[0]
    raw = series.get("train/loss_step") or series.get("train/loss")
    if raw:
        steps, values = raw
        ax.plot(steps, values, color="tab:blue", alpha=0.3, lw=0.8, label="train (raw)")
        # a window of a tenth of the run (at most 200 steps): a short run is not smoothed into a lagging line
        weight = 1 - 1 / min(max(len(values) / 10, 1.0), 200.0)
        ax.plot(steps, ema(values, weight), color="tab:blue", lw=1.8, label=f"train (smoothed, EMA {weight:.2g})")
    if "eval/loss" in series:
        ax.plot(*series["eval/loss"], color="tab:orange", marker="o", ms=4, lw=1.5, label="eval")
    ax.set_title("loss")
    ax.set_ylabel("loss")
    if not raw and "eval/loss" not in series:
        ax.text(0.5, 0.5, "no loss logged yet", ha="center", va="center", transform=ax.transAxes)
    for ax, name in zip(axes[1:], metrics):
        steps, values = series[f"eval/{name}"]
        std_name = f"eval/{name.removesuffix('_mean')}_std" if name.endswith("_mean") else None
        if std_name in series and series[std_name][0] == steps:
            ax.errorbar(steps, values, yerr=series[std_name][1], marker="o", ms=4, lw=1.5, capsize=3,
                        color="tab:orange", label="eval (± std)")
        else:
            ax.plot(steps, values, marker="o", ms=4, lw=1.5, color="tab:orange", label="eval")
        if f"train/{name}" in series:
            ax.plot(*series[f"train/{name}"], color="tab:blue", lw=1.2, alpha=0.8, label="train")
        ax.set_title(name)
        ax.set_ylabel(name.rsplit("/", 1)[-1])
    last = max((s[0][-1] for s in series.values() if s[0]), default=1)
    for ax in axes[:panels]:
        ax.set_xlim(0, last * 1.03 + 0.5)  # every panel over the whole run: an eval point sits where it was taken
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    for ax in axes[panels:]:
        ax.set_axis_off()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _finish(fig, path)


# ----------------------------------------------------------------------------------------------------
# Decision Transformer: achieved vs target return


METHOD_NAMES = {"dt": "Decision Transformer", "bc": "behaviour cloning", "fbc": "filtered BC"}


def returns_plot(rows: Sequence[Mapping[str, Any]], reference: tuple[float, float] | None,
                 path: str | os.PathLike | None = None, *, title: str | None = None) -> np.ndarray:
    """Achieved return (mean ± std over episodes) against the target return, one line per method.

    ``rows``: {"method", "target" (None for a method that takes no target: bc, fbc), "return_mean",
    "return_std"}, as recipes/decision_transformer.py's results. Methods without a target are drawn as a level
    band across the targets; the diagonal marks "achieved = target"; ``reference`` (random, expert) as
    horizontal lines."""
    fig = _figure(6.4, 4.6)
    ax = fig.subplots()
    targets = sorted({float(r["target"]) for r in rows if r.get("target") is not None})
    lo, hi = (min(targets), max(targets)) if targets else (0.0, 1.0)
    if reference is not None:
        lo, hi = min(lo, reference[0]), max(hi, reference[1])
    pad = 0.05 * (hi - lo or 1.0)
    span = np.array([lo - pad, hi + pad])
    if targets:
        ax.plot(span, span, color="0.6", ls=":", lw=1, label="achieved = target")
    colours = {"dt": "tab:blue", "bc": "tab:green", "fbc": "tab:purple"}
    for k, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
        mine = [r for r in rows if r["method"] == method]
        colour = colours.get(method, f"C{k + 3}")
        label = METHOD_NAMES.get(method, method)
        with_target = sorted((r for r in mine if r.get("target") is not None), key=lambda r: float(r["target"]))
        if with_target:
            x = np.array([float(r["target"]) for r in with_target])
            y = np.array([float(r["return_mean"]) for r in with_target])
            s = np.array([float(r.get("return_std", 0.0)) for r in with_target])
            ax.errorbar(x, y, yerr=s, color=colour, marker="o", ms=6, capsize=4, lw=1.8, label=label)
        for r in mine:
            if r.get("target") is None:  # no target to condition on: one level across the x range
                m, s = float(r["return_mean"]), float(r.get("return_std", 0.0))
                ax.plot(span, [m, m], color=colour, lw=1.8, ls="-", label=f"{label} (no target)")
                ax.fill_between(span, m - s, m + s, color=colour, alpha=0.15, lw=0)
    if reference is not None:
        for value, name, colour in ((reference[0], "random", "tab:red"), (reference[1], "expert", "black")):
            ax.axhline(value, color=colour, ls="--", lw=1.2)
            ax.annotate(f"{name} {value:.1f}", (1.0, value), xycoords=("axes fraction", "data"), xytext=(-4, 3),
                        textcoords="offset points", ha="right", va="bottom", fontsize=8, color=colour)
    ax.set_xlim(*span)
    ax.set_xlabel("target return")
    ax.set_ylabel("achieved return (mean ± std over episodes)")
    ax.set_title(title or "achieved vs target return")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return _finish(fig, path)


# ----------------------------------------------------------------------------------------------------
# Images


def as_hwc(image: Any) -> np.ndarray:
    """An image as (H, W, C) floats in [0, 1] with C 1 or 3: (C, H, W) or (H, W, C) or (H, W), uint8 or float
    (taken as [0, 1]), numpy or torch."""
    if hasattr(image, "detach"):  # torch: uint8 stays uint8 (0..255), anything else as float32 (bf16 too)
        t = image.detach().cpu()
        a = t.numpy() if str(t.dtype) == "torch.uint8" else t.float().numpy()
    else:
        a = np.asarray(image)
    if a.dtype == np.uint8:
        a = a.astype(np.float32) / 255.0
    a = a.astype(np.float32)
    if a.ndim == 2:
        a = a[..., None]
    elif a.ndim == 3 and a.shape[0] in (1, 3, 4) and a.shape[-1] not in (1, 3, 4):
        a = np.moveaxis(a, 0, -1)
    if a.ndim != 3 or a.shape[-1] not in (1, 3, 4):
        raise ValueError(f"expected an image (C, H, W), (H, W, C) or (H, W) with 1, 3 or 4 channels, got shape "
                         f"{tuple(np.shape(image))}")
    return np.clip(a[..., :3], 0.0, 1.0)


def _show(ax: Any, image: np.ndarray, extent: tuple[float, float, float, float] | None = None) -> None:
    grey = image.shape[-1] == 1
    ax.imshow(image[..., 0] if grey else image, cmap="gray" if grey else None, vmin=0, vmax=1,
              interpolation="nearest", extent=extent)


def image_grid(images: Sequence[Any], labels: Sequence[int], predicted: Sequence[int],
               class_names: Sequence[str] | None = None, path: str | os.PathLike | None = None, *,
               probabilities: Sequence[float] | None = None, columns: int = 8,
               title: str | None = None) -> np.ndarray:
    """Images with their predicted class over the true one (green: right, red: wrong)."""
    n = len(images)
    if not n or len(labels) != n or len(predicted) != n:
        raise ValueError(f"image_grid needs as many labels and predictions as images (>= 1), got {n} images, "
                         f"{len(labels)} labels, {len(predicted)} predictions")
    name = (lambda i: class_names[int(i)]) if class_names else (lambda i: str(int(i)))
    cols = min(columns, n)
    rows = math.ceil(n / cols)
    fig = _figure(1.55 * cols, 2.0 * rows + 0.4)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    right = 0
    for k, ax in enumerate(axes):
        ax.set_axis_off()
        if k >= n:
            continue
        _show(ax, as_hwc(images[k]))
        ok = int(predicted[k]) == int(labels[k])
        right += ok
        p = f" {probabilities[k]:.2f}" if probabilities is not None else ""
        ax.set_title(f"{name(predicted[k])}{p}\n(true: {name(labels[k])})", fontsize=8,
                     color="tab:green" if ok else "tab:red")
    fig.suptitle(f"{title + ': ' if title else ''}predicted (true) — {right}/{n} right", fontsize=10)
    fig.tight_layout()
    return _finish(fig, path)


def attention_overlay(image: Any, heat: Any, top_k: Sequence[tuple[str, float]] = (),
                      path: str | os.PathLike | None = None, *, patch_size: int | None = None,
                      label: str = "attention", title: str | None = None) -> np.ndarray:
    """``image`` (as the model saw it) beside the same image under ``heat`` ((gh, gw): one value per patch of the
    patch grid, row-major), each patch's cell covering its ``patch_size`` pixels (default: the image divided
    evenly by the grid) so the map lines up with the grid; a colorbar; the top-k classes in the title."""
    img = as_hwc(image)
    h = as_array(heat, np.float64)
    if h.ndim != 2 or not h.size:
        raise ValueError(f"heat must be a (rows, columns) patch-grid map, got shape {h.shape}")
    H, W = img.shape[:2]
    ph, pw = (patch_size, patch_size) if patch_size else (H / h.shape[0], W / h.shape[1])
    extent = (0.0, h.shape[1] * pw, h.shape[0] * ph, 0.0)  # the grid may cover padding past the content
    fig = _figure(7.4, 3.9)
    left, right = fig.subplots(1, 2)
    for ax in (left, right):
        _show(ax, img, extent=(0, W, H, 0))
        ax.set_xlim(0, W)
        ax.set_ylim(H, 0)
        ax.set_xticks([])
        ax.set_yticks([])
    left.set_title("input", fontsize=9)
    mapped = right.imshow(h, cmap="inferno", alpha=0.6, interpolation="nearest", extent=extent,
                          vmin=float(h.min()), vmax=float(h.max()) if h.max() > h.min() else float(h.min()) + 1e-9)
    for x in np.arange(1, h.shape[1]) * pw:  # the patch grid, so each cell reads as one token
        right.axvline(x, color="white", lw=0.4, alpha=0.35)
    for y in np.arange(1, h.shape[0]) * ph:
        right.axhline(y, color="white", lw=0.4, alpha=0.35)
    right.set_title(f"{label} ({h.shape[0]}x{h.shape[1]} patches)", fontsize=9)
    bar = fig.colorbar(mapped, ax=right, fraction=0.046, pad=0.04)
    bar.set_label(label, fontsize=8)
    bar.ax.tick_params(labelsize=7)
    if top_k:
        ranked = [f"{i + 1}. {name} {p:.2f}" for i, (name, p) in enumerate(top_k)]
        lines = [", ".join(ranked[j:j + 3]) for j in range(0, len(ranked), 3)]
        head = f"{title}\n" if title else ""
        fig.suptitle(head + "\n".join(lines), fontsize=9)
    elif title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _finish(fig, path)


# attention_grid's layout, in inches (DPI 100): a pair of square panels per image, ``columns`` pairs a row
_PANEL, _PAIR_GAP, _GAP, _MARGIN, _TOP, _BOTTOM, _LINE = 1.5, 0.08, 0.35, 0.2, 0.4, 0.12, 0.14


def _attention_layout(n: int, columns: int, lines: int) -> tuple[float, float, list[tuple[tuple, tuple]]]:
    """(width, height) in inches and, per image, the (left, bottom, width, height) figure fractions of its input
    and heat-map panels; ``lines``: the text lines above a panel."""
    cols = max(1, min(columns, n))
    rows = math.ceil(n / cols)
    band = _LINE * lines + 0.1  # the titles above a row of panels
    width = 2 * _MARGIN + cols * (2 * _PANEL + _PAIR_GAP) + (cols - 1) * _GAP
    height = _TOP + rows * (band + _PANEL) + _BOTTOM
    boxes = []
    for k in range(n):
        r, c = divmod(k, cols)
        left = _MARGIN + c * (2 * _PANEL + _PAIR_GAP + _GAP)
        bottom = height - _TOP - r * (band + _PANEL) - band - _PANEL
        boxes.append(tuple((x / width, bottom / height, _PANEL / width, _PANEL / height)
                           for x in (left, left + _PANEL + _PAIR_GAP)))
    return width, height, boxes


def attention_grid_boxes(n: int, columns: int = 2, top_k: int = 2) -> list[tuple[tuple[int, int, int, int], ...]]:
    """Where ``attention_grid`` (``n`` images, ``columns``, ``top_k`` classes each) draws each image's two panels
    in its picture: ((top, left, bottom, right) of the input, the same of the heat map), in pixels, bottom and
    right excluded: e.g. ``rgb[t:b, l:r]`` is one panel."""
    width, height, boxes = _attention_layout(n, columns, max(top_k, 1))
    H = round(height * DPI)

    def pixels(box: tuple) -> tuple[int, int, int, int]:
        left, bottom, w, h = box
        return (round(H - (bottom + h) * H), round(left * width * DPI), round(H - bottom * H),
                round((left + w) * width * DPI))

    return [(pixels(a), pixels(b)) for a, b in boxes]


def attention_grid(images: Sequence[Any], heats: Sequence[Any], labels: Sequence[int],
                   top_k: Sequence[Sequence[tuple[int, float]]], class_names: Sequence[str] | None = None,
                   path: str | os.PathLike | None = None, *, patch_size: int | None = None, columns: int = 2,
                   label: str = "attention rollout", title: str | None = None) -> np.ndarray:
    """A few images, each as a pair of panels: the image as the model saw it (its true class above) and the same
    image under its heat map (``heats[k]``: (gh, gw), one value per patch, drawn as ``attention_overlay`` draws
    it, each map over its own range) with the top-k classes and probabilities above (green: the first is the
    true class, red: it is not). ``top_k[k]``: [(class index, probability), ...], best first. The panels lie
    where ``attention_grid_boxes`` says."""
    n = len(images)
    if not n or len(heats) != n or len(labels) != n or len(top_k) != n:
        raise ValueError(f"attention_grid needs as many heat maps, labels and top-k lists as images (>= 1), got "
                         f"{n} images, {len(heats)} maps, {len(labels)} labels, {len(top_k)} top-k lists")
    name = (lambda i: class_names[int(i)]) if class_names else (lambda i: str(int(i)))
    lines = max(1, max(len(t) for t in top_k))
    width, height, boxes = _attention_layout(n, columns, lines)
    fig = _figure(width, height)
    right = 0
    for k, (box_in, box_heat) in enumerate(boxes):
        img = as_hwc(images[k])
        heat = heats[k]
        h = as_array(heat, np.float64)
        if h.ndim != 2 or not h.size:
            raise ValueError(f"heats[{k}] must be a (rows, columns) patch-grid map, got shape {h.shape}")
        H, W = img.shape[:2]
        ph, pw = (patch_size, patch_size) if patch_size else (H / h.shape[0], W / h.shape[1])
        plain, under = fig.add_axes(box_in), fig.add_axes(box_heat)
        for ax in (plain, under):
            _show(ax, img, extent=(0, W, H, 0))
            ax.set_xlim(0, W)
            ax.set_ylim(H, 0)
            ax.set_axis_off()
        top = float(h.max()) if h.max() > h.min() else float(h.min()) + 1e-9
        under.imshow(h, cmap="inferno", alpha=0.6, interpolation="nearest", vmin=float(h.min()), vmax=top,
                     extent=(0.0, h.shape[1] * pw, h.shape[0] * ph, 0.0))
        ok = bool(top_k[k]) and int(top_k[k][0][0]) == int(labels[k])
        right += ok
        plain.set_title(f"true: {name(labels[k])}", fontsize=8, loc="left")
        under.set_title("\n".join(f"{name(c)} {p:.2f}" for c, p in top_k[k]), fontsize=8, loc="left",
                        color="tab:green" if ok else "tab:red")
    head = f"{title}: " if title else ""
    fig.suptitle(f"{head}{label}, {right}/{n} right (brighter: more attention)", fontsize=9,
                 y=1 - 0.08 / height)
    return _finish(fig, path)


def spectrogram(features: Any, path: str | os.PathLike | None = None, *, title: str | None = None,
                frames_per_second: float | None = None) -> np.ndarray:
    """A (frames, bins) log-mel spectrogram as an image (time across, frequency up), with a colorbar."""
    f = as_array(features)
    if f.ndim != 2 or not f.size:
        raise ValueError(f"spectrogram expects (frames, bins), got shape {f.shape}")
    fig = _figure(7.0, 2.8)
    ax = fig.subplots()
    end = f.shape[0] / frames_per_second if frames_per_second else f.shape[0]
    shown = ax.imshow(f.T, origin="lower", aspect="auto", cmap="magma", extent=(0, end, 0, f.shape[1]),
                      interpolation="nearest")
    ax.set_xlabel("seconds" if frames_per_second else "frame")
    ax.set_ylabel("mel bin")
    fig.colorbar(shown, ax=ax, pad=0.02).set_label("log-mel", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return _finish(fig, path)


__all__ = ["Clip", "Item", "Note", "Picture", "as_hwc", "attention_grid", "attention_grid_boxes", "attention_overlay",
           "curve_series", "ema", "image_grid", "returns_plot", "spectrogram", "training_curves", "write_png"]
