"""What a user sees of a training run: the metrics of every log window (to the trackers and the run's history),
a tqdm bar on a terminal, or one plain line per log step with the time left when the output is a file."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Mapping

from omni.evaluation import MetricHistory

if TYPE_CHECKING:
    from omni.train import TrainConfig

LONG_RUN_SECONDS = 15 * 60  # a run expected to take longer than this says so at its first log step


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """What a user sees of the run: every ``log_every`` steps (and at the last) the window's means go to the
    trackers; the main process shows a tqdm bar when stderr is a terminal, else prints one plain line per log
    step (tqdm redraws its line with carriage returns: in a log file that is one endless line)."""

    RECORD = frozenset({"loss", "lr", "grad_norm", "tokens", "samples"})  # the rest: loss_fn's metrics

    def __init__(self, accelerator: Any, config: TrainConfig, step: int, history: MetricHistory) -> None:
        from tqdm.auto import tqdm

        self.accelerator, self.config, self.history = accelerator, config, history
        show_bar = accelerator.is_main_process and config.progress and is_terminal(sys.stderr)
        self.print_lines = accelerator.is_main_process and not show_bar
        self.bar = tqdm(total=config.steps, initial=step, desc="train", dynamic_ncols=True, disable=not show_bar)
        self.window: list[dict[str, float]] = []
        self.t0 = self.start_time = time.perf_counter()
        self.start_step = step
        self.warned_long = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()

    def step(self, step: int, record: Mapping[str, float], epoch: int) -> dict[str, float]:
        """Count optimizer step ``step``; on a log step, log the window's summary and return it (else {})."""
        cfg = self.config
        self.window.append(dict(record))
        self.bar.update(1)
        if not ((cfg.log_every > 0 and step % cfg.log_every == 0) or step == cfg.steps):
            return {}
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        logged = self._summarise(seconds, epoch)
        self.accelerator.log(logged, step=step)
        # each step's loss too: the curves show the raw loss beside the smoothed one
        self.history.append(step, {**logged, "train/loss_per_step": [r["loss"] for r in self.window]})
        self.bar.set_postfix(loss=f"{logged['train/loss']:.4g}", lr=f"{logged['train/lr']:.3g}")
        if self.print_lines:
            shown = {k.removeprefix("train/"): v for k, v in logged.items()}
            print(metric_lines(f"step {step}/{cfg.steps}: ", shown, f", it/s {len(self.window) / seconds:.3g}, "
                               f"left {duration(self.time_left(step))}"), flush=True)
        left = self.time_left(step)
        if self.accelerator.is_main_process and not self.warned_long and left > LONG_RUN_SECONDS:
            self.warned_long = True  # said once, at the first log step, so a long run is never a surprise
            self.bar.write(f"omni.train: at this pace the run needs about {duration(left)} more on this machine "
                           f"({cfg.steps - step} steps left); a smaller preset or fewer steps shortens it")
        self.window, self.t0 = [], time.perf_counter()
        return logged

    def time_left(self, step: int) -> float:
        """Seconds until the last step at this run's pace so far (this process's steps; evaluations included)."""
        done = step - self.start_step
        return (time.perf_counter() - self.start_time) / max(done, 1) * (self.config.steps - step)

    def _summarise(self, seconds: float, epoch: int) -> dict[str, float]:
        window, n = self.window, len(self.window)
        out = {"train/loss": sum(r["loss"] for r in window) / n, "train/lr": window[-1]["lr"],
               "train/grad_norm": sum(r["grad_norm"] for r in window) / n,
               "train/samples_per_s": sum(r["samples"] for r in window) / seconds, "train/epoch": float(epoch)}
        tokens = sum(r["tokens"] for r in window)
        if tokens:
            out["train/tokens_per_s"] = tokens / seconds
        for name in sorted(window[-1].keys() - self.RECORD):
            out[f"train/{name}"] = sum(r[name] for r in window) / n
        return out

    def evaluated(self, step: int, metrics: Mapping[str, float]) -> None:
        self.accelerator.log(dict(metrics), step=step)
        self.history.append(step, metrics)
        if self.accelerator.is_main_process and metrics:
            self.bar.write(metric_lines(f"step {step}: ", metrics))


WIDE = 200  # a log line wider than this is split by metric group (a multimodal run logs ~20 metrics per task)


def metric_lines(head: str, values: Mapping[str, float], tail: str = "") -> str:
    """``head`` + "name value, ..." + ``tail`` on one line; wider than WIDE characters, one line per group of
    names ("image/accuracy": group "image"): the outermost group's metrics on the first line, each other group
    on an indented line of its own."""
    line = head + ", ".join(f"{k} {v:.4g}" for k, v in values.items()) + tail
    if len(line) <= WIDE:
        return line
    groups: dict[str, dict[str, float]] = {}
    for k, v in values.items():
        groups.setdefault(k.rpartition("/")[0], {})[k] = v
    top = min(groups, key=lambda g: len(g.split("/")) if g else 0)
    lines = [head + ", ".join(f"{k} {v:.4g}" for k, v in groups.pop(top).items()) + tail]
    lines += [f"  {g}: " + ", ".join(f"{k.rpartition('/')[2]} {v:.4g}" for k, v in items.items())
              for g, items in groups.items()]
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """A time span as people read it: 42s, 3m10s, 1h05m."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


__all__ = ["Progress", "duration", "is_terminal", "metric_lines"]
