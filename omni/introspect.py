"""What a model computed: per-layer hidden states and attention probabilities, on request, for every model on
the trunk (ImageClassifier, SpeechRecognizer, DecisionTransformer, OmniModel / MultitaskModel, converted
checkpoints: the same classes), plus the pictures made from them (attention rollout, patch maps) and the
per-document / per-segment views of a packed batch.

    from omni.introspect import capture, image_attention, segment_attention

    with capture(model) as rec:                       # eager forwards inside the block are recorded
        logits = model(images)                        # the same numbers as without capture (fp32: ~1e-6)
    rec.attention["trunk.blocks.3.attn"]              # (B, H, T, S) probabilities, rows sum to 1 over keys
    rec.hidden_states["trunk"]                        # [embeddings, block 0 output, ..., block L-1 output]

    heat = image_attention(vit, images, method="rollout")          # (B, grid_h, grid_w), sums to 1
    heat = image_attention(model, image_tokenizer.encode(img))     # any size; OmniModel/MultitaskModel too
    with capture(omni_model) as rec:
        omni_model(batch)
    t2i = segment_attention(rec.attention["trunk.blocks.1.attn"], batch, document=3, query="text", key="image")

How. ``capture`` sets ``record`` on each attention module (omni.trunk.SelfAttention / CrossAttention) to
``reference_attention``, the explicit softmax(q k^T * scale + mask) v, which hands its probabilities to the
record; it removes them (and its forward hooks on the blocks, for hidden states) when the block exits. Outside
``capture`` the modules run SDPA / FlexAttention as always: the only cost is one attribute read.

Names. Attention is keyed by the attention module's name in the model: "<trunk>.blocks.<i>.attn" for
self-attention, "<trunk>.blocks.<i>.cross" for cross-attention, where <trunk> is "trunk" (ImageClassifier,
DecisionTransformer), "encoder" / "decoder" (SpeechRecognizer), "trunk" (OmniModel), "omni.trunk"
(MultitaskModel), and "trunk" for a bare Trunk too. Hidden states are keyed by the trunk's name: L + 1 tensors
(B, T, d), the input of block 0 (embeddings, absolute positions added) and each block's output (before the
trunk's final norm: the trunk's output is what forward_features returns).

Several calls in one ``capture`` (incremental decoding with a KV cache: one call per step) are concatenated
along the query / token axis: with a cache the keys are the cache's whole static buffer, so a decoder's
self-attention is (B, H, T_total, max_length) (zero on slots not written yet, and on pad slots) and its
cross-attention (B, H, T_total, S). T_total counts the tokens fed: ``omni.decoding.greedy_decode`` feeds the
prompt, then each new token but the last, so n new tokens after a 2-token prompt give T_total = n + 1; query i
is the step that predicted token i + 1. ``rec.steps[name]`` keeps the per-call tensors. Rows are the cache's rows
at each step: after a beam-search ``reorder`` earlier steps are not reordered. Record only eager calls: a
replayed CUDA graph runs no Python, so it records nothing (decode with the eager step to capture).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal, Sequence, Union

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from omni.packing import PackedBatch, Packer
from omni.segment import Sample, Segment
from omni.trunk import CrossAttention, Mask, SelfAttention, Trunk, block_mask_to_dense

LayerFilter = Union[None, Iterable[str], Callable[[str], bool]]


# ----------------------------------------------------------------------------------------------------
# Reference attention


def dense_mask(mask: Mask, q_len: int, kv_len: int, device: torch.device | str) -> Tensor | None:
    """Any trunk mask (omni.trunk.Mask) as a bool tensor broadcastable to (B, H, q_len, kv_len), True = may
    attend; None for no mask. "causal" is aligned top-left, as SDPA's is_causal."""
    if mask is None:
        return None
    if isinstance(mask, BlockMask):
        return block_mask_to_dense(mask)[..., :q_len, :kv_len]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}; use None, 'causal', a bool tensor or a BlockMask")
        return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril()
    if mask.dtype != torch.bool:
        raise TypeError(f"reference attention takes bool masks (True = attend), got {mask.dtype}")
    return mask


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask,
                        scale: float | None = None) -> tuple[Tensor, Tensor]:
    """softmax(q k^T * scale + mask) v, in float32, with the probabilities.

    q (B, H, Tq, D), k/v (B, G, Tk, D) (GQA/MQA: query head h reads key/value head h // (H / G), as SDPA's
    enable_gqa) -> output (B, H, Tq, D) in q's dtype, probabilities (B, H, Tq, Tk) float32: rows sum to 1 over
    the keys and are 0 on masked keys; a query that may attend to no key gets a row of zeros."""
    H, G = q.shape[1], k.shape[1]
    if H != G:
        k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    allowed = dense_mask(mask, q.shape[2], k.shape[2], q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)  # an all-masked row: softmax gives NaN, report zeros
    return (probs @ v.float()).to(q.dtype), probs


# ----------------------------------------------------------------------------------------------------
# Capture


@dataclass
class Record:
    """What ``capture`` recorded. ``steps``/``hidden_steps`` hold one entry per call; ``attention`` and
    ``hidden_states`` join the calls along the query / token axis (module docstring)."""

    steps: dict[str, list[Tensor]] = field(default_factory=dict)  # attention name -> per call (B, H, Tq, Tk)
    hidden_steps: dict[str, list[list[Tensor]]] = field(default_factory=dict)  # trunk -> per call, L + 1 (B, T, d)

    @property
    def attention(self) -> dict[str, Tensor]:
        """Attention name -> probabilities (B, H, T, S), the calls concatenated along the queries."""
        return {name: _join(calls, 2, name) for name, calls in self.steps.items()}

    @property
    def hidden_states(self) -> dict[str, list[Tensor]]:
        """Trunk name -> [block 0 input, block 0 output, ..., block L-1 output], each (B, T, d), the calls
        concatenated along the tokens."""
        return {name: [_join([c[i] for c in calls], 1, f"{name}[{i}]") for i in range(len(calls[0]))]
                for name, calls in self.hidden_steps.items()}

    def layers(self, kind: Literal["attn", "cross"] = "attn", trunk: str | None = None) -> list[Tensor]:
        """The attention maps of one kind ("attn" self, "cross") in layer order, optionally of one trunk
        (its name: "trunk", "encoder", "decoder", ...) — the input of ``attention_rollout``."""
        names = [n for n in self.steps if n.rsplit(".", 1)[-1] == kind
                 and (trunk is None or _trunk_of(n) == trunk)]
        if trunk is None and len({_trunk_of(n) for n in names}) > 1:
            raise ValueError(f"the record holds several trunks ({sorted({_trunk_of(n) for n in names})}): name one")
        return [_join(self.steps[n], 2, n) for n in sorted(names, key=lambda n: int(n.rsplit(".", 2)[-2]))]


def _trunk_of(name: str) -> str:
    """'encoder.blocks.3.attn' -> 'encoder'."""
    return name.rsplit(".", 3)[0]


def _join(calls: list[Tensor], dim: int, name: str) -> Tensor:
    if len(calls) == 1:
        return calls[0]
    try:
        return torch.cat(calls, dim=dim)
    except RuntimeError as e:  # e.g. independent forwards of different lengths in one capture
        raise ValueError(f"{name}: the {len(calls)} recorded calls do not join along dim {dim} "
                         f"({[tuple(c.shape) for c in calls]}); read Record.steps / hidden_steps per call") from e


def _selected(layers: LayerFilter) -> Callable[[str], bool]:
    if layers is None:
        return lambda name: True
    if callable(layers):
        return layers
    wanted = {layers} if isinstance(layers, str) else set(layers)
    return lambda name: name in wanted


@contextmanager
def capture(model: nn.Module, attention: bool = True, hidden_states: bool = True, layers: LayerFilter = None,
            device: torch.device | str | None = None) -> Iterator[Record]:
    """Record attention probabilities and/or hidden states of every forward of ``model`` inside the block.

    layers: attention modules to record (names, or a predicate on names; None = all): the others keep the
            fast path, e.g. ``layers=["trunk.blocks.11.attn"]`` for a last-layer map of a big ViT.
    device: where to keep what is recorded (e.g. "cpu" for long sequences on a GPU); default: where computed.
    Recorded tensors are detached. Everything ``capture`` set is removed when the block exits, also on error.
    The recorded layers compute attention in float32 (``reference_attention``): under bf16/fp16 their outputs
    differ from the fast path's by the fast kernels' rounding; in fp32 they agree to ~1e-6.
    """
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: name the model's own modules
    prefix = "trunk." if isinstance(inner, Trunk) else ""  # a bare Trunk is named as the models name theirs
    modules = {prefix + raw: m for raw, m in inner.named_modules()}
    rec = Record()
    keep = _selected(layers)
    if layers is not None and not callable(layers):
        known = {n for n, m in modules.items() if isinstance(m, (SelfAttention, CrossAttention))}
        unknown = ({layers} if isinstance(layers, str) else set(layers)) - known
        if unknown:
            raise ValueError(f"no attention module named {sorted(unknown)}; the model has {sorted(known)}")
    store = (lambda t: t.detach()) if device is None else (lambda t: t.detach().to(device))
    patched: list[nn.Module] = []
    handles: list[torch.utils.hooks.RemovableHandle] = []

    # Layers share BlockMasks (one per batch, or one per attention pattern of the trunk's schedule): convert each
    # once, keeping the latest few only, so a capture over many batches holds a handful of dense masks, not one
    # per batch (holding a mask keeps its id from being reused meanwhile).
    converted: dict[int, tuple[BlockMask, Tensor]] = {}  # id -> (BlockMask, its dense (B, H, Q, KV) bool)

    def dense(mask: Mask) -> Mask:
        if not isinstance(mask, BlockMask):
            return mask
        if id(mask) not in converted:
            if len(converted) >= 4:
                converted.pop(next(iter(converted)))  # the oldest
            converted[id(mask)] = (mask, block_mask_to_dense(mask))
        return converted[id(mask)][1]

    def recorder(name: str) -> Callable[[Tensor, Tensor, Tensor, Mask], Tensor]:
        def record(q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
            out, probs = reference_attention(q, k, v, dense(mask))
            rec.steps.setdefault(name, []).append(store(probs))
            return out

        return record

    def block_hooks(name: str, trunk: Trunk) -> None:
        def start(_m: nn.Module, args: tuple) -> None:  # block 0's input: embeddings + absolute positions
            rec.hidden_steps.setdefault(name, []).append([store(args[0])])

        def output(_m: nn.Module, _args: tuple, out: Tensor) -> None:
            rec.hidden_steps[name][-1].append(store(out))

        handles.append(trunk.blocks[0].register_forward_pre_hook(start))
        handles.extend(b.register_forward_hook(output) for b in trunk.blocks)

    try:
        for name, module in modules.items():
            if attention and isinstance(module, (SelfAttention, CrossAttention)) and keep(name):
                if module.record is not None:
                    raise RuntimeError(f"{name} is already being recorded (nested capture of the same model)")
                module.record = recorder(name)
                patched.append(module)
            if hidden_states and isinstance(module, Trunk) and len(module.blocks):
                block_hooks(name.rstrip("."), module)
        yield rec
    finally:
        for module in patched:
            del module.record  # back to the class default (None): the fast path
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------------------------------
# Rollout and patch maps


def attention_rollout(maps: Sequence[Tensor], head_fusion: Literal["mean", "max", "min"] = "mean") -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020): per layer fuse the heads, add the identity (the residual
    stream), renormalise the rows, and multiply the layers through, first layer rightmost.

    maps: per layer (B, H, T, T) (or (B, T, T), heads already fused), first layer first -> (B, T, T), each row
    a distribution over the input tokens (sums to 1)."""
    if not maps:
        raise ValueError("attention_rollout needs at least one layer's attention")
    out = None
    for a in maps:
        if a.shape[-1] != a.shape[-2]:
            raise ValueError(f"rollout needs square self-attention maps, got {tuple(a.shape)} "
                             "(a KV-cache capture: slice [..., :T] first)")
        if a.dim() == 4:
            a = {"mean": a.mean(1), "max": a.amax(1), "min": a.amin(1)}[head_fusion]
        a = a.float() + torch.eye(a.shape[-1], device=a.device)
        a = a / a.sum(-1, keepdim=True)
        out = a if out is None else a @ out
    return out


def patch_attention(attn: Tensor, grid: Sequence[int], prefix: int = 0,
                    query: Literal["cls", "mean"] = "cls") -> Tensor:
    """Attention of one query over an image's patches, as a (B, gh, gw) map that sums to 1.

    attn (B, H, T, T) (heads averaged) or (B, T, T) (e.g. a rollout); the image's tokens are ``prefix`` leading
    tokens (CLS) then gh * gw row-major patches. query: "cls" = token 0's row; "mean" = the mean of every
    query's row (what a mean-pooled head reads). Attention to the prefix tokens is dropped, the rest renormalised."""
    gh, gw = int(grid[0]), int(grid[1])
    if attn.dim() == 4:
        attn = attn.mean(1)
    if attn.shape[-1] != prefix + gh * gw:
        raise ValueError(f"{attn.shape[-1]} keys do not fit {prefix} prefix tokens + a {gh}x{gw} patch grid")
    if query == "cls":
        if prefix < 1:
            raise ValueError("query='cls' needs a CLS token (prefix >= 1); use query='mean'")
        rows = attn[:, 0]
    elif query == "mean":
        rows = attn.mean(1)
    else:
        raise ValueError(f"query must be 'cls' or 'mean', got {query!r}")
    patches = rows[:, prefix:].float()
    patches = patches / patches.sum(-1, keepdim=True).clamp_min(torch.finfo(patches.dtype).tiny)
    return patches.reshape(-1, gh, gw)


def image_attention(model: nn.Module, images: Tensor | Segment, method: Literal["rollout", "last"] = "rollout",
                    query: Literal["cls", "mean"] | None = None, head: str | None = None) -> Tensor:
    """What a model looks at in an image: (B, gh, gw) maps over the patch grid, each summing to 1.

    model:  an ImageClassifier, with ``images`` (B, C, H, W) as its forward takes them or one image Segment
            (``ImageTokenizer.encode``: any size, the prediction path); or an OmniModel / MultitaskModel with
            an image Segment, packed alone as ``omni predict`` does (-> (1, gh, gw)).
    method: "rollout" over every layer, or "last" (the last layer's attention, heads averaged: only that layer
            takes the reference path).
    query:  "cls" (the CLS token's row) or "mean" (every query averaged); default: what the head pools ("cls"
            reads the CLS token, "mean" averages every token, CLS included). ``head`` names an OmniModel's
            classification head to read that from (default "mean")."""
    from omni.model import HoldsOmniModel, OmniModel
    from omni.vision import ImageClassifier

    model = model.omni if isinstance(model, HoldsOmniModel) else model
    if not isinstance(model, (ImageClassifier, OmniModel)):
        raise TypeError(f"image_attention takes an ImageClassifier or an OmniModel, got {type(model).__name__}")
    if method not in ("rollout", "last"):
        raise ValueError(f"method must be 'rollout' or 'last', got {method!r}")
    device = next(model.parameters()).device
    if isinstance(images, Segment):
        grid = images.meta["grid"]
        tokens, positions = images.tokens[None].to(device), images.positions_2d[None].to(device)
        prefix = tokens.shape[1] - grid[0] * grid[1]  # the CLS row, when the tokenizer adds one
    elif isinstance(model, ImageClassifier):
        grid, prefix = (images.shape[-2] // model.patch_size, images.shape[-1] // model.patch_size), int(model.cls)
    else:
        raise TypeError("an OmniModel's image attention takes one image Segment (ImageTokenizer.encode)")
    last = f"trunk.blocks.{len(model.trunk.blocks) - 1}.attn"
    with torch.no_grad(), capture(model, hidden_states=False, layers=None if method == "rollout" else [last]) as rec:
        if isinstance(model, OmniModel):
            batch = Packer()([Sample([images], key="image")]).to(device)
            model.forward_features(batch)
        elif isinstance(images, Segment):
            model.token_features(tokens, positions, grid)
        else:
            model.forward_features(images)
    maps = rec.layers("attn", trunk="trunk")
    if isinstance(model, OmniModel):  # the image's own block of the packed row (the rest is padding)
        maps = [document_attention(a, batch, 0)[None] for a in maps]
    attn = attention_rollout(maps) if method == "rollout" else maps[-1]
    if query is None:
        pooled = model.head if isinstance(model, ImageClassifier) else model.heads[head] if head else None
        query = "cls" if getattr(pooled, "pool", "mean") == "cls" else "mean"
    return patch_attention(attn, grid, prefix=prefix, query=query)


# ----------------------------------------------------------------------------------------------------
# Packed batches: per document, per segment


@dataclass(frozen=True)
class SegmentSpan:
    """One segment of a packed document: tokens [start, stop) of its row."""

    segment: int  # the batch's global segment number
    modality: str
    start: int
    stop: int


@dataclass(frozen=True)
class DocumentSpan:
    """One packed document (sample): tokens [start, stop) of row ``row``, its segments in order."""

    document: int
    key: str
    row: int
    start: int
    stop: int
    segments: tuple[SegmentSpan, ...]


def packed_layout(batch: PackedBatch) -> list[DocumentSpan]:
    """Where every document and segment of a packed batch lies, in document order."""
    segment_modality: dict[int, str] = {}
    flat_segment = batch.segment.reshape(-1).cpu()
    for m, index in batch.index.items():
        for s in flat_segment[index.cpu()].unique().tolist():
            segment_modality[int(s)] = m
    document, segment = batch.document.cpu(), batch.segment.cpu()
    out = []
    for d in range(batch.num_documents):
        rows, cols = (document == d).nonzero(as_tuple=True)
        if rows.numel() == 0:
            raise ValueError(f"document {d} has no tokens in the batch")
        row, start, stop = int(rows[0]), int(cols.min()), int(cols.max()) + 1
        segs = segment[row, start:stop]
        spans = []
        for s in segs.unique_consecutive().tolist():
            where = (segs == s).nonzero().flatten()
            first, last = start + int(where[0]), start + int(where[-1])
            spans.append(SegmentSpan(int(s), segment_modality[int(s)], first, last + 1))
        out.append(DocumentSpan(d, batch.keys[d], row, start, stop, tuple(spans)))
    return out


def _row(attn: Tensor, batch: PackedBatch, row: int) -> Tensor:
    """attn (B | 1, ..., T, T) -> the map of packed row ``row`` (..., T, T)."""
    if attn.shape[0] == batch.shape[0]:
        return attn[row]
    if attn.shape[0] == 1 and row == 0:
        return attn[0]
    raise ValueError(f"an attention map of {attn.shape[0]} rows does not fit a batch of {batch.shape[0]} rows")


def document_attention(attn: Tensor, batch: PackedBatch, document: int) -> Tensor:
    """Document ``document``'s own block of a packed map: attn (B, ..., T, T) -> (..., n, n), n its tokens."""
    span = packed_layout(batch)[document]
    return _row(attn, batch, span.row)[..., span.start:span.stop, span.start:span.stop]


def _tokens(span: DocumentSpan, which: str | int) -> Tensor:
    """Row positions of a document's tokens: a modality (all its segments, in order) or the k-th segment."""
    if isinstance(which, int):
        s = span.segments[which]
        return torch.arange(s.start, s.stop)
    picked = [torch.arange(s.start, s.stop) for s in span.segments if s.modality == which]
    if not picked:
        raise ValueError(f"document {span.document} ({span.key!r}) has no {which!r} segment; it has "
                         f"{[s.modality for s in span.segments]}")
    return torch.cat(picked)


def segment_attention(attn: Tensor, batch: PackedBatch, document: int, query: str | int, key: str | int) -> Tensor:
    """How document ``document``'s ``query`` tokens attend to its ``key`` tokens: attn (B, ..., T, T) ->
    (..., n_query, n_key). query/key: a modality name (every segment of it in the document, in order) or
    the index of a segment in the document (0 = its first). E.g. text-to-image attention of document 3:
    ``segment_attention(rec.attention["trunk.blocks.1.attn"], batch, 3, "text", "image")``."""
    span = packed_layout(batch)[document]
    m = _row(attn, batch, span.row)
    q, k = _tokens(span, query).to(m.device), _tokens(span, key).to(m.device)
    return m[..., q, :][..., :, k]
