"""The trunk's MLP activation (TrunkConfig.activation): each choice against a hand-written MLP and
torch.nn.functional, configs saved before the field existed (mlp="gelu" = tanh GELU) load and give the
same outputs, and the "dt" preset is the official Decision Transformer's ReLU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni.export import load_pretrained, save_pretrained
from omni.model import OmniModel
from omni.trunk import ACTIVATIONS, MLP, Trunk, TrunkConfig, preset

# Written out, not torch's: exact GELU x * Phi(x), the tanh approximation (GPT-2), ReLU, SwiGLU (LLaMA).
REFERENCE = {
    "gelu": lambda h: 0.5 * h * (1 + torch.erf(h / math.sqrt(2))),
    "gelu_tanh": lambda h: 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3))),
    "relu": lambda h: torch.where(h > 0, h, torch.zeros_like(h)),
    "swiglu": lambda h: (lambda a, b: a * torch.sigmoid(a) * b)(h[..., :h.shape[-1] // 2], h[..., h.shape[-1] // 2:]),
}
FUNCTIONAL = {
    "gelu": lambda h: F.gelu(h),
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
    "swiglu": lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1],
}


def reference_mlp(mlp: MLP, x: Tensor, act) -> Tensor:
    h = x @ mlp.up.weight.T + mlp.up.bias  # (B, T, hidden [x2 gated])
    return act(h) @ mlp.down.weight.T + mlp.down.bias


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_mlp_activation_matches_reference(activation):
    assert set(ACTIVATIONS) == set(REFERENCE)
    torch.manual_seed(0)
    mlp = MLP(TrunkConfig(d_model=64, n_heads=4, activation=activation))
    for p in mlp.parameters():
        nn.init.normal_(p)  # wide pre-activations: both GELUs' tails, ReLU's kink
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        out = mlp(x)
        torch.testing.assert_close(out, reference_mlp(mlp, x, REFERENCE[activation]), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(out, reference_mlp(mlp, x, FUNCTIONAL[activation]), atol=1e-4, rtol=1e-5)
    hidden = 64 * math.ceil(2 * 256 / 3 / 64) if activation == "swiglu" else 256
    assert mlp.down.in_features == hidden and mlp.up.out_features == (2 if activation == "swiglu" else 1) * hidden


def test_activations_differ_and_keep_checkpoint_keys():
    """The choice reaches the numbers (exact vs tanh GELU differ) and never the state dict."""
    x = torch.randn(3, 5, 32)
    outs, keys = {}, set()
    for activation in ("gelu", "gelu_tanh", "relu"):
        torch.manual_seed(0)
        trunk = Trunk(TrunkConfig(d_model=32, n_layers=2, n_heads=4, activation=activation)).eval()
        with torch.no_grad():
            for p in trunk.parameters():  # the same weights for each, wider than the init's
                nn.init.normal_(p, std=0.5)
            outs[activation] = trunk(x)
        keys.add(tuple(trunk.state_dict()))
    assert len(keys) == 1 and not any(".act" in k for k in next(iter(keys)))
    assert not torch.allclose(outs["gelu"], outs["gelu_tanh"], atol=1e-4, rtol=0)
    assert not torch.allclose(outs["gelu"], outs["relu"], atol=1e-2, rtol=0)


def test_legacy_mlp_field_maps_to_activation():
    assert TrunkConfig().activation == "gelu_tanh"  # the default is what mlp="gelu" always meant
    assert TrunkConfig(mlp="gelu").activation == "gelu_tanh"
    assert TrunkConfig(mlp="swiglu").activation == "swiglu"
    assert TrunkConfig(mlp="gelu", activation="gelu_tanh").activation == "gelu_tanh"
    saved = TrunkConfig(activation="relu").to_dict()
    assert saved["activation"] == "relu" and "mlp" not in saved
    assert TrunkConfig(**saved) == TrunkConfig(activation="relu")
    with pytest.raises(ValueError, match="contradicts"):
        TrunkConfig(mlp="swiglu", activation="relu")
    with pytest.raises(ValueError, match="unknown mlp"):
        TrunkConfig(mlp="relu")
    with pytest.raises(ValueError, match="unknown activation"):
        TrunkConfig(activation="tanh")


def _old_mlp_forward(self, x: Tensor) -> Tensor:
    """MLP.forward as it was before `activation` existed (mlp="gelu" or "swiglu")."""
    h = self.up(x)
    if self.down.in_features != self.up.out_features:  # swiglu
        gate, value = h.chunk(2, dim=-1)
        h = F.silu(gate) * value
    else:
        h = F.gelu(h, approximate="tanh")
    return self.down(h)


@pytest.mark.parametrize("old_mlp", ["gelu", "swiglu"])
def test_old_export_loads_with_same_outputs(old_mlp, tmp_path):
    """An export whose config.json says "mlp" (and has no "activation") rebuilds the model it was saved from."""
    new = TrunkConfig(d_model=32, n_layers=2, n_heads=4, activation="gelu_tanh" if old_mlp == "gelu" else "swiglu")
    old_trunk = {k: v for k, v in new.to_dict().items() if k != "activation"} | {"mlp": old_mlp}
    torch.manual_seed(0)
    model = OmniModel({}, new).eval()
    for block in model.trunk.blocks:  # the old code's MLP, on the same weights
        block.mlp.forward = _old_mlp_forward.__get__(block.mlp)
    save_pretrained(model, tmp_path / "old", {"builder": "omni", "trunk": old_trunk, "heads": {}})
    loaded = load_pretrained(tmp_path / "old")
    assert loaded.trunk.cfg.activation == new.activation
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.trunk(x, mask="causal"), model.trunk(x, mask="causal"), atol=0, rtol=0)


def test_dt_preset_is_the_official_relu_mlp():
    cfg = preset("dt")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.activation) == (128, 3, 1, "relu")
    mlp = Trunk(cfg).blocks[0].mlp
    assert isinstance(mlp.act, nn.ReLU) and mlp.up.out_features == 4 * 128  # GPT-2: n_inner = 4 * n_embd
    assert preset("dt", activation="gelu_tanh").activation == "gelu_tanh"  # the pre-2026-11-24 trunk


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_activation_compiles_without_graph_breaks(activation):
    trunk = Trunk(TrunkConfig(d_model=32, n_layers=1, n_heads=4, activation=activation)).eval()
    x = torch.randn(2, 8, 32)
    torch._dynamo.reset()
    compiled = torch.compile(trunk, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, None, "causal"), trunk(x, None, "causal"))
