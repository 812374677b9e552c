"""Evaluation reads the whole eval set whatever read it before (omni.evaluation.held_position / first_batch): a
hook that shows the first eval batch, or a half-read iterator, leaves a resumable loader where it was, and the
next pass scores every batch. (The vit recipe's picture hook once cut evaluations to 3 of 4 batches:
tests/test_vit_recipe.py::test_eval_metrics_do_not_depend_on_hooks_or_resume.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni.data.memory import TensorLoader
from omni.data.reader import ShardLoader
from omni.evaluation import first_batch, held_position


def decode(sample: dict) -> int:
    return int(sample["cls"].decode())


def labels(batch: list[int]) -> torch.Tensor:
    return torch.tensor(batch)


@pytest.fixture(scope="module")
def shards(tiny_corpora, tmp_path_factory):
    from omni.data.builders_vision import build_fashion_mnist

    out = tmp_path_factory.mktemp("eval-position") / "shards"
    build_fashion_mnist(out, source=tiny_corpora.fashion_mnist, quiet=True)
    return out


def passes(loader) -> list[torch.Tensor]:
    with held_position(loader):
        return list(loader)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_shard_loader_is_read_whole_and_left_in_place(shards, tiny_corpora, workers):
    loader = ShardLoader(shards, decode, labels, 64, split="test", shuffle=False, num_workers=workers)
    start = loader.state_dict()
    first = first_batch(loader)
    assert loader.state_dict() == start  # the hook's read moved nothing
    whole = passes(loader)
    assert len(whole) == 4 and torch.equal(whole[0], first)
    assert torch.equal(torch.cat(whole), torch.from_numpy(tiny_corpora.test_labels.astype(np.int64)))
    it = iter(loader)
    next(it)  # a half-read iterator (what `next(iter(eval_data))` in a hook left behind)
    assert [torch.equal(a, b) for a, b in zip(passes(loader), whole)] == [True] * 4
    assert loader.state_dict()["batches_done"] == 1  # put back where the half read left it


def test_a_tensor_loader_is_read_whole_and_left_in_place():
    x = torch.arange(40)
    loader = TensorLoader([x], 10, shuffle=True, seed=3)
    assert first_batch(loader)[0].tolist() == passes(loader)[0][0].tolist()
    next(iter(loader))
    assert loader.batches_done == 1
    assert sorted(torch.cat([b[0] for b in passes(loader)]).tolist()) == list(range(40))  # 4 batches, all of it
    assert (loader.epoch, loader.batches_done) == (0, 1)
    assert first_batch([[1], [2]]) == [1]  # any iterable: its first item
