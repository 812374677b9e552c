"""Data pipeline throughput on the CPU alone (no model): webdataset shards -> decoded, collated batches.

    python benchmarks/data_pipeline.py [--workers 2] [--fmnist data/fashion-mnist] [--speech data/speech-bench]
    python benchmarks/data_pipeline.py --rows remote [--synthetic]     # shards from loopback HTTP and S3

1. Fashion-MNIST: PNG shards (`omni data fashion-mnist`) -> uint8 (B, 1, 28, 28) + labels, samples/s.
2. Speech: FLAC shards (`omni data speech-synth`, built here if missing: 600 utterances from `--text`
   or the default corpus) -> decoded, resampled, 80-bin log-mel stem tokens per utterance (the audio
   tokenizer's encode), seconds of audio per second of wall time.
3. Remote: the Fashion-MNIST shards served by a Python HTTP server and by moto's S3 server on 127.0.0.1, read
   with recipes/vit.py's decode (DecodeImage) into an empty shard cache: epoch 0 (cold: every shard fetched) and
   epoch 1 (warm: the cache), each vs the same epoch read from the local folder; the time to the first batch of a
   run resumed mid-epoch (cold and warm cache); the cache's disk use. For comparison, webdataset's streaming
   pipeline over the same HTTP shards (`pipe:curl`, shuffle buffer 1000): its epoch rate (every epoch streams
   again) and its resume cost (streaming up to the position). `--synthetic` builds the shards from 60,000
   synthetic 28x28 images (discs over noise, as the tests' fixture) when Fashion-MNIST is not installed.
All read through ShardLoader (seeded shuffle, exactly-once epochs) with `--workers` data workers.
"""

from __future__ import annotations

import argparse
import gzip
import io
import shutil
import struct
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from omni.data.clips import DecodeClip
from omni.data.reader import ShardLoader
from omni.data.remote import RemoteOptions, ShardCache
from omni.tokenizers.audio import AudioTokenizer


class DecodePNG:
    def __call__(self, sample):
        from PIL import Image

        image = np.asarray(Image.open(io.BytesIO(sample["png"])))
        return torch.from_numpy(image.copy())[None], int(sample["cls"])


def collate_images(items):
    images, labels = zip(*items)
    return torch.stack(images), torch.tensor(labels)


def tokens_and_seconds(audio: AudioTokenizer, raw: bytes, transcript: str, key: str) -> tuple[torch.Tensor, float]:
    """A DecodeClip ``encode``: (the clip's log-mel tokens, its duration in seconds)."""
    segment = audio.encode(raw, key=key)
    return segment.tokens, segment.meta["seconds"]


def collate_speech(items):
    return [t for t, _ in items], sum(s for _, s in items)


def run(loader, measure) -> tuple[float, float]:
    start = time.perf_counter()
    total = 0.0
    for batch in loader:
        total += measure(batch)
    return total, time.perf_counter() - start


def cpu_seconds() -> float:
    """CPU time of this process (its threads: the in-process servers too) and of its reaped children (the data
    workers, which exit at the end of every epoch)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_cpu(loader) -> tuple[float, float, float]:
    """(samples, wall seconds, CPU seconds) of one epoch of image batches."""
    cpu = cpu_seconds()
    n, secs = run(loader, lambda b: b[0].shape[0])
    return n, secs, cpu_seconds() - cpu


def synthetic_fashion_mnist(folder: Path) -> Path:
    """The four Fashion-MNIST IDX files with 60,000 + 10,000 synthetic images (a disc per class over noise)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows, cols = np.mgrid[:28, :28]
    for prefix, n in (("train", 60000), ("t10k", 10000)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = (rng.random((n, 28, 28)) * rng.integers(20, 120, (n, 1, 1))).astype(np.uint8)
        for c in range(10):
            images[labels == c] = np.where((rows - 4 - 2 * c) ** 2 + (cols - 14) ** 2 < (3 + c) ** 2, 255,
                                           images[labels == c])
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
            (folder / f"{prefix}-{kind}-ubyte.gz").write_bytes(gzip.compress(header + array.tobytes(), mtime=0))
    return folder


def fashion_mnist_shards(args) -> str:
    """Fashion-MNIST label for the table; builds the shards in args.fmnist if missing."""
    synthetic = Path(args.fmnist + "-synthetic-idx")
    if (Path(args.fmnist) / "manifest.json").is_file():
        return "synthetic 28x28 PNG" if synthetic.is_dir() else "Fashion-MNIST"
    from omni.data.builders_vision import build_fashion_mnist

    try:
        build_fashion_mnist(args.fmnist, quiet=True)
        return "Fashion-MNIST"
    except FileNotFoundError:
        if not args.synthetic:
            raise
    source = synthetic_fashion_mnist(synthetic)
    build_fashion_mnist(args.fmnist, source=source, quiet=True)
    return "synthetic 28x28 PNG"


def serve_http(root: Path):
    """A threaded http.server on 127.0.0.1 serving ``root`` (stopped with .shutdown())."""
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def do_GET(self):
            self.server.gets += 1
            super().do_GET()

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(root)))
    server.daemon_threads = True
    server.gets = 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def serve_s3(dataset: Path):
    """moto's S3 server on 127.0.0.1 holding the dataset as s3://bench/<name>/; None without moto / s3fs."""
    try:
        import boto3
        import s3fs  # noqa: F401  (the reader needs it)
        from moto.server import ThreadedMotoServer
    except ImportError:
        return None, None
    import logging
    import os

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for k, v in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"), ("AWS_DEFAULT_REGION", "us-east-1"),
                 ("AWS_ENDPOINT_URL", endpoint)):
        os.environ[k] = v
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="bench")
    for file in sorted(dataset.iterdir()):
        if file.is_file():
            client.upload_file(str(file), "bench", f"{dataset.name}/{file.name}")
    return server, f"s3://bench/{dataset.name}"


def remote_rows(args, label: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    from vit import DecodeImage, stack  # the recipe's decode for Fashion-MNIST (1 channel, 28x28, no resize)

    decode = DecodeImage(channels=1, image_size=28, resize=None, train=True)
    dataset = Path(args.fmnist).resolve()
    http = serve_http(dataset.parent)
    s3_server, s3_url = serve_s3(dataset)
    sources = [("local folder", str(dataset)), ("loopback HTTP", f"http://127.0.0.1:{http.server_address[1]}/{dataset.name}")]
    if s3_url:
        sources.append(("moto S3 (s3fs)", s3_url))
    tmp = Path(tempfile.mkdtemp(prefix="omni-bench-cache-"))
    w = args.workers

    def make(source, cache: Path, **kw):
        return ShardLoader(source, decode, stack, batch_size=512, num_workers=w, seed=0,
                           remote=RemoteOptions(cache_dir=str(cache)), **kw)

    total = sum(f.stat().st_size for f in dataset.glob("train-*.tar"))
    print(f"\n{label}: {make(str(dataset), tmp / 'x').num_samples:,} samples, {total / 1e6:.0f} MB of train shards; "
          f"{w} workers, batches of 512, recipes/vit.py DecodeImage; warm epochs: median of {args.repeats}, the "
          "sources interleaved in alternating order (the machine's other load hits them alike)\n", flush=True)
    print("| source | epoch 0 (cold cache) | x local | CPU ms / 1k samples | later epochs (warm cache) | x local | "
          "CPU ms / 1k samples | x local | cache on disk |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        loaders = {name: make(source, tmp / name.split()[0]) for name, source in sources}
        cold = {name: run_cpu(loaders[name]) for name, _ in sources}
        warm: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in sources}
        for rep in range(args.repeats):
            for name, _ in (sources if rep % 2 == 0 else sources[::-1]):  # alternate, so no source always goes last
                warm[name].append(run_cpu(loaders[name]))

        def rate(runs):  # median samples/s and CPU ms per 1000 samples
            return (float(np.median([n / secs for n, secs, _ in runs])),
                    float(np.median([1000 * 1000 * cpu / n for n, _, cpu in runs])))

        base_cold, base_warm = rate([cold["local folder"]]), rate(warm["local folder"])
        for name, _ in sources:
            used = ShardCache(RemoteOptions(cache_dir=str(tmp / name.split()[0]))).usage()
            c, h = rate([cold[name]]), rate(warm[name])
            print(f"| {name} | {c[0]:,.0f} samples/s | {c[0] / base_cold[0]:.2f}x | {c[1]:.0f} | {h[0]:,.0f} samples/s | "
                  f"**{h[0] / base_warm[0]:.2f}x** | {h[1]:.0f} | {base_warm[1] / h[1]:.2f}x | {used / 1e6:.0f} MB |",
                  flush=True)
        print("\nwarm epochs one by one (samples/s): " + "; ".join(
            f"{name}: {', '.join(f'{n / secs:,.0f}' for n, secs, _ in warm[name])}" for name, _ in sources))

        # The least disk: a cache limit of 0 keeps only the shards open in some process (an evicted shard stays
        # readable through its open descriptor), so every epoch fetches again, once per data worker at most.
        url = sources[1][1]
        print("\n| HTTP, cache limit 0 (only shards in use on disk) | samples/s | shard GETs / shards | cache after |\n"
              "|---|---|---|---|")
        shards = len(list(dataset.glob("train-*.tar")))
        small = ShardLoader(url, decode, stack, batch_size=512, num_workers=w, seed=0,
                            remote=RemoteOptions(cache_dir=str(tmp / "zero"), cache_bytes=0))
        for which in ("epoch 0", "epoch 1"):
            gets = http.gets
            n, secs = run(small, lambda b: b[0].shape[0])
            print(f"| {which} | {n / secs:,.0f} | {http.gets - gets} / {shards} | "
                  f"{ShardCache(small.cfg.remote).usage() / 1e6:.0f} MB |", flush=True)


        # Resume mid-epoch: time to the first batch (the plan addresses it directly; only its shards are fetched).
        print("\n| resume at batch K/2 of epoch 0 | time to the first batch |\n|---|---|")
        for name, source, cache in (("ShardLoader, local folder", str(dataset), tmp / "x"),
                                    ("ShardLoader, HTTP, cold cache", url, tmp / "resume-cold"),
                                    ("ShardLoader, HTTP, warm cache", url, tmp / "loopback")):
            loader = make(source, cache)
            loader.load_state_dict({"epoch": 0, "batches_done": len(loader) // 2})
            start = time.perf_counter()
            next(iter(loader))
            print(f"| {name} | {time.perf_counter() - start:.2f} s |", flush=True)
        stream_rows(url, dataset, decode, stack, w)
    finally:
        http.shutdown()
        if s3_server is not None:
            s3_server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def stream_rows(url: str, dataset: Path, decode, collate, workers: int) -> None:
    """webdataset's streaming reader over the same HTTP shards (curl), for comparison: no cache, a shuffle buffer."""
    import webdataset as wds

    if shutil.which("curl") is None:
        print("| webdataset streaming | skipped: no curl |")
        return
    shards = sorted(f.name for f in dataset.glob("train-*.tar"))
    urls = [f"pipe:curl -s -f {url}/{name}" for name in shards]
    n = sum(int(s["count"]) for s in __import__("json").loads((dataset / "manifest.json").read_text())["splits"]["train"]["shards"])

    def pipeline(decoded: bool):
        ds = wds.WebDataset(urls, shardshuffle=False, workersplitter=wds.split_by_worker, nodesplitter=None)
        return ds.shuffle(1000).map(decode).batched(512, collation_fn=collate) if decoded else ds

    loader = torch.utils.data.DataLoader(pipeline(True), batch_size=None, num_workers=workers)
    got, secs = run(loader, lambda b: b[0].shape[0])
    print(f"| webdataset streaming (HTTP, every epoch) | {got / secs:,.0f} samples/s for {got:,.0f} samples |")
    start = time.perf_counter()
    for i, _ in enumerate(pipeline(False)):  # resume by streaming past the samples already trained on
        if i + 1 >= n // 2:
            break
    print(f"| webdataset streaming: resume at sample N/2 (skip forward, no decode) | {time.perf_counter() - start:.2f} s |",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--fmnist", default="data/fashion-mnist")
    ap.add_argument("--speech", default="data/speech-bench")
    ap.add_argument("--text", nargs="*", default=None, help="corpus files for the speech build (default corpus if omitted)")
    ap.add_argument("--rows", nargs="+", default=["fmnist", "speech", "remote"], choices=["fmnist", "speech", "remote"])
    ap.add_argument("--synthetic", action="store_true", help="synthetic images when Fashion-MNIST is not installed")
    ap.add_argument("--repeats", type=int, default=4, help="warm epochs per source in the remote rows")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the workers own the cores

    label = fashion_mnist_shards(args) if {"fmnist", "remote"} & set(args.rows) else ""
    if "fmnist" in args.rows:
        loader = ShardLoader(args.fmnist, DecodePNG(), collate_images, batch_size=512, num_workers=args.workers, seed=0)
        n, secs = run(loader, lambda b: b[0].shape[0])
        print(f"| {label} PNG -> uint8 batches of 512 | {args.workers} workers | {n:,.0f} samples in {secs:.1f} s "
              f"| **{n / secs:,.0f} samples/s** |", flush=True)

    if "speech" in args.rows:
        if not (Path(args.speech) / "manifest.json").is_file():
            from omni.data.builders_speech import build_speech_synth

            build_speech_synth(args.speech, train=600, test=20, text=args.text, quiet=True)
        decode = DecodeClip(partial(tokens_and_seconds, AudioTokenizer()))  # a clip over 30 s is dropped, with a warning
        loader = ShardLoader(args.speech, decode, collate_speech, batch_size=32, num_workers=args.workers, seed=0)
        audio, secs = run(loader, lambda b: b[1])
        print(f"| speech FLAC -> log-mel stem tokens | {args.workers} workers | {audio:,.0f} s of audio in {secs:.1f} s "
              f"| **{audio / secs:,.0f} s of audio/s** |", flush=True)

    if "remote" in args.rows:
        remote_rows(args, label)


if __name__ == "__main__":
    main()
