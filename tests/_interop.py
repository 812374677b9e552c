"""Helpers shared by the interop tests (tests/test_interop_*.py): peers and omni models with random weights at
O(1) scale, and the CLI's one-line errors."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn


def o1_weights(model: nn.Module, seed: int = 0, *, by_module: bool = True,
               embedding_std: float | Callable[[torch.Tensor], float] = 1.0, named: dict[str, float] | None = None,
               unscaled: tuple[str, ...] = ("table",)) -> nn.Module:
    """Random weights at O(1) scale from ``torch.Generator().manual_seed(seed)``, in eval mode: matrices and conv
    kernels ~ N(0, 1/fan_in), biases ~ N(0, 0.1), norm gains ~ N(1, 0.1).

    ``by_module`` (GPT-2, DT, Whisper): in ``model.modules()`` order, the weight then the bias of each nn.Linear,
    nn.Conv1d, transformers' Conv1D (an (in, out) matrix), nn.Embedding (~ N(0, embedding_std^2); a callable gets
    the table and gives its std) and nn.LayerNorm; then each parameter whose name ends with a key of ``named``
    (e.g. omni's type embedding, a bare position table) ~ N(0, std^2), in ``model.named_parameters()`` order.
    Other parameters are left alone.

    ``by_module=False`` (ViT, timm): one draw for every parameter in ``model.named_parameters()`` order, its role
    taken from its name: "norm" ... "weight" a gain, "bias" a bias, two or more dimensions a matrix or kernel
    (fan_in = the numel of one output's slice) unless its name contains one of ``unscaled``; anything else
    (class token, position table, ...) ~ N(0, 1). ``embedding_std`` and ``named`` are not used.

    The draws (their order, and the arithmetic on them) are the ones each test file made before this helper, so
    the tests' numbers did not move."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if not by_module:
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=gen)
                if "norm" in name and name.endswith("weight"):
                    p.copy_(1 + 0.1 * noise)
                elif name.endswith("bias"):
                    p.copy_(0.1 * noise)
                elif p.dim() >= 2 and not any(s in name for s in unscaled):
                    p.copy_(noise / math.sqrt(p[0].numel()))
                else:
                    p.copy_(noise)
            return model.eval()
        try:
            from transformers.pytorch_utils import Conv1D
        except ImportError:  # no transformers, so no Conv1D either
            Conv1D = ()
        for m in model.modules():
            if isinstance(m, Conv1D):  # (in, out)
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * m.weight.shape[0] ** -0.5)
            elif isinstance(m, (nn.Linear, nn.Conv1d)):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * m.weight[0].numel() ** -0.5)
            elif isinstance(m, nn.Embedding):
                std = embedding_std(m.weight) if callable(embedding_std) else embedding_std
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * std)
            elif isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
            else:
                continue
            if getattr(m, "bias", None) is not None:
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
        for name, p in model.named_parameters():
            std = next((s for suffix, s in (named or {}).items() if name.endswith(suffix)), None)
            if std is not None:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()


def cli_error(argv: list[str], capsys, prog: str | None = "omni convert") -> str:
    """Runs ``omni argv``, which must exit with status 2 and write exactly one line to stderr (no traceback),
    starting "<prog>: error: " (not checked when ``prog`` is None); returns that line."""
    from omni.cli import main

    capsys.readouterr()  # what earlier commands printed
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert prog is None or err.startswith(f"{prog}: error: "), err
    return err

