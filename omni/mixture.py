"""The mixture of tasks as packed batches: ``MixedBatch`` (a PackedBatch whose documents carry their task),
``pack_mixed``, ``eval_batches`` (held-out items in the training shape) and ``MixtureLoader``.

Mixing (``MixtureLoader``). A batch is ``rows`` packed rows of ``row_length`` tokens (fixed shapes, so
compiled kernels see one shape). Batch ``i`` of epoch ``e`` on rank ``r`` is a pure function of
(seed, e, i, r): first ONE sample of every task (in a random order; so every batch trains every head and
logs every per-task metric, and DDP never sees unused parameters), then tasks drawn with probability
proportional to ``weight`` and a uniformly drawn item of that task, each placed first-fit into the rows,
until ``max_misses`` consecutive draws do not fit. Sampling is with replacement (a mixture has no natural
epoch; ``batches_per_epoch`` only sets the checkpoint/epoch bookkeeping). Because batches are stateless,
the loader's state is just (epoch, batches done): exact resume, and ``num_workers`` DataLoader workers can
build batches in parallel. Drop-on-miss slightly favours short samples near the end of a batch; the
per-task token share is logged (``<task>/token_share``) so the realised mixture is visible.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from omni.data.memory import EpochCursor
from omni.data.reader import leave_sigint_to_the_parent
from omni.packing import BLOCK_SIZE, PackedBatch, Packer
from omni.segment import Sample

if TYPE_CHECKING:
    from omni.tasks import Task


@dataclass
class MixedBatch(PackedBatch):
    """A PackedBatch whose documents come from several tasks: ``document_task[d]`` is the task index of
    document ``d`` (in ``task_names`` order)."""

    document_task: Tensor | None = None
    task_names: tuple[str, ...] = ()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "MixedBatch":
        base = PackedBatch.to(self, device, non_blocking)
        assert self.document_task is not None
        return MixedBatch(**{f.name: getattr(base, f.name) for f in fields(PackedBatch)},
                          document_task=self.document_task.to(device, non_blocking=non_blocking),
                          task_names=self.task_names)

    def token_task(self, modality: str) -> Tensor:
        """(N_m,) task index of every packed token of ``modality``."""
        assert self.document_task is not None
        return self.document_task[self.segment_document[modality]][self.segment_of[modality]]

    def segment_task(self, modality: str) -> Tensor:
        """(S_m,) task index of every segment of ``modality``."""
        assert self.document_task is not None
        return self.document_task[self.segment_document[modality]]


class _AssignedPacker(Packer):
    """A Packer that uses a row assignment made by the mixing loader (empty rows stay padding)."""

    def __init__(self, row_length: int, rows: list[list[int]]) -> None:
        super().__init__(row_length=row_length)
        self._rows = rows

    def rows_for(self, samples: Sequence[Sample]) -> list[list[int]]:
        return self._rows


def pack_mixed(samples: Sequence[Sample], tasks: Sequence[int], task_names: Sequence[str],
               row_length: int | None = None, rows: list[list[int]] | None = None) -> MixedBatch:
    """Pack samples (sample ``i`` from task ``tasks[i]``) into a MixedBatch: with ``rows`` (an assignment of
    sample indices to rows of ``row_length``) as given, else ``Packer(row_length)``'s own packing."""
    packer = _AssignedPacker(row_length, rows) if rows is not None else Packer(row_length=row_length)
    assignment = packer.rows_for(samples)
    order = [i for row in assignment for i in row]  # Packer numbers documents in this order
    batch = packer(samples)
    return MixedBatch(**{f.name: getattr(batch, f.name) for f in fields(PackedBatch)},
                      document_task=torch.tensor([tasks[i] for i in order], dtype=torch.long),
                      task_names=tuple(task_names))


def eval_batches(samples: Sequence[Sample], row_length: int, rows: int) -> Iterator[PackedBatch]:
    """The samples in order, placed first-fit into ``rows`` rows of ``row_length`` tokens; a batch is emitted
    when the next sample fits nowhere. Every batch has the training shape (rows, row_length), so compiled
    kernels see no new shape (the last batch is partly padding)."""
    chunk: list[Sample] = []
    assignment: list[list[int]] = [[] for _ in range(rows)]
    free = [row_length] * rows
    for s in samples:
        n = len(s)
        if n > row_length:
            raise ValueError(f"sample {s.key!r} has {n} tokens, more than row_length {row_length}")
        r = next((r for r in range(rows) if free[r] >= n), None)
        if r is None:
            yield _AssignedPacker(row_length, assignment)(chunk)
            chunk, assignment, free, r = [], [[] for _ in range(rows)], [row_length] * rows, 0
        assignment[r].append(len(chunk))
        free[r] -= n
        chunk.append(s)
    if chunk:
        yield _AssignedPacker(row_length, assignment)(chunk)


class MixtureLoader(EpochCursor):
    """Weighted mixture of tasks packed into fixed (rows, row_length) batches (module docstring).

    Rank-local and stateful (``state_dict``/``load_state_dict``/``set_epoch``), so the Trainer does not
    re-shard it and resumes it exactly. ``num_workers > 0`` builds batches in DataLoader worker processes.
    """

    def __init__(self, tasks: Sequence[Task], *, row_length: int, rows: int = 1, batches_per_epoch: int = 1000,
                 seed: int = 0, rank: int = 0, world_size: int = 1, max_misses: int = 4, num_workers: int = 0,
                 block_size: int = BLOCK_SIZE) -> None:
        if row_length % block_size:
            raise ValueError(f"row_length {row_length} must be a multiple of {block_size}")
        if rows < 1 or batches_per_epoch < 1:
            raise ValueError(f"rows and batches_per_epoch must be >= 1, got {rows}, {batches_per_epoch}")
        active = [t for t in tasks if t.weight > 0]
        if not active:
            raise ValueError("every task has weight 0: nothing to sample")
        self.tasks, self.row_length, self.rows = list(tasks), int(row_length), int(rows)
        self.batches_per_epoch, self.seed, self.rank, self.world_size = int(batches_per_epoch), seed, rank, world_size
        self.max_misses, self.num_workers = int(max_misses), int(num_workers)
        w = np.array([t.weight for t in self.tasks], dtype=np.float64)
        self.probs = w / w.sum()
        self.epoch, self.batches_done = 0, 0

    @property
    def task_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tasks)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def draw(self, epoch: int, index: int) -> tuple[list[Sample], list[int], list[list[int]]]:
        """The samples of batch ``index`` of ``epoch`` on this rank, their task indices and row assignment."""
        rng = np.random.default_rng([self.seed, epoch, index, self.rank])
        L, samples, tasks = self.row_length, [], []
        free = [L] * self.rows
        rows: list[list[int]] = [[] for _ in range(self.rows)]

        def place(t: int, required: bool) -> bool:
            task = self.tasks[t]
            s = task.sample(int(rng.integers(len(task))), rng)
            n = len(s)
            if n > L:
                raise ValueError(f"sample {s.key!r} of task {task.name!r} has {n} tokens, more than row_length {L}: "
                                 f"raise row_length or shorten the task's inputs")
            r = next((r for r in range(self.rows) if free[r] >= n), None)
            if r is None:
                if required:
                    raise ValueError(f"batch of {self.rows} x {L} tokens cannot hold one sample of every task "
                                     f"({task.name!r} did not fit): raise rows or row_length")
                return False
            rows[r].append(len(samples))
            free[r] -= n
            samples.append(s)
            tasks.append(t)
            return True

        for t in rng.permutation([i for i, task in enumerate(self.tasks) if task.weight > 0]):
            place(int(t), required=True)
        misses = 0
        while misses < self.max_misses and max(free) > 0:
            t = int(rng.choice(len(self.tasks), p=self.probs))
            misses = 0 if place(t, required=False) else misses + 1
        return samples, tasks, rows

    def batch(self, epoch: int, index: int) -> MixedBatch:
        samples, tasks, rows = self.draw(epoch, index)
        return pack_mixed(samples, tasks, self.task_names, self.row_length, rows)

    def __getitem__(self, index: int) -> MixedBatch:  # DataLoader worker entry (epoch set before iterating)
        return self.batch(self._iter_epoch, index)

    def __iter__(self) -> Iterator[MixedBatch]:
        self._iter_epoch = self.epoch
        todo = range(self.batches_done, self.batches_per_epoch)
        if self.num_workers > 0:
            it: Any = torch.utils.data.DataLoader(self, batch_size=None, sampler=list(todo), num_workers=self.num_workers,
                                                  persistent_workers=False, worker_init_fn=leave_sigint_to_the_parent)
        else:
            it = (self.batch(self.epoch, i) for i in todo)
        for b in it:
            self.batches_done += 1
            yield b
        self.epoch += 1
        self.batches_done = 0
