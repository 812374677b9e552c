"""Packing variable-length multimodal samples into one sequence, and the masks that keep them apart.

A packed batch is (B, T) tokens made of many documents (samples) laid end to end, each a run of
segments. Per token it carries a document id, a global segment id, a position and a role flag.
The attention rule, one formula for every path:

    q may attend k  <=>  same document
                         and ( k's segment is earlier than q's            (prefix: earlier spans)
                               or same segment and (bidirectional or k <= q) )

so image/audio spans are bidirectional inside, text/actions causal, a transcript after its audio is
a prefix-LM, and no token ever sees another sample. Padding tokens form their own document (-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from omni.attention_patterns import LayerMasks, Layout, Schedule, base_blocks, block_tables, layer_masks
from omni.segment import Role, Sample

BLOCK_SIZE = 128  # FlexAttention's tile: packed rows are padded to a multiple of it


@dataclass
class PackedBatch:
    """Tokens of many samples packed into (B, T), grouped per modality for the embedders.

    tokens[m]    (N_m, ...) the modality's tokens, concatenated in packing order
    index[m]     (N_m,)     flat index of each of those tokens into B*T
    targets[m]   (N_m, ...) per-token targets where the segments supplied them
    segment_of[m] (N_m,)    which of that modality's segments (0..S_m-1) each token belongs to
    positions    (B, T, 2)  offset per document so later segments continue after earlier ones
    document     (B, T)     document (sample) number, -1 for padding
    segment      (B, T)     global segment number, -1 for padding
    causal       (B, T)     True where the token's segment is causal
    keys/labels             per document, in document order
    segment_document[m] (S_m,) document of each segment of modality m
    """

    tokens: dict[str, Tensor]
    index: dict[str, Tensor]
    targets: dict[str, Tensor]
    segment_of: dict[str, Tensor]
    segment_document: dict[str, Tensor]
    positions: Tensor
    document: Tensor
    segment: Tensor
    causal: Tensor
    keys: list[str] = field(default_factory=list)
    labels: list[Any] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.document.shape)  # type: ignore[return-value]

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int((self.document >= 0).sum())

    @property
    def num_documents(self) -> int:
        return len(self.keys)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedBatch":
        def move(d: dict[str, Tensor]) -> dict[str, Tensor]:
            return {k: v.to(device, non_blocking=non_blocking) for k, v in d.items()}

        return PackedBatch(
            tokens=move(self.tokens), index=move(self.index), targets=move(self.targets),
            segment_of=move(self.segment_of), segment_document=move(self.segment_document),
            positions=self.positions.to(device, non_blocking=non_blocking),
            document=self.document.to(device, non_blocking=non_blocking),
            segment=self.segment.to(device, non_blocking=non_blocking),
            causal=self.causal.to(device, non_blocking=non_blocking),
            keys=self.keys, labels=self.labels,
        )

    def pin_memory(self) -> "PackedBatch":
        return self.to("cpu") if not torch.cuda.is_available() else PackedBatch(
            tokens={k: v.pin_memory() for k, v in self.tokens.items()},
            index={k: v.pin_memory() for k, v in self.index.items()},
            targets={k: v.pin_memory() for k, v in self.targets.items()},
            segment_of={k: v.pin_memory() for k, v in self.segment_of.items()},
            segment_document={k: v.pin_memory() for k, v in self.segment_document.items()},
            positions=self.positions.pin_memory(), document=self.document.pin_memory(),
            segment=self.segment.pin_memory(), causal=self.causal.pin_memory(),
            keys=self.keys, labels=self.labels)

    def attention_mask(self, kind: Literal["auto", "dense", "block"] = "auto",
                       schedule: Schedule | None = None) -> Tensor | BlockMask | LayerMasks:
        """The packed mask: a FlexAttention BlockMask on CUDA ("auto"), a dense bool mask on CPU.
        Build it once per batch and hand it to every layer. ``schedule``: a trunk's attention patterns
        (``Trunk.schedule``, from TrunkConfig.attention): when sparse, per-layer masks of the packing rule AND each
        layer's pattern, BlockMasks for "auto" / "block" (FlexAttention on CUDA, the linear-memory banded path on
        the CPU), dense for "dense"."""
        if schedule is not None and schedule.sparse:
            return layer_masks(self.layout(), schedule, "dense" if kind == "dense" else "block")
        if kind == "block" or (kind == "auto" and self.document.is_cuda):
            return block_mask(self.document, self.segment, self.causal)
        return dense_mask(self.document, self.segment, self.causal)

    def layout(self) -> Layout:
        """What attention patterns read per token (omni.attention_patterns.Layout)."""
        return Layout.of(self.document, self.segment, self.causal, self.positions)


# ----------------------------------------------------------------------------------------------------
# Masks


def mask_mod(document: Tensor, segment: Tensor, causal: Tensor) -> Callable:
    """FlexAttention mask_mod implementing the packing rule (module docstring)."""

    def allowed(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        same_doc = document[b, q] == document[b, kv]
        seg_q, seg_k = segment[b, q], segment[b, kv]
        inside = (seg_k == seg_q) & (~causal[b, q] | (kv <= q))
        return same_doc & ((seg_k < seg_q) | inside)

    return allowed


def dense_mask(document: Tensor, segment: Tensor, causal: Tensor) -> Tensor:
    """(B, 1, T, T) bool: the same rule as mask_mod, materialised (CPU path and reference)."""
    T = document.shape[1]
    q = torch.arange(T, device=document.device)
    same_doc = document[:, :, None] == document[:, None, :]
    seg_q, seg_k = segment[:, :, None], segment[:, None, :]
    inside = (seg_k == seg_q) & (~causal[:, :, None] | (q[None, None, :] <= q[None, :, None]))
    return (same_doc & ((seg_k < seg_q) | inside))[:, None]


def block_mask(document: Tensor, segment: Tensor, causal: Tensor, block_size: int = BLOCK_SIZE) -> BlockMask:
    """FlexAttention BlockMask for the packing rule, built from per-block summaries.

    ``create_block_mask`` evaluates mask_mod on all T x T pairs (7.8 ms at T = 33.8k on an H100 after a
    6 s compile). Here a (tile x tile) pair is classified from its blocks' document/segment summaries
    when both blocks hold a single segment — the common case — and only pairs touching a block that
    straddles a segment boundary (at most one per boundary) are evaluated token by token
    (``omni.attention_patterns.base_blocks``, the table every attention pattern starts from).
    tests/test_packing.py checks it against create_block_mask.
    """
    B, T = document.shape
    if T % block_size:
        raise ValueError(f"sequence length {T} is not a multiple of the block size {block_size}")
    no_grid = torch.zeros(B, T, 2, dtype=torch.long, device=document.device)  # the packing rule reads no position
    full, partial = base_blocks(Layout.of(document, segment, causal, no_grid), block_size)
    return BlockMask.from_kv_blocks(*block_tables(partial, full), BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod(document, segment, causal), seq_lengths=(T, T))


# ----------------------------------------------------------------------------------------------------
# The packer


class Packer:
    """Collate samples (lists of segments) into a PackedBatch.

    row_length=None: one row holding every sample, padded to a multiple of ``block_size``
                     (no padding beyond the final block).
    row_length=L:    rows of exactly L tokens (fixed shapes for compiled training), filled
                     first-fit-decreasing; a sample longer than L raises, naming its key.
    Segment positions are offset per document: each segment starts one past the largest
    position of the segments before it in the same document.
    """

    def __init__(self, row_length: int | None = None, block_size: int = BLOCK_SIZE, max_rows: int | None = None) -> None:
        if row_length is not None and row_length % block_size:
            raise ValueError(f"row_length {row_length} must be a multiple of block_size {block_size}")
        self.row_length, self.block_size, self.max_rows = row_length, block_size, max_rows

    def rows_for(self, samples: Sequence[Sample]) -> list[list[int]]:
        """Assign sample indices to rows."""
        lengths = [len(s) for s in samples]
        if self.row_length is None:
            return [list(range(len(samples)))]
        for s, n in zip(samples, lengths):
            if n > self.row_length:
                raise ValueError(f"sample {s.key!r} has {n} tokens, more than the packing row_length {self.row_length}")
        rows: list[list[int]] = []
        free: list[int] = []
        for i in sorted(range(len(samples)), key=lambda i: -lengths[i]):
            for r, room in enumerate(free):
                if lengths[i] <= room:
                    rows[r].append(i)
                    free[r] -= lengths[i]
                    break
            else:
                rows.append([i])
                free.append(self.row_length - lengths[i])
        if self.max_rows is not None and len(rows) > self.max_rows:
            raise ValueError(f"{len(samples)} samples need {len(rows)} rows of {self.row_length}, more than max_rows {self.max_rows}")
        return [sorted(r) for r in rows]

    def __call__(self, samples: Sequence[Sample]) -> PackedBatch:
        if not samples:
            raise ValueError("cannot pack an empty list of samples")
        rows = self.rows_for(samples)
        if self.row_length is None:
            T = self.block_size * math.ceil(sum(len(s) for s in samples) / self.block_size)
        else:
            T = self.row_length
        B = len(rows)
        positions = torch.zeros(B, T, 2, dtype=torch.long)
        document = torch.full((B, T), -1, dtype=torch.long)
        segment = torch.full((B, T), -1, dtype=torch.long)
        causal = torch.zeros(B, T, dtype=torch.bool)
        tokens: dict[str, list[Tensor]] = {}
        index: dict[str, list[Tensor]] = {}
        targets: dict[str, list[Tensor]] = {}
        seg_of: dict[str, list[Tensor]] = {}
        seg_doc: dict[str, list[int]] = {}
        keys, labels = [], []
        n_segments = 0
        order = [i for row in rows for i in row]
        doc_of_sample = {i: d for d, i in enumerate(order)}
        for r, row in enumerate(rows):
            cursor = 0
            for i in row:
                sample, doc = samples[i], doc_of_sample[i]
                offset = 0
                for seg in sample.segments:
                    n, m = len(seg), seg.modality
                    sl = slice(cursor, cursor + n)
                    pos = seg.positions_2d + offset
                    offset = int(pos.max()) + 1
                    positions[r, sl] = pos
                    document[r, sl] = doc
                    segment[r, sl] = n_segments
                    causal[r, sl] = seg.role == Role.CAUSAL
                    if m in tokens and tokens[m][0].shape[1:] != seg.tokens.shape[1:]:
                        raise ValueError(f"sample {sample.key!r}: {m} tokens of shape {tuple(seg.tokens.shape[1:])} "
                                         f"do not match earlier ones {tuple(tokens[m][0].shape[1:])}")
                    tokens.setdefault(m, []).append(seg.tokens)
                    index.setdefault(m, []).append(torch.arange(r * T + cursor, r * T + cursor + n))
                    seg_of.setdefault(m, []).append(torch.full((n,), len(seg_doc.get(m, [])), dtype=torch.long))
                    seg_doc.setdefault(m, []).append(doc)
                    if seg.targets is not None:
                        targets.setdefault(m, []).append(seg.targets)
                    elif m in targets:
                        raise ValueError(f"sample {sample.key!r}: {m} segment has no targets but earlier ones do")
                    n_segments += 1
                    cursor += n
        for d, i in enumerate(order):
            keys.append(samples[i].key)
            labels.append(samples[i].label)
        for m, lst in targets.items():
            if len(lst) != len(tokens[m]):
                raise ValueError(f"some {m} segments have targets and some do not; targets must be all or none")
        # Dicts in modality-name order, not first-appearance order: torch.compile guards on dict key order,
        # so an order that changes from batch to batch would recompile the model (seen: every step).
        cat = lambda d: {k: torch.cat(d[k]) for k in sorted(d)}  # noqa: E731
        return PackedBatch(tokens=cat(tokens), index=cat(index), targets=cat(targets), segment_of=cat(seg_of),
                           segment_document={k: torch.tensor(seg_doc[k]) for k in sorted(seg_doc)},
                           positions=positions, document=document, segment=segment, causal=causal,
                           keys=keys, labels=labels)


def segment_mean(values: Tensor, segment_of: Tensor, n_segments: int) -> Tensor:
    """Mean of per-token values (N, d) over each segment -> (n_segments, d)."""
    sums = values.new_zeros(n_segments, values.shape[-1]).index_add_(0, segment_of, values)
    # index_add_ rather than bincount: bincount's output size depends on the data (a graph break)
    counts = values.new_zeros(n_segments).index_add_(0, segment_of, values.new_ones(segment_of.shape[0]))
    counts = counts.clamp_min(1)
    return sums / counts[:, None]

