"""GraphedTrainStep (omni.cuda_graphs): N steps equal N steps of a plain eager loop (clipping, dropout, an LR
schedule changed mid-run), the warm-up leaves no trace, the LR tensor is honoured, and bad batches or
optimizers raise errors that name the problem. CPU runs the eager fallback on the same static buffers;
the CUDA tests (skipped here) check the captured graph itself."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import clip_grad_norm_

from omni.cuda_graphs import GraphedTrainStep, make_adamw
from omni.rl import DecisionTransformer, action_loss
from omni.tokenizers.trajectory import COL_KIND, COL_RTG, COL_STATE, COL_TIMESTEP, TrajectoryTokenizer
from omni.trunk import preset

CUDA = torch.cuda.is_available()
CONTEXT, BATCH, CLIP, WD = 4, 8, 0.25, 0.1
# LR per step, changed three times mid-run, once to 0 (no update at all then: AdamW's decay is lr * wd too).
LRS = [1e-2, 1e-2, 3e-3, 3e-3, 0.0, 5e-3, 5e-3]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tokenizer() -> TrajectoryTokenizer:
    return TrajectoryTokenizer(3, action_dim=2, max_timestep=50, context=CONTEXT, action_low=-1.0, action_high=1.0)


TOK = tokenizer()


def make_model(seed: int = 0, dropout: float = 0.1, device: str = "cpu") -> DecisionTransformer:
    torch.manual_seed(seed)
    trunk = preset("tiny", d_model=32, n_layers=2, n_heads=2, positions="rope", dropout=dropout,
                   max_positions=3 * CONTEXT)
    return DecisionTransformer(TOK, trunk).to(device)


def random_batch(seed: int, batch: int = BATCH, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """DT windows (B, 3K, F) tokens and (B, 3K, A) targets with the tokenizer's layout, from their own generator."""
    g = torch.Generator().manual_seed(seed)
    K, F, A = CONTEXT, TOK.feature_dim, TOK.action_cols
    x = torch.zeros(batch, K, 3, F)
    x[..., COL_KIND] = torch.tensor([0.0, 1.0, 2.0])
    x[..., COL_TIMESTEP] = (torch.randint(0, 40, (batch, 1, 1), generator=g) + torch.arange(K)[:, None]).float()
    x[:, :, 0, COL_RTG] = torch.rand(batch, K, generator=g)
    x[:, :, 1, COL_STATE:COL_STATE + TOK.state_dim] = torch.randn(batch, K, TOK.state_dim, generator=g)
    actions = torch.rand(batch, K, A, generator=g) * 2 - 1
    x[:, :, 2, TOK.col_action:] = actions
    y = torch.zeros(batch, K, 3, A)
    y[:, :, 1] = actions  # a_t is the target at s_t
    return x.reshape(batch, 3 * K, F).to(device), y.reshape(batch, 3 * K, A).to(device)


def loss_fn(model, tokens, targets):
    return action_loss(model, TOK, tokens, targets)[0]


BATCHES = [random_batch(100 + i) for i in range(len(LRS))]


def eager_run(dropout: float, scheduler: bool, device: str = "cpu", fused: bool | None = None):
    """The reference: a plain loop with a float LR (set per step, or by a LambdaLR)."""
    model = make_model(dropout=dropout, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=LRS[0], weight_decay=WD, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: LRS[min(i, len(LRS) - 1)] / LRS[0]) if scheduler else None
    losses, norms = [], []
    for i, (x, y) in enumerate(BATCHES):
        if sched is None:
            for g in opt.param_groups:
                g["lr"] = LRS[i]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, x.to(device), y.to(device))
        loss.backward()
        norms.append(clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
        if sched is not None:
            sched.step()
    return model, opt, losses, norms


def graphed_run(dropout: float, scheduler: bool, device: str = "cpu"):
    model = make_model(dropout=dropout, device=device)
    opt = make_adamw(model.parameters(), lr=LRS[0], weight_decay=WD)
    # The example's values feed the (undone) warm-up only: use a batch the run never sees.
    step = GraphedTrainStep(model, loss_fn, opt, example=random_batch(999, device=device), clip_norm=CLIP)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: LRS[min(i, len(LRS) - 1)] / LRS[0]) if scheduler else None
    losses, norms = [], []
    for i, (x, y) in enumerate(BATCHES):
        if sched is None:
            step.set_lr(LRS[i])
        losses.append(step(x, y).item())
        norms.append(step.grad_norm.item())
        if sched is not None:
            sched.step()
    return model, opt, losses, norms, step


def assert_same(ref, got, atol: float, rtol: float = 1e-6) -> None:
    (m1, o1, l1, n1), (m2, o2, l2, n2) = ref[:4], got[:4]
    assert l2 == pytest.approx(l1, rel=rtol, abs=1e-7)
    assert n2 == pytest.approx(n1, rel=max(rtol, 1e-5))
    assert max(n1) > CLIP  # the clip was active, so it is covered
    worst = max((a - b).abs().max().item() for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert worst < atol, f"parameters differ by {worst}"
    for p1, p2 in zip(o1.param_groups[0]["params"], o2.param_groups[0]["params"]):
        s1, s2 = o1.state[p1], o2.state[p2]
        assert float(s1["step"]) == float(s2["step"]) == len(LRS)
        torch.testing.assert_close(s2["exp_avg"], s1["exp_avg"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(s2["exp_avg_sq"], s1["exp_avg_sq"], rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("scheduler", [False, True], ids=["set_lr", "LambdaLR"])
def test_matches_eager_loop(scheduler):
    ref = eager_run(dropout=0.1, scheduler=scheduler)
    got = graphed_run(dropout=0.1, scheduler=scheduler)
    assert not got[4].graphed  # CPU: the eager fallback, same buffers and warm-up/undo as on CUDA
    assert_same(ref, got, atol=1e-6)  # in fact bitwise here (float64 LR tensor on CPU, see make_adamw)


def test_schedule_matters():
    """Sanity of the comparison above: ignoring the mid-run LR changes gives clearly different parameters."""
    ref = eager_run(dropout=0.0, scheduler=False)
    model = make_model(dropout=0.0)
    opt = make_adamw(model.parameters(), lr=LRS[0], weight_decay=WD)
    step = GraphedTrainStep(model, loss_fn, opt, example=BATCHES[0], clip_norm=CLIP)
    for x, y in BATCHES:
        step(x, y)
    worst = max((a - b).abs().max().item() for a, b in zip(ref[0].parameters(), model.parameters()))
    assert worst > 1e-3


def test_warmup_leaves_no_trace():
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_adamw(model.parameters(), lr=1e-2, weight_decay=WD)
    rng = torch.get_rng_state()
    step = GraphedTrainStep(model, loss_fn, opt, example=BATCHES[0], clip_norm=CLIP, warmup=3)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())
    for state in opt.state.values():  # allocated by the warm-up, back to Adam's fresh zeros
        assert float(state["step"]) == 0.0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert step.static_batch[0] is not BATCHES[0][0]  # own buffers, not the caller's tensors


def test_lr_tensor_takes_effect():
    model = make_model(dropout=0.0)
    opt = make_adamw(model.parameters(), lr=1e-2, weight_decay=WD)
    lr_tensor = opt.param_groups[0]["lr"]
    step = GraphedTrainStep(model, loss_fn, opt, example=BATCHES[0], clip_norm=CLIP)
    start = [p.detach().clone() for p in model.parameters()]
    step.set_lr(0.0)
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == 0.0  # in place: a graph still sees it
    step(*BATCHES[1])
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))  # lr 0: no update, no decay
    step.set_lr(1e-2)
    step(*BATCHES[2])
    moved = max((a - b).abs().max().item() for a, b in zip(start, model.parameters()))
    assert 1e-3 < moved < 0.1  # an AdamW step moves each weight by about lr


def test_returns_static_loss_tensor():
    model = make_model(dropout=0.0)
    step = GraphedTrainStep(model, loss_fn, make_adamw(model.parameters(), lr=1e-3), example=BATCHES[0])
    first = step(*BATCHES[1])
    value = first.item()
    second = step(*BATCHES[2])
    assert second is first and second.item() != value  # one buffer, overwritten by every call
    assert step.grad_norm is None  # no clipping asked


def test_bad_batches_name_the_mismatch():
    model = make_model(dropout=0.0)
    step = GraphedTrainStep(model, loss_fn, make_adamw(model.parameters(), lr=1e-3), example=BATCHES[0])
    x, y = BATCHES[1]
    with pytest.raises(ValueError, match=r"batch\[0\] has shape \(7, 12, 8\) but the captured example had "
                       r"\(8, 12, 8\)"):
        step(x[:7], y[:7])
    with pytest.raises(ValueError, match=r"batch\[1\] has shape \(8, 12, 3\)"):
        step(x, torch.zeros(8, 12, 3))
    with pytest.raises(ValueError, match=r"batch\[0\] has dtype torch.float64 but the captured example had "
                       r"torch.float32"):
        step(x.double(), y)
    with pytest.raises(ValueError, match="built for batches of 2 tensors, got 1"):
        step(x)
    with pytest.raises(ValueError, match=r"batch\[1\] is a list"):
        step(x, y.tolist())
    step(x, y)  # still usable after the errors


def test_bad_optimizers_and_arguments():
    model = make_model(dropout=0.0)
    with pytest.raises(ValueError, match="lr=0.001; it must be a 1-element tensor"):
        GraphedTrainStep(model, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-3), example=BATCHES[0])
    with pytest.raises(ValueError, match="supports torch.optim.Adam / AdamW, got SGD"):
        GraphedTrainStep(model, loss_fn, torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1)), example=BATCHES[0])
    opt = make_adamw(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        GraphedTrainStep(model, loss_fn, opt, example=BATCHES[0], use_graph=True)
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        GraphedTrainStep(model, loss_fn, opt, example=BATCHES[0], warmup=0)
    with pytest.raises(ValueError, match="clip_norm must be > 0"):
        GraphedTrainStep(model, loss_fn, opt, example=BATCHES[0], clip_norm=0.0)
    with pytest.raises(TypeError, match="loss_fn must return a scalar tensor, got tuple"):
        GraphedTrainStep(model, lambda m, x, y: action_loss(m, TOK, x, y), opt, example=BATCHES[0])
    two = make_adamw([{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:]}], lr=1e-3)
    assert two.param_groups[0]["lr"] is not two.param_groups[1]["lr"]
    step = GraphedTrainStep(model, loss_fn, two, example=BATCHES[0])
    step.set_lr([1e-3, 2e-3])
    assert [float(g["lr"]) for g in two.param_groups] == pytest.approx([1e-3, 2e-3])
    with pytest.raises(ValueError, match="2 param groups"):
        step.set_lr([1e-3])


# ----------------------------------------------------------------------------------------------------
# On a GPU: the captured graph itself (run by hand on the GPU machine: pytest tests/test_cuda_graphs.py -k cuda)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_matches_eager():
    ref = eager_run(dropout=0.0, scheduler=False, device="cuda", fused=True)
    got = graphed_run(dropout=0.0, scheduler=False, device="cuda")
    step = got[4]
    assert step.graphed
    assert step.optimizer.param_groups[0]["capturable"] and step.optimizer.param_groups[0]["fused"]
    assert_same(ref, got, atol=1e-5, rtol=1e-5)  # fp32; float32 vs Python-float LR in the fused kernel


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_compiled_bf16_matches_compiled_eager():
    """torch.compile'd loss under bf16 autocast, captured, vs the same compiled loss in a plain loop."""
    compiled = torch.compile(loss_fn)

    def reference():
        model = make_model(dropout=0.0, device="cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=LRS[0], weight_decay=WD, fused=True)
        losses = []
        for i, (x, y) in enumerate(BATCHES):
            for g in opt.param_groups:
                g["lr"] = LRS[i]
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(model, x.cuda(), y.cuda())
            loss.backward()
            clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            losses.append(loss.item())
        return model, losses

    m1, l1 = reference()
    m2 = make_model(dropout=0.0, device="cuda")
    step = GraphedTrainStep(m2, compiled, make_adamw(m2.parameters(), lr=LRS[0], weight_decay=WD),
                            example=random_batch(999, device="cuda"), clip_norm=CLIP, autocast_dtype=torch.bfloat16)
    assert step.graphed
    l2 = []
    for i, (x, y) in enumerate(BATCHES):
        step.set_lr(LRS[i])
        l2.append(step(x, y).item())  # CPU batch: copied into the static CUDA buffers
    assert l2 == pytest.approx(l1, rel=1e-3)
    worst = max((a - b).abs().max().item() for a, b in zip(m1.parameters(), m2.parameters()))
    assert worst < 1e-4, f"parameters differ by {worst}"


# ----------------------------------------------------------------------------------------------------
# Graphed greedy decoding with Whisper's logit rules (SuppressTokens, SuppressAtStart, TimestampRules): on the
# CPU the fixed-shape step runs eagerly, on CUDA it is captured in one graph; both must give greedy_decode's tokens.


def ruled_models():
    """A tiny random recogniser (weights enlarged: varied tokens) with a model's own rules (its most chosen token
    suppressed, its first token suppressed at the start) and its timestamp mode (the last 64 ids as timestamps),
    the unruled model, a padded batch of 3 clips' memory and mask."""
    from _speech_models import tiny_model

    from omni.decoding import SuppressAtStart, SuppressTokens, greedy_decode
    from omni.speech import TimestampMode, pad_audio
    from omni.tokenizers.audio import AudioTokenizer
    from omni.tokenizers.text import TextTokenizer

    audio, text = AudioTokenizer(), TextTokenizer()
    model = tiny_model(audio, text, seed=2).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
        frames, mask = pad_audio([torch.randn(n, audio.n_mels * audio.kernel, generator=g) for n in (30, 47, 38)])
        memory = model.encode(frames, mask)
        free = greedy_decode(model, memory, mask, max_new_tokens=24, tokens_per_second=None, max_repeats=None)
    chosen = [t for row in free for t in row]
    model.logit_filters = torch.nn.ModuleList([SuppressTokens([max(set(chosen), key=chosen.count)]),
                                               SuppressAtStart([free[0][0]])])
    model.timestamp_begin, model.no_timestamps_id = model.vocab_size - 64, None
    return model, TimestampMode(model), free, memory, mask


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))])
def test_graphed_decoding_with_logit_rules(device):
    from omni.decoding import GraphedGreedyDecoder, greedy_decode

    model, timed, free, memory, mask = ruled_models()
    model.to(device)
    memory, mask = memory.to(device), mask.to(device)
    kw = dict(max_new_tokens=24, tokens_per_second=None, max_repeats=None)
    refs = []
    with torch.no_grad():
        for decoder in (model, timed):
            ref = greedy_decode(decoder, memory, mask, **kw)
            graphed = GraphedGreedyDecoder(decoder, graph=device == "cuda", **kw)
            assert graphed(memory, mask) == ref
            assert (graphed._graph is not None) == (device == "cuda")
            assert graphed(memory.flip(0), mask.flip(0)) == greedy_decode(decoder, memory.flip(0), mask.flip(0), **kw)
            assert ref != free  # the rules changed the tokens
            refs.append(ref)
    plain, stamped = refs
    suppressed = int(model.logit_filters[0].ids[0])
    assert all(suppressed not in row and row[:1] != free[0][:1] for row in plain + stamped)
    assert all(row and row[0] >= model.timestamp_begin for row in stamped)  # TimestampRules: a timestamp first
