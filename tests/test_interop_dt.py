"""Hugging Face DecisionTransformerModel <-> omni's DecisionTransformer (omni.interop.hf_decision_transformer):
the converted model predicts HF's actions (full windows, left-padded windows, a whole rollout against HF's
get_action loop), HF -> omni -> HF gives every tensor back bit for bit, an omni model written in HF's format
loads with from_pretrained and predicts the same, and fine-tuning starts from HF's own loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from _interop import o1_weights

from omni.export import load_pretrained, load_tokenizers, save_pretrained
from omni.interop.hf_decision_transformer import (
    CARRIED,
    convert_directory,
    from_hf,
    to_hf,
    write_hf_directory,
)
from omni.rl import DecisionTransformer, action_loss, build_decision_transformer, rollout
from omni.tokenizers.trajectory import TrajectoryTokenizer
from omni.trunk import preset

transformers = pytest.importorskip("transformers")
from transformers import DecisionTransformerConfig, DecisionTransformerModel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

K = 20  # the official DT context
TOL = dict(rtol=0, atol=1e-5)


def o1(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights at O(1) scale (_interop.o1_weights), in eval mode; embedding tables ~ N(0, 1), omni's type embedding
    too."""
    return o1_weights(model, seed, named={"type_embedding.weight": 1.0})


def hf_model(activation: str = "relu", state_dim: int = 11, act_dim: int = 3, **kw) -> DecisionTransformerModel:
    """HF's DT at the official sizes (hidden 128, 3 layers, 1 head), O(1) weights, eval mode."""
    cfg = DecisionTransformerConfig(state_dim=state_dim, act_dim=act_dim, hidden_size=128, n_layer=3, n_head=1,
                                    max_ep_len=1000, activation_function=activation, **kw)
    return o1(DecisionTransformerModel(cfg)).eval()


def converted(hf: DecisionTransformerModel, **tokenizer_args) -> tuple[DecisionTransformer, TrajectoryTokenizer, dict]:
    config, sd, toks = from_hf(hf.state_dict(), hf.config.to_dict(), **tokenizer_args)
    model = build_decision_transformer(config, toks)
    model.load_state_dict(sd, strict=True)
    return model.eval(), toks["trajectory"], config


def random_windows(B: int, L: int, state_dim: int = 11, act_dim: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF inputs for B windows of L steps: states, actions in [-1, 1], scaled returns-to-go, timesteps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 1000 - L, (B, 1), generator=g)
    return {"states": torch.randn(B, L, state_dim, generator=g),
            "actions": torch.rand(B, L, act_dim, generator=g) * 2 - 1,
            "returns_to_go": torch.rand(B, L, 1, generator=g) * 3,
            "timesteps": start + torch.arange(L)}


def omni_tokens(tok: TrajectoryTokenizer, w: dict[str, torch.Tensor], b: int, first: int = 0) -> torch.Tensor:
    """Row b of HF inputs (steps ``first``..) as omni tokens (1, 3L, F), through the tokenizer."""
    ep = {"observations": w["states"][b, first:].double().numpy(), "actions": w["actions"][b, first:].double().numpy(),
          "returns_to_go": w["returns_to_go"][b, first:, 0].double().numpy() * tok.rtg_scale,
          "timesteps": w["timesteps"][b, first:].numpy()}
    return tok.encode(ep, start=0).tokens[None]


def hf_actions(hf: DecisionTransformerModel, w: dict[str, torch.Tensor],
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """HF's action_preds (B, L, A) for the windows ``w`` (attention_mask ``mask``: 0 at left padding)."""
    with torch.no_grad():
        return hf(**w, attention_mask=mask, return_dict=True).action_preds


# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["relu", "gelu_new"])
def test_converted_model_predicts_hfs_actions(activation):
    hf = hf_model(activation)
    model, tok, config = converted(hf)
    assert config["trunk"]["activation"] == {"relu": "relu", "gelu_new": "gelu_tanh"}[activation]
    w = random_windows(4, K)
    want = hf_actions(hf, w)
    with torch.no_grad():
        got = torch.cat([model(omni_tokens(tok, w, b))[:, 1::3] for b in range(4)])
    assert want.abs().mean() > 0.1  # O(1) actions, not a saturated or vanishing head
    torch.testing.assert_close(got, want, **TOL)
    # get_action's left padding: HF's padded windows predict what omni predicts on the unpadded steps
    pad = [0, 3, 11, 19]
    mask = (torch.arange(K)[None] >= torch.tensor(pad)[:, None]).long()
    padded = {k: v * mask.view(4, K, *[1] * (v.dim() - 2)) for k, v in w.items()}
    want = hf_actions(hf, padded, mask)
    for b, p in enumerate(pad):
        with torch.no_grad():
            got = model(omni_tokens(tok, w, b, first=p))[0, 1::3]
        torch.testing.assert_close(got, want[b, p:], **TOL)


def test_hf_to_omni_to_hf_is_bit_exact():
    hf = hf_model("gelu_new", n_inner=256, layer_norm_epsilon=1e-6, resid_pdrop=0.05)
    source = hf.state_dict()
    model, tok, config = converted(hf)
    assert config["trunk"]["mlp_ratio"] == 2.0 and config["trunk"]["norm_eps"] == 1e-6
    assert config["trunk"]["dropout"] == 0.05 and sorted(config["carried"]) == sorted(CARRIED)
    assert "action_squash" not in config  # tanh: the export config is as it always was
    hf_config, sd = to_hf(model, config, tok)
    assert sd.keys() == source.keys()
    for name, t in source.items():
        assert sd[name].dtype == t.dtype and torch.equal(sd[name], t), name
    for key, value in hf.config.to_dict().items():
        if key not in ("architectures", "transformers_version"):
            assert hf_config[key] == value, key


def test_action_tanh_false_converts_and_round_trips():
    """HF's head without tanh (predict_action a plain Linear) is the ActionHead with squash=None: HF's actions,
    unbounded, and HF -> omni -> HF gives every tensor and the config back."""
    hf = hf_model("relu", action_tanh=False)
    model, tok, config = converted(hf)
    assert config["action_squash"] is None and model.head.spec()["squash"] is None
    w = random_windows(4, K)
    want = hf_actions(hf, w)
    with torch.no_grad():
        got = torch.cat([model(omni_tokens(tok, w, b))[:, 1::3] for b in range(4)])
    assert want.abs().max() > 1  # not squashed
    torch.testing.assert_close(got, want, **TOL)
    hf_config, sd = to_hf(model, config, tok)
    assert hf_config["action_tanh"] is False and sd.keys() == hf.state_dict().keys()
    for name, t in hf.state_dict().items():
        assert sd[name].dtype == t.dtype and torch.equal(sd[name], t), name
    for key, value in hf.config.to_dict().items():
        if key not in ("architectures", "transformers_version"):
            assert hf_config[key] == value, key
    back = DecisionTransformerModel(DecisionTransformerConfig(**hf_config)).eval()
    back.load_state_dict(sd, strict=True)
    assert torch.equal(hf_actions(back, w), want)


def test_directories_round_trip(tmp_path):
    hf = hf_model("relu", state_mean=[0.5] * 11, state_std=[2.0] * 11)
    hf.save_pretrained(tmp_path / "hf")
    export = convert_directory(tmp_path / "hf", tmp_path / "omni", rtg_scale=3600.0)
    model, tok = load_pretrained(export), load_tokenizers(export)["trajectory"]
    assert tok.rtg_scale == 3600.0 and tok.context == K and tok.max_timestep == 1000
    np.testing.assert_array_equal(tok.state_mean, 0.5)  # read from the HF config
    w = random_windows(2, K)
    with torch.no_grad():
        raw = {**w, "states": w["states"] * 2.0 + 0.5}  # omni normalises states itself
        got = torch.cat([model(omni_tokens(tok, raw, b))[:, 1::3] for b in range(2)])
    torch.testing.assert_close(got, hf_actions(hf, w), **TOL)
    back = DecisionTransformerModel.from_pretrained(write_hf_directory(export, tmp_path / "hf2")).eval()
    for name, t in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    assert back.config.state_mean == [0.5] * 11 and back.config.rtg_scale == 3600.0
    # pytorch_model.bin (torch.load with weights_only=True) converts the same
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    again = load_pretrained(convert_directory(tmp_path / "bin", tmp_path / "omni-bin", rtg_scale=3600.0))
    for name, t in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name


def test_omni_model_in_hf_format(tmp_path):
    """An omni-trained DT (no source checkpoint) -> HF's format -> from_pretrained: the same actions."""
    tok = TrajectoryTokenizer(11, action_dim=3, max_timestep=1000, context=K, rtg_scale=1000.0,
                              state_mean=[0.1] * 11, state_std=[1.5] * 11, action_low=-1, action_high=1)
    torch.manual_seed(0)
    model = o1(DecisionTransformer(tok, preset("dt", positions="none", activation="gelu_tanh")), seed=1)
    config = {"builder": "omni.rl:build_decision_transformer", "trunk": model.trunk_config.to_dict(),
              "use_returns": True}
    export = save_pretrained(model, tmp_path / "omni", config, tokenizers={"trajectory": tok})
    hf, info = DecisionTransformerModel.from_pretrained(write_hf_directory(export, tmp_path / "hf"),
                                                        output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    hf.eval()
    assert hf.config.activation_function == "gelu_new" and hf.config.context == K
    w = random_windows(3, K, seed=1)
    with torch.no_grad():
        raw = {**w, "states": w["states"] * 1.5 + 0.1}
        got = torch.cat([model.eval()(omni_tokens(tok, raw, b))[:, 1::3] for b in range(3)])
    torch.testing.assert_close(got, hf_actions(hf, w), **TOL)
    # and back: the tokenizer's statistics and scale travel in the HF config
    again = load_tokenizers(convert_directory(tmp_path / "hf", tmp_path / "omni2"))["trajectory"]
    assert again.config() == tok.config()
    bounded = TrajectoryTokenizer(11, action_dim=3, context=K, action_low=-2, action_high=2)
    with pytest.raises(ValueError, match=r"bounds must be \[-1, 1\]"):
        to_hf(DecisionTransformer(bounded, preset("dt", positions="none")))
    with pytest.raises(ValueError, match="positions='none'"):
        to_hf(DecisionTransformer(tok, preset("dt")))


def test_rollout_matches_hfs_get_action_loop():
    """omni.rl.rollout (KV cache, sliding window) on Pendulum vs HF's get_action loop (left-padded windows,
    normalised states, scaled returns) fed the same observations: equal actions at every step."""
    gym = pytest.importorskip("gymnasium")
    mean, std, scale, target, steps = [0.1, -0.2, 0.3], [0.7, 0.8, 2.5], 100.0, -150.0, 30
    hf = hf_model("relu", state_dim=3, act_dim=1, state_mean=mean, state_std=std)
    model, tok, _ = converted(hf, rtg_scale=scale)
    res = rollout(model, tok, [gym.make("Pendulum-v1")], [7], targets=[target], max_steps=steps, record=True)
    env = gym.make("Pendulum-v1")
    obs, _ = env.reset(seed=7)
    states, actions, rtg, ts = [], [], [target / scale], []
    for t in range(steps):  # HF's get_action (huggingface.co/blog/train-decision-transformers), omni's actions
        states.append((obs - np.array(mean)) / np.array(std))
        actions.append(np.zeros(1))
        ts.append(t)
        n = min(len(states), K)
        pad = K - n
        mask = torch.cat([torch.zeros(pad), torch.ones(n)]).long()[None]
        window = {"states": np.array(states[-n:]), "actions": np.array(actions[-n:]),
                  "returns_to_go": np.array(rtg[-n:])[:, None], "timesteps": np.array(ts[-n:])}
        w = {k: torch.cat([torch.zeros((pad,) + v.shape[1:]), torch.as_tensor(v, dtype=torch.float32)])[None]
             for k, v in window.items()}
        w["timesteps"] = w["timesteps"].long()
        pred = hf_actions(hf, w, mask)[0, -1]
        torch.testing.assert_close(torch.as_tensor(res.outputs[t][0], dtype=torch.float32), pred, **TOL)
        actions[-1] = res.actions[t][0]
        obs, reward, *_ = env.step(res.actions[t][0].astype(np.float32))
        rtg.append(rtg[-1] - reward / scale)


def test_fine_tuning_starts_from_hfs_loss_and_hands_back(tmp_path):
    hf = hf_model("relu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model, tok, config = converted(hf)
    w = random_windows(8, K, seed=3)
    tokens = torch.cat([omni_tokens(tok, w, b) for b in range(8)])
    targets = torch.zeros(tokens.shape[:2] + (3,))
    targets[:, 1::3] = w["actions"]  # a_t on the state token, as the tokenizer's targets
    with torch.no_grad():
        reference = nn.functional.mse_loss(hf_actions(hf, w), w["actions"])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(5):
        loss, _ = action_loss(model, tok, tokens, targets)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[0] == pytest.approx(reference.item(), abs=1e-5)
    assert losses[-1] < 0.9 * losses[0]
    carried = model.carried.tensors()  # never trained: handed back as they came
    assert all(torch.equal(carried[name], hf.state_dict()[name]) for name in CARRIED)
    # the fine-tuned model, exported with the converted config, goes back to HF with its new weights
    export = save_pretrained(model, tmp_path / "tuned", config, tokenizers={"trajectory": tok})
    tuned = DecisionTransformerModel.from_pretrained(write_hf_directory(export, tmp_path / "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens)[:, 1::3], hf_actions(tuned, w), **TOL)


def test_refused_and_default_layouts():
    hf = hf_model("relu")
    for bad, match in [({"scale_attn_weights": False}, "scale_attn_weights"), ({"activation_function": "silu"}, "silu"),
                       ({"scale_attn_by_inverse_layer_idx": True}, "inverse_layer"),
                       ({"model_type": "gpt2"}, "model_type")]:
        with pytest.raises(ValueError, match=match):
            from_hf(hf.state_dict(), {**hf.config.to_dict(), **bad})
    sd = dict(hf.state_dict())
    sd.pop("predict_state.bias")
    with pytest.raises(ValueError, match="missing.*predict_state.bias"):
        from_hf(sd, hf.config.to_dict())
    # exports without "carried" (every DT export before converters) build the model they always did
    tok = TrajectoryTokenizer(3, action_dim=2, context=4, action_low=-1, action_high=1)
    plain = build_decision_transformer({"trunk": preset("tiny").to_dict()}, {"trajectory": tok})
    assert plain.carried is None and not any(k.startswith("carried") for k in plain.state_dict())
    json.dumps(from_hf(hf.state_dict(), hf.config.to_dict())[0])  # the export config is JSON


def test_omni_convert_command_both_ways(tmp_path, capsys):
    """`omni convert HF_DIR OUT` recognises the Decision Transformer by its model_type; `--to hf` writes it back
    for from_pretrained; an option it does not take, or a target that exists, is one line and status 2."""
    from omni.cli import main as omni

    hf = hf_model("gelu_new")
    hf.save_pretrained(tmp_path / "hf")
    assert omni(["convert", str(tmp_path / "hf"), str(tmp_path / "omni"), "--rtg-scale", "3600"]) == 0
    assert load_tokenizers(tmp_path / "omni")["trajectory"].rtg_scale == 3600.0
    assert omni(["convert", "--to", "hf", str(tmp_path / "omni"), str(tmp_path / "back")]) == 0
    back = DecisionTransformerModel.from_pretrained(tmp_path / "back").eval()
    for name, t in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    capsys.readouterr()
    for argv in (["convert", str(tmp_path / "hf"), str(tmp_path / "x"), "--arch", "vit_base_patch16_224"],
                 ["convert", str(tmp_path / "hf"), str(tmp_path / "omni")]):
        assert omni(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("omni convert: error: ") and err.count("\n") == 1, err
