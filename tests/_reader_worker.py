"""One rank of the real multi-process ShardLoader test (tests/test_data_reader.py).

usage: python _reader_worker.py RANK WORLD PORT SHARD_DIR OUT_JSON [NUM_WORKERS]

Joins a gloo process group, iterates one epoch with rank/world taken from torch.distributed, and
all-reduces once per batch: unequal batch counts across ranks would hang here (and time out).
Writes {"keys": [...], "batches": n, "len": len(loader), "sum_batches": total over ranks}.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni.data.reader import ShardLoader, decode_cls  # noqa: E402


def decode_key(sample: dict) -> str:
    decode_cls(sample["cls"])
    return sample["__key__"]


def collate_keys(values: list) -> list:
    return list(values)


def main() -> None:
    rank, world, port, shard_dir, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    num_workers = int(sys.argv[6]) if len(sys.argv) > 6 else 2
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        urls = sorted(str(p) for p in Path(shard_dir).glob("*.tar"))
        loader = ShardLoader(urls, decode_key, collate_keys, batch_size=8, num_workers=num_workers, seed=3)
        assert (loader.cfg.rank, loader.cfg.world_size) == (rank, world)
        keys: list[str] = []
        batches = 0
        for batch in loader:
            keys.extend(batch)
            batches += 1
            t = torch.ones(1)
            dist.all_reduce(t)  # every rank must reach this the same number of times
            assert int(t.item()) == world
        total = torch.tensor([batches])
        dist.all_reduce(total)
        Path(out).write_text(json.dumps({"keys": keys, "batches": batches, "len": len(loader),
                                         "sum_batches": int(total.item())}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
