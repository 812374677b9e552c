"""Structured sparse attention: patterns, the one mask rule they make with packing, and the linear-memory path.

A pattern is one more rule on (query, key), AND-ed with the packing rule of omni.packing (same document, earlier
segment or same segment and bidirectional-or-not-later). Patterns, with q and k the tokens' places in their row:

    Window(before, after)    k in [q - before, q + after]        1-D sliding window (after=0: causal window)
    Window2D(rows, cols)     same segment and |dr| <= rows, |dc| <= cols on the tokens' (row, col) positions
    Dilated(dilation, ...)   (q - k) % dilation == 0 within [q - before, q + after] (None: unbounded = strided)
    Global(first)            q or k among the first ``first`` tokens of its segment (CLS, summary tokens)
    Full()                   every pair (the packing rule alone)
    a | b                    Any((a, b)): either rule (a window plus global tokens: Longformer, BigBird-ish)

Patterns are frozen dataclasses that go to and from plain dicts (``to_dict`` / ``pattern_from_dict``), so they
live in ``TrunkConfig.attention`` and an export's config.json. ``TrunkConfig.attention`` holds a schedule:

    {"pattern": {"kind": "window", "before": 64, "after": 64}, "full_every": 4}   layers 3, 7, ... full
    {"layers": [<pattern dict or null>, ...]}                                     one entry per layer (null = full)
    {"kind": "window", ...}                                                       the pattern on every layer

One mask source for every backend. A pattern lowers to a fixed vector of integers (``lower``); ONE mask_mod
(``rule``) reads that vector and the batch's layout (document, segment, role, positions) as tensors, so every
pattern shares one compiled FlexAttention kernel. ``block_mask`` lists, per 128-token query block, the key
blocks the rule can reach, from per-block summaries (memory (T / 128)^2, never T x T): FlexAttention skips the
rest (CUDA, and compiled on the CPU); ``banded_attention`` is the eager path over the same tables: each query
block attends to the key blocks listed for it only, so its memory grows linearly with T for local patterns.
``dense`` is the reference (T x T) for tests and introspection.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

BLOCK = 128  # FlexAttention's tile
UNBOUNDED = 2 ** 40  # a reach no row has: "None" (unbounded) in a lowered pattern


def _count(name: str, value: Any, low: int, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        extra = " or None (unbounded)" if none_ok else ""
        raise ValueError(f"attention pattern: {name} must be an integer >= {low}{extra}, got {value!r}")


class Pattern:
    """Base of the patterns: ``a | b`` is Any((a, b)); ``to_dict`` names the kind."""

    kind = ""

    def __or__(self, other: "Pattern") -> "Any_":
        return Any_(tuple(parts(self)) + tuple(parts(other)))

    def to_dict(self) -> dict:
        return {"kind": self.kind, **asdict(self)}  # type: ignore[call-overload]


@dataclass(frozen=True)
class Window(Pattern):
    """Keys within ``before`` tokens before and ``after`` tokens after the query (None: unbounded that side)."""

    before: int | None = 0
    after: int | None = 0
    kind = "window"

    def __post_init__(self) -> None:
        _count("window before", self.before, 0, none_ok=True)
        _count("window after", self.after, 0, none_ok=True)
        if self.before == 0 and self.after == 0:
            raise ValueError("attention pattern: a window of 0 (before=0, after=0) lets a token see only itself")


@dataclass(frozen=True)
class Window2D(Pattern):
    """Keys of the query's own segment within ``rows`` rows and ``cols`` columns on the (row, col) positions."""

    rows: int = 1
    cols: int = 1
    kind = "window2d"

    def __post_init__(self) -> None:
        _count("window2d rows", self.rows, 0)
        _count("window2d cols", self.cols, 0)
        if self.rows == 0 and self.cols == 0:
            raise ValueError("attention pattern: a window2d of 0 rows and 0 cols lets a token see only itself")


@dataclass(frozen=True)
class Dilated(Pattern):
    """Every ``dilation``-th key (q - k divisible by it) within [q - before, q + after]; None: unbounded (strided)."""

    dilation: int = 2
    before: int | None = None
    after: int | None = None
    kind = "dilated"

    def __post_init__(self) -> None:
        _count("dilated dilation", self.dilation, 2)
        _count("dilated before", self.before, 0, none_ok=True)
        _count("dilated after", self.after, 0, none_ok=True)
        short = [n for n in (self.before, self.after) if n is not None and n < self.dilation]
        if len(short) == 2:
            raise ValueError(f"attention pattern: a dilated reach of before={self.before}, after={self.after} under its "
                             f"dilation {self.dilation} lets a token see only itself")


@dataclass(frozen=True)
class Global(Pattern):
    """The first ``first`` tokens of every segment see, and are seen by, every token (the packing rule still
    applies: no other document, no later token in a causal segment). Alone it lets other tokens see no key of
    their own: combine it with a local pattern (``Window(...) | Global(1)``)."""

    first: int = 1
    kind = "global"

    def __post_init__(self) -> None:
        _count("global first", self.first, 1)


@dataclass(frozen=True)
class Full(Pattern):
    """Every pair the packing rule allows."""

    kind = "full"


@dataclass(frozen=True)
class Any_(Pattern):
    """Either rule. At most one part of each kind (two windows are one window: use the larger)."""

    parts: tuple[Pattern, ...] = ()
    kind = "any"

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("attention pattern: 'any' needs at least one part")
        kinds = [p.kind for p in self.parts]
        for k in set(kinds):
            if kinds.count(k) > 1:
                raise ValueError(f"attention pattern: 'any' has {kinds.count(k)} {k!r} parts; give one")

    def to_dict(self) -> dict:
        return {"kind": "any", "of": [p.to_dict() for p in self.parts]}


def parts(p: Pattern) -> list[Pattern]:
    """The rules of ``p`` (its parts for ``a | b``, else ``[p]``)."""
    return list(p.parts) if isinstance(p, Any_) else [p]


KINDS: dict[str, type[Pattern]] = {c.kind: c for c in (Window, Window2D, Dilated, Global, Full, Any_)}


def pattern_from_dict(d: Mapping[str, Any]) -> Pattern:
    """A Pattern from its dict ({"kind": "window", "before": 64, "after": 0}, {"kind": "any", "of": [...]})."""
    if isinstance(d, Pattern):
        return d
    if not isinstance(d, Mapping) or "kind" not in d:
        raise ValueError(f"attention pattern: expected a dict with a 'kind' ({', '.join(KINDS)}), got {d!r}")
    kind, rest = d["kind"], {k: v for k, v in d.items() if k != "kind"}
    if kind not in KINDS:
        raise ValueError(f"attention pattern: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    if kind == "any":
        if set(rest) != {"of"} or not isinstance(rest["of"], (list, tuple)):
            raise ValueError(f"attention pattern 'any' takes one entry 'of': a list of patterns, got {sorted(rest)}")
        return Any_(tuple(pattern_from_dict(p) for p in rest["of"]))
    names = {f.name for f in fields(KINDS[kind])}
    if set(rest) - names:
        raise ValueError(f"attention pattern {kind!r}: unknown entries {sorted(set(rest) - names)}; "
                         f"it takes {', '.join(sorted(names)) or 'none'}")
    return KINDS[kind](**rest)


def check_causal(attention: Mapping[str, Any] | Pattern | None, n_layers: int,
                 what: str = "this model is causal") -> None:
    """ValueError in one line for a schedule (TrunkConfig.attention) that leaves a causal token only itself: a layer
    whose every rule is a window or dilated reach with nothing before the query (its ``after`` keys are later tokens,
    which a causal token never sees). ``what`` says why the tokens are causal."""
    for i, p in enumerate(schedule_from_config(attention, n_layers).layers):
        rules = [] if p is None else parts(p)
        if rules and all(isinstance(q, (Window, Dilated)) and q.before is not None
                         and q.before < (q.dilation if isinstance(q, Dilated) else 1) for q in rules):
            raise ValueError(f"trunk_overrides.attention: layer {i}'s pattern {p.to_dict()} reaches no earlier token "
                             f"and {what} (a token never sees later ones), so each token would see only itself: give "
                             "before >= 1")


def sees_itself(p: Pattern) -> bool:
    """Whether the rule lets every token see itself (else a query may be left with no key)."""
    return any(not isinstance(q, Global) for q in parts(p))


# ----------------------------------------------------------------------------------------------------
# Per-layer schedule (TrunkConfig.attention)


@dataclass(frozen=True)
class Schedule:
    """One pattern per layer, None = full attention (the packing rule alone; the fast SDPA paths)."""

    layers: tuple[Pattern | None, ...]

    @property
    def sparse(self) -> bool:
        return any(p is not None for p in self.layers)


def schedule_from_config(spec: Mapping[str, Any] | Pattern | None, n_layers: int) -> Schedule:
    """The per-layer patterns of ``TrunkConfig.attention`` (see the module docstring); ValueError in one line."""
    if spec is None:
        return Schedule((None,) * n_layers)
    if isinstance(spec, Pattern) or (isinstance(spec, Mapping) and "kind" in spec):
        spec = {"pattern": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"attention: expected a dict ({{'pattern': ..., 'full_every': k}} or {{'layers': [...]}}), "
                         f"got {spec!r}")
    if "layers" in spec:
        if set(spec) != {"layers"}:
            raise ValueError(f"attention: 'layers' goes alone, got entries {sorted(spec)}")
        given = spec["layers"]
        if not isinstance(given, (list, tuple)) or len(given) != n_layers:
            raise ValueError(f"attention.layers: expected a list of {n_layers} patterns (one per layer, null = full), "
                             f"got {given!r}")
        layers = [None if p is None else pattern_from_dict(p) for p in given]
    else:
        if set(spec) - {"pattern", "full_every"} or "pattern" not in spec:
            raise ValueError(f"attention: expected entries 'pattern' and optionally 'full_every', got {sorted(spec)}")
        every = spec.get("full_every", 0)
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"attention.full_every must be an integer >= 0 (0: no full layer), got {every!r}")
        p = pattern_from_dict(spec["pattern"])
        layers = [None if every and (i + 1) % every == 0 else p for i in range(n_layers)]
    out = []
    for i, p in enumerate(layers):
        if p is not None and not sees_itself(p):
            raise ValueError(f"attention: layer {i}'s pattern {p.to_dict()} leaves a token that is not global with no "
                             "key: combine 'global' with a window")
        out.append(None if isinstance(p, Full) else p)
    return Schedule(tuple(out))


def normalise_config(spec: Mapping[str, Any] | Pattern | None, n_layers: int) -> dict | None:
    """``TrunkConfig.attention`` as the plain dict its config.json keeps (validated; None stays None)."""
    if spec is None:
        return None
    schedule_from_config(spec, n_layers)  # raises on a bad spec
    if isinstance(spec, Pattern) or (isinstance(spec, Mapping) and "kind" in spec):
        spec = {"pattern": spec}
    if "layers" in spec:
        return {"layers": [None if p is None else pattern_from_dict(p).to_dict() for p in spec["layers"]]}
    return {"pattern": pattern_from_dict(spec["pattern"]).to_dict(), "full_every": spec.get("full_every", 0)}


# ----------------------------------------------------------------------------------------------------
# Lowering: every pattern as the same fixed vector, read by one mask_mod

# [full, win_on, win_before, win_after, dil_on, dilation, dil_before, dil_after, w2_on, rows, cols, global_first]
N_PARAMS = 12


def lower(p: Pattern | None) -> list[int]:
    """A pattern as N_PARAMS integers (None and Full: the full flag)."""
    out = [0] * N_PARAMS
    out[5] = 1  # a dilation to divide by when the dilated part is off
    if p is None:
        out[0] = 1
        return out
    for part in parts(p):
        reach = lambda n: UNBOUNDED if n is None else n  # noqa: E731
        if isinstance(part, Full):
            out[0] = 1
        elif isinstance(part, Window):
            out[1:4] = [1, reach(part.before), reach(part.after)]
        elif isinstance(part, Dilated):
            out[4:8] = [1, part.dilation, reach(part.before), reach(part.after)]
        elif isinstance(part, Window2D):
            out[8:11] = [1, part.rows, part.cols]
        elif isinstance(part, Global):
            out[11] = part.first
    return out


@dataclass
class Layout:
    """What the rule reads per token, (B, T) each: document (-1 padding), segment, causal role, (row, col)
    positions (B, T, 2), and ``start``: the place of the token's segment's first token in the row."""

    document: Tensor
    segment: Tensor
    causal: Tensor
    positions: Tensor
    start: Tensor

    @classmethod
    def of(cls, document: Tensor, segment: Tensor, causal: Tensor, positions: Tensor) -> "Layout":
        B, T = document.shape
        idx = torch.arange(T, device=document.device).expand(B, T)
        new = torch.ones_like(segment, dtype=torch.bool)
        new[:, 1:] = (segment[:, 1:] != segment[:, :-1]) | (document[:, 1:] != document[:, :-1])
        start = torch.where(new, idx, torch.zeros_like(idx)).cummax(1).values
        return cls(document, segment, causal.bool(), positions.long(), start)

    @classmethod
    def single(cls, positions: Tensor, causal: bool) -> "Layout":
        """An unpacked batch: each row one document of one segment (bidirectional, or causal)."""
        B, T = positions.shape[:2]
        zeros = torch.zeros(B, T, dtype=torch.long, device=positions.device)  # two tensors: compiled Flex guards on
        return cls.of(zeros, zeros.clone(), torch.full((B, T), causal, device=positions.device), positions)  # aliasing

    @property
    def length(self) -> int:
        return self.document.shape[1]

    def padded(self, n: int) -> "Layout":
        """Padded to n tokens with a document of its own (-2): what mask_mod reads past the end of a block."""
        extra = n - self.length
        if extra <= 0:
            return self
        pad = lambda t, v: F.pad(t, (0, 0, 0, extra) if t.dim() == 3 else (0, extra), value=v)  # noqa: E731
        return Layout(pad(self.document, -2), pad(self.segment, -2), pad(self.causal, False),
                      pad(self.positions, 0), F.pad(self.start, (0, extra), value=self.length))


def rule(layout: Layout, params: Tensor) -> Callable:
    """The mask_mod: packing rule AND the lowered pattern ``params`` (N_PARAMS,) long. Every pattern and layout
    is the same code reading tensors, so compiled FlexAttention compiles it once per shape."""
    doc, seg, causal, start = layout.document, layout.segment, layout.causal, layout.start
    row, col = layout.positions[..., 0].contiguous(), layout.positions[..., 1].contiguous()  # own buffers: compiled CPU Flex

    def allowed(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        sq, sk = seg[b, q], seg[b, kv]
        inside = (sk == sq) & (~causal[b, q] | (kv <= q))
        packed = (doc[b, q] == doc[b, kv]) & ((sk < sq) | inside)
        d = q - kv
        win = (params[1] > 0) & (d <= params[2]) & (d >= -params[3])
        dil = (params[4] > 0) & (d <= params[6]) & (d >= -params[7]) & (torch.remainder(d, params[5]) == 0)
        grid = ((params[8] > 0) & (sk == sq) & ((row[b, q] - row[b, kv]).abs() <= params[9])
                & ((col[b, q] - col[b, kv]).abs() <= params[10]))
        glob = ((q - start[b, q]) < params[11]) | ((kv - start[b, kv]) < params[11])
        return packed & ((params[0] > 0) | win | dil | grid | glob)

    return allowed


def dense(layout: Layout, pattern: Pattern | None) -> Tensor:
    """(B, 1, T, T) bool: the rule materialised (the reference; quadratic memory)."""
    B, T = layout.document.shape
    dev = layout.document.device
    params = torch.tensor(lower(pattern), device=dev)
    b = torch.arange(B, device=dev)[:, None, None]
    i = torch.arange(T, device=dev)
    return rule(layout, params)(b, 0, i[None, :, None], i[None, None, :])[:, None]


# ----------------------------------------------------------------------------------------------------
# Block tables


def base_blocks(layout: Layout, bs: int) -> tuple[Tensor, Tensor]:
    """(full, partial) (B, nb, nb) of the packing rule alone for ``layout`` (length a multiple of bs), exact:
    a pair is full when every token pair is allowed, partial when some are. Single-segment blocks are classified
    from their summaries; pairs touching a block that holds several segments token by token (bounded chunks)."""
    B, T = layout.document.shape
    nb, dev = T // bs, layout.document.device
    doc, seg = layout.document.view(B, nb, bs), layout.segment.view(B, nb, bs)
    pure = (seg == seg[..., :1]).all(-1) & (doc == doc[..., :1]).all(-1)
    s0, d0, c0 = seg[..., 0], doc[..., 0], layout.causal.view(B, nb, bs)[..., 0]
    qi = torch.arange(nb, device=dev)
    same_doc = d0[:, :, None] == d0[:, None, :]
    earlier = s0[:, None, :] < s0[:, :, None]
    same_seg = s0[:, None, :] == s0[:, :, None]
    below, diag = qi[None, :, None] > qi[None, None, :], qi[None, :, None] == qi[None, None, :]
    full = same_doc & (earlier | (same_seg & (~c0[:, :, None] | below)))
    partial = same_doc & same_seg & c0[:, :, None] & diag
    mixed = ~pure
    if bool(mixed.any()):
        lo, hi = doc.min(-1).values, doc.max(-1).values
        overlap = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
        clear = mixed[:, :, None] | mixed[:, None, :]
        todo = overlap & clear
        full &= ~clear
        partial &= ~clear
        b, i, j = todo.nonzero(as_tuple=True)
        params = torch.tensor(lower(None), device=dev)
        allowed = rule(layout, params)
        ar = torch.arange(bs, device=dev)
        for s in range(0, b.numel(), 4096):  # bounded memory: 4096 tiles of bs^2 bools
            bb, ii, jj = b[s:s + 4096], i[s:s + 4096], j[s:s + 4096]
            q = (ii[:, None] * bs + ar)[:, :, None]
            k = (jj[:, None] * bs + ar)[:, None, :]
            ok = allowed(bb[:, None, None], 0, q, k).flatten(1)
            full[bb, ii, jj] = ok.all(-1)
            partial[bb, ii, jj] = ok.any(-1) & ~ok.all(-1)
    return full, partial


def pattern_blocks(layout: Layout, pattern: Pattern | None, bs: int) -> tuple[Tensor, Tensor]:
    """(may, every) (B, nb, nb): whether the pattern alone can allow some / surely allows every pair of a
    (query block, key block) tile, from per-block ranges (conservative `may`, sound `every`)."""
    B, T = layout.document.shape
    nb, dev = T // bs, layout.document.device
    lo = torch.arange(nb, device=dev) * bs
    hi = lo + bs - 1
    dmin = (lo[:, None] - hi[None, :])[None]  # (1, nb, nb) smallest q - k of the tile
    dmax = (hi[:, None] - lo[None, :])[None]
    false = torch.zeros(B, nb, nb, dtype=torch.bool, device=dev)
    p = lower(pattern)
    if p[0]:
        return ~false, ~false
    may, every = false.clone(), false.clone()
    if p[1]:  # window: q - k in [-after, before]
        may |= (dmax >= -p[3]) & (dmin <= p[2])
        every |= (dmin >= -p[3]) & (dmax <= p[2])
    if p[4]:
        may |= (dmax >= -p[7]) & (dmin <= p[6])  # the modulus makes no tile all-allowed (dilation >= 2)
    if p[8]:
        seg = layout.segment.view(B, nb, bs)
        smin, smax = seg.min(-1).values, seg.max(-1).values
        pos = layout.positions.view(B, nb, bs, 2)
        pmin, pmax = pos.min(2).values, pos.max(2).values  # (B, nb, 2)
        gap = (pmin[:, :, None] - pmax[:, None, :]).clamp_min(0) + (pmin[:, None, :] - pmax[:, :, None]).clamp_min(0)
        span = torch.maximum(pmax[:, :, None] - pmin[:, None, :], pmax[:, None, :] - pmin[:, :, None])
        seg_may = (smin[:, :, None] <= smax[:, None, :]) & (smin[:, None, :] <= smax[:, :, None])
        one = (smin == smax)
        seg_all = one[:, :, None] & one[:, None, :] & (smin[:, :, None] == smin[:, None, :])
        may |= seg_may & (gap[..., 0] <= p[9]) & (gap[..., 1] <= p[10])
        every |= seg_all & (span[..., 0] <= p[9]) & (span[..., 1] <= p[10])
    if p[11]:
        idx = torch.arange(T, device=dev)
        g = ((idx - layout.start) < p[11]).view(B, nb, bs)
        has, allg = g.any(-1), g.all(-1)
        may |= has[:, :, None] | has[:, None, :]
        every |= allg[:, :, None] | allg[:, None, :]
    return may, every


def block_mask(layout: Layout, pattern: Pattern | None, bs: int = BLOCK) -> BlockMask:
    """The BlockMask of the packing rule AND ``pattern``: full tiles, partial tiles (mask_mod evaluated) and the
    rest skipped. Any length T (the layout is padded to whole blocks; seq_lengths stay T)."""
    T = layout.length
    nb = math.ceil(T / bs)
    padded = layout.padded(nb * bs)
    base_full, base_part = base_blocks(padded, bs)
    may, every = pattern_blocks(padded, pattern, bs)
    full = base_full & every
    partial = (base_full | base_part) & may & ~full
    params = torch.tensor(lower(pattern), device=layout.document.device)

    return BlockMask.from_kv_blocks(*block_tables(partial, full), BLOCK_SIZE=bs, mask_mod=rule(padded, params),
                                    seq_lengths=(T, T))


def block_tables(partial: Tensor, full: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """BlockMask.from_kv_blocks's (kv_num, kv_idx, full_num, full_idx) from (B, nb, nb) partial / full tiles."""

    def table(blocks: Tensor) -> tuple[Tensor, Tensor]:
        counts = blocks.sum(-1, dtype=torch.int32)  # (B, nb)
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # listed first
        return counts[:, None], order[:, None]  # (B, 1, nb), (B, 1, nb, nb)

    return *table(partial), *table(full)


class LayerMasks(tuple):
    """One trunk mask per layer (omni.trunk.Mask each): what a trunk with an attention schedule takes."""


def layer_masks(layout: Layout, schedule: Schedule, kind: str = "block",
                full: Any = "same") -> LayerMasks:
    """Per-layer masks for ``schedule``: BlockMasks ("block") or dense bool (B, 1, T, T) ("dense"); a layer of
    full attention gets ``full`` when given (an SDPA mask: None / "causal" for an unpacked batch), else the
    same kind of mask for the packing rule alone. Layers with the same pattern share one mask object."""
    made: dict[Any, Any] = {}
    out = []
    for p in schedule.layers:
        if p is None and full != "same":
            out.append(full)
            continue
        key = tuple(lower(p))
        if key not in made:
            made[key] = block_mask(layout, p) if kind == "block" else dense(layout, p)
        out.append(made[key])
    return LayerMasks(out)


def pattern_masks(schedule: Schedule, mask: Any, positions: Tensor) -> LayerMasks:
    """A trunk's per-layer masks for an unpacked call: the schedule's patterns AND the call's mask (None,
    "causal" or bool (B|1, 1|H, T, T)); positions (B, T, 2). Packed batches bring theirs
    (PackedBatch.attention_mask(schedule=...)); a LayerMasks passes through."""
    if isinstance(mask, LayerMasks):
        if len(mask) != len(schedule.layers):
            raise ValueError(f"{len(mask)} layer masks for a trunk of {len(schedule.layers)} layers")
        return mask
    if isinstance(mask, BlockMask):
        raise ValueError("a trunk with attention patterns takes a packed batch's masks from "
                         "PackedBatch.attention_mask(schedule=trunk.schedule), not one BlockMask")
    if mask is None or isinstance(mask, str):  # one BlockMask per pattern; full layers keep SDPA's fast paths
        if mask is not None and mask != "causal":
            raise ValueError(f"unknown mask {mask!r}; use None, 'causal', a bool tensor or a BlockMask")
        return layer_masks(Layout.single(positions, mask == "causal"), schedule, "block", full=mask)
    layout = Layout.single(positions, causal=False)  # a caller's dense mask stays dense
    return LayerMasks(mask if p is None else mask & dense(layout, p) for p in schedule.layers)


# ----------------------------------------------------------------------------------------------------
# Decoding: a KV cache whose windowed layers keep a ring of their window


def _decode_rule(params: list[int], qa: Tensor, ka: Tensor) -> Tensor:
    """The pattern on absolute token places (one causal stream, as decoding makes): qa, ka broadcastable."""
    full, win, before, after, dil, dilation, dbefore, dafter, grid, _, _, first = params
    d = qa - ka
    ok = torch.full(torch.broadcast_shapes(qa.shape, ka.shape), bool(full), device=qa.device)
    if win:
        ok |= (d <= before) & (d >= -after)
    if dil:
        ok |= (d <= dbefore) & (d >= -dafter) & (torch.remainder(d, dilation) == 0)
    if first:
        ok |= (qa < first) | (ka < first)
    return ok


def pin_cross(cache: Any) -> None:
    """Hold a KV cache's cross-attention K/V (``cache.cross``) at the same addresses from batch to batch (a captured
    CUDA graph reads them, and the decoding loop pins them on every batch): the first call keeps the tensors
    computed since ``reset`` in ``cache.pinned``, later calls copy the new batch's K/V into those."""
    if cache.pinned is None:
        cache.pinned = list(cache.cross)
    else:
        for new, held in zip(cache.cross, cache.pinned):
            if new is not None and held is not None:
                held[0].copy_(new[0])
                held[1].copy_(new[1])
    cache.cross = list(cache.pinned)


@dataclass
class RingKVCache:
    """The KV cache of a trunk with attention patterns (``Trunk.new_cache`` makes it). A layer whose pattern
    reaches a bounded ``before`` tokens back keeps a ring of those ``before`` keys (plus the ``first`` global
    tokens of a Global part, pinned): its memory stays fixed however long generation runs. A full layer (or an
    unbounded one) keeps every key, up to ``max_length``. Each call attends over [the layer's buffer | the new
    tokens] with the pattern's rule, then writes the new keys in; the outputs equal a full recompute with the same
    mask (tests/test_attention_patterns.py). The Python-int path and ``cache_position`` (the decoding loop's; the
    ring's bookkeeping then syncs with the host, so it is not CUDA-graphed); 1-D patterns only (a 2-D window needs
    a grid, which decoding has not).

    Trunk API as omni.trunk.KVCache: ``length``, ``cross``, ``pin_cross``, ``reset``, ``reorder``, ``real_tokens``,
    ``update``, ``attention_mask`` (not ``rollback``: speculative decoding refuses a ring cache in one line)."""

    k: list[Tensor]  # per layer (B, G, C_l, D): C_l = the layer's capacity
    v: list[Tensor]
    pos: list[Tensor]  # per layer (C_l,) long: the token place held by each slot, -1 = empty
    valid: list[Tensor]  # per layer (B, C_l) bool: slot written by a real (non-pad) token
    params: list[list[int]]  # per layer: the lowered pattern
    ring: list[tuple[int, int]]  # per layer (pinned first tokens, ring size); ring size -1 = no ring (keep all)
    max_length: int
    length: int = 0
    real: Tensor | None = None  # (B,) real tokens written
    cross: list = None  # type: ignore[assignment]
    plan: tuple[Tensor, Tensor, Tensor] | None = None  # this call's writes: new-token index, slot, row valid
    pinned: list | None = field(default=None, repr=False)  # see pin_cross

    def pin_cross(self) -> None:
        """Keep the cross K/V at fixed addresses from batch to batch, as ``KVCache.pin_cross``."""
        pin_cross(self)

    @classmethod
    def empty(cls, schedule: Schedule, kv_heads: int, head_dim: int, batch_size: int, max_length: int,
              device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> "RingKVCache":
        ks, vs, pos, valid, params, ring = [], [], [], [], [], []
        for p in schedule.layers:
            lp = lower(p)
            if lp[8]:
                raise ValueError("attention: a window2d layer cannot decode with a KV cache (decoding has no grid)")
            reach = max(lp[2] if lp[1] else 0, lp[6] if lp[4] else 0)
            keep_all = lp[0] or reach >= UNBOUNDED
            first = 0 if keep_all else lp[11]
            size = max_length if keep_all else first + reach
            ks.append(torch.zeros(batch_size, kv_heads, size, head_dim, device=device, dtype=dtype))
            vs.append(torch.zeros_like(ks[-1]))
            pos.append(torch.full((size,), -1, dtype=torch.long, device=device))
            valid.append(torch.zeros(batch_size, size, dtype=torch.bool, device=device))
            params.append(lp)
            ring.append((first, -1 if keep_all else reach))
        return cls(ks, vs, pos, valid, params, ring, max_length, real=torch.zeros(batch_size, dtype=torch.long,
                   device=device), cross=[None] * len(ks))

    def nbytes(self) -> int:
        """Bytes held by the self-attention buffers (fixed when every layer is windowed)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self) -> None:
        for t in self.k + self.v:
            t.zero_()
        for p, val in zip(self.pos, self.valid):
            p.fill_(-1)
            val.zero_()
        self.length, self.plan, self.cross = 0, None, [None] * len(self.k)
        self.real.zero_()  # type: ignore[union-attr]

    def reorder(self, index: Tensor) -> None:
        """Row i takes row ``index[i]``'s state, in place (beam search); cross K/V stay."""
        for t in self.k + self.v + self.valid + [self.real]:
            t.copy_(t.index_select(0, index))

    def real_tokens(self) -> Tensor:
        return self.real.clone()  # type: ignore[union-attr]

    def _slots(self, layer: int, places: Tensor) -> Tensor:
        """Where token places go in a layer's buffer (-1: not kept)."""
        first, size = self.ring[layer]
        if size < 0:
            return places
        ring = first + (places - first).remainder(max(size, 1))
        return torch.where(places < first, places, ring if size > 0 else torch.full_like(places, -1))

    def attention_mask(self, T: int, new_mask: Any, pad: Tensor | None, slots: Tensor | None = None) -> LayerMasks:
        """Per-layer masks (B, 1, T, C_l + T) for T new tokens over [buffer | new]; records where they go. The new
        tokens' places follow ``length``, or are ``slots`` (T,) = p .. p+T-1 (Trunk's cache_position: the decoding
        loop's device-side place; a layer that keeps every key then indexes its buffer by place, as KVCache)."""
        B, dev = self.valid[0].shape[0], self.valid[0].device
        if slots is None:
            start = self.length
            if any(size < 0 for _, size in self.ring) and start + T > self.max_length:
                raise ValueError(f"KV cache overflow: {start} cached + {T} new > max_length {self.max_length}")
        if new_mask is None or new_mask == "causal":
            block = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None, None]
        elif isinstance(new_mask, str) and new_mask == "full":
            block = torch.ones(1, 1, T, T, dtype=torch.bool, device=dev)
        elif isinstance(new_mask, Tensor):
            block = new_mask
        else:
            raise TypeError(f"with a KV cache the mask must be None/'causal'/'full' or a bool tensor, got {new_mask!r}")
        real = torch.ones(B, T, dtype=torch.bool, device=dev) if pad is None else ~pad
        qa = torch.arange(start, start + T, device=dev) if slots is None else slots.to(dev, torch.long).reshape(T)
        own = torch.eye(T, dtype=torch.bool, device=dev)  # a pad query that sees nothing sees its own slot
        masks = []
        for layer, p in enumerate(self.params):
            old = self.valid[layer][:, None, None, :] & _decode_rule(p, qa[:, None], self.pos[layer][None, :])
            new = block & real[:, None, None, :] & _decode_rule(p, qa[:, None], qa[None, :])
            masks.append(torch.cat([old.expand(B, 1, T, -1), new.expand(B, 1, T, T) | own], -1))
            slot = self._slots(layer, qa)  # later new tokens overwrite earlier ones of the same slot: keep the last
            keep = (slot >= 0) & ~((slot[:, None] == slot[None, :]) & (qa[:, None] < qa[None, :])).any(1)
            idx = keep.nonzero().flatten()
            self.pos[layer][slot[idx]] = qa[idx]
            self.valid[layer][:, slot[idx]] = real[:, idx]
            masks[-1] = (masks[-1], idx, slot[idx])
        self.plan = tuple(m[1:] for m in masks)  # type: ignore[assignment]
        self.real += real.sum(1)  # type: ignore[operator]
        return LayerMasks(m[0] for m in masks)

    def update(self, layer: int, k: Tensor, v: Tensor, slots: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """k/v (B, G, T, D) of the new tokens -> [buffer | new] (B, G, C_l + T, D); the kept ones written in."""
        keys, values = torch.cat([self.k[layer], k], 2), torch.cat([self.v[layer], v], 2)
        idx, slot = self.plan[layer]  # type: ignore[index]
        self.k[layer][:, :, slot] = k[:, :, idx].to(self.k[layer].dtype)
        self.v[layer][:, :, slot] = v[:, :, idx].to(self.v[layer].dtype)
        return keys, values
