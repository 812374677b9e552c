"""Shards from URLs (omni.data.remote through ShardLoader), against real servers on 127.0.0.1: a Python HTTP server
(with connection drops, 404 / 403 / 500 answers, altered and truncated shards) and moto's S3 server for s3://.
Every promise of the local reader holds: the same batches as the local copy, exact resume, disjoint ranks,
corrupt shards skipped and counted, faults reported in one line naming the URL."""

from __future__ import annotations

import errno
import shutil
import socket
import os
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from omni.data import remote
from omni.data.reader import ShardLoader, decode_image, index_shard
from omni.data.remote import RemoteOptions, ShardCache
from omni.data.shards import DatasetError, read_manifest
from omni.files import DiskFullError

SHARD_SIZE = 200  # 1000 train samples of tiny_corpora's Fashion-MNIST -> 5 shards of 200


# Module-level so DataLoader workers can use them under any start method.
def decode_sample(sample: dict) -> tuple[str, int, int]:
    """(key, label, pixel sum): the content, not the URL it came from."""
    image = np.asarray(decode_image(sample["png"]))
    return sample["__key__"], int(sample["cls"]), int(image.sum())


def collate(values: list) -> list:
    return list(values)


def epoch(loader: ShardLoader) -> list[list[tuple[str, int, int]]]:
    return [list(b) for b in loader]


# ------------------------------------------------------------------------------------------------
# data and servers
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_corpora) -> Path:
    """The folder the HTTP server serves: ds/ (omni data fashion-mnist), plus copies with one shard altered or cut."""
    from omni.data.builders_vision import build_fashion_mnist

    root = tmp_path_factory.mktemp("site")
    build_fashion_mnist(root / "ds", source=tiny_corpora.fashion_mnist, shard_size=SHARD_SIZE, quiet=True)
    for name, damage in (("altered", "flip"), ("truncated", "cut")):
        shutil.copytree(root / "ds", root / name)
        shard = root / name / "train-000002.tar"
        data = bytearray(shard.read_bytes())
        if damage == "flip":  # a label changed on the server: same size, other bytes
            i = data.index(b"\x00" * 4, 30000)
            data[i:i + 4] = b"ABCD"
        else:
            data = data[: len(data) // 2]
        shard.write_bytes(bytes(data))
    return root


class Handler(BaseHTTPRequestHandler):
    """Serves files under server.root; server.faults[path] is a list of what the next GETs of path get instead: an
    HTTP status, or "drop" (headers for the whole file, half of it, then the connection closes)."""

    def do_GET(self) -> None:
        srv = self.server
        path = urllib.parse.unquote(self.path.split("?", 1)[0]).lstrip("/")
        rng = self.headers.get("Range")
        with srv.lock:
            srv.requests.append((path, rng))
            plan = srv.faults.get(path)
            action = plan.pop(0) if plan else None
        if isinstance(action, int):
            self.send_error(action)
            return
        file = srv.root / path
        if not file.is_file():
            self.send_error(404)
            return
        data = file.read_bytes()
        start = int(rng.split("=", 1)[1].split("-", 1)[0]) if rng else 0
        body = data[start:]
        self.send_response(206 if rng else 200)
        self.send_header("Content-Length", str(len(body)))
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if action == "drop":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def http_server(site):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.root, server.faults, server.requests, server.lock = site, {}, [], threading.Lock()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def http(http_server):
    """The server's base URL, with no faults planned and an empty request log."""
    http_server.faults.clear()
    http_server.requests.clear()
    return f"http://127.0.0.1:{http_server.server_address[1]}"


def options(tmp_path: Path, **kw) -> RemoteOptions:
    kw.setdefault("retries", 3)
    kw.setdefault("backoff", 0.001)
    kw.setdefault("timeout", 10.0)
    return RemoteOptions(cache_dir=str(tmp_path / "cache"), **kw)


def loader(source, tmp_path=None, **kw) -> ShardLoader:
    kw.setdefault("batch_size", 64)
    if tmp_path is not None:
        kw["remote"] = options(tmp_path, **kw.pop("remote_kw", {}))
    return ShardLoader(source, decode_sample, collate, **kw)


def shard_gets(server) -> list[str]:
    return [p for p, _ in server.requests if p.endswith(".tar")]


# ------------------------------------------------------------------------------------------------
# same batches as the local copy
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_http_dataset_gives_the_local_batches_and_fetches_each_shard_once(site, http, http_server, tmp_path,
                                                                          num_workers):
    local = epoch(loader(site / "ds", seed=3))
    remote_loader = loader(f"{http}/ds", tmp_path, seed=3, num_workers=num_workers)
    assert len(remote_loader) == len(local) == 16 and remote_loader.num_samples == 1000
    assert epoch(remote_loader) == local
    gets = shard_gets(http_server)
    # two workers share the cache: its lock makes them fetch each of the 5 shards once
    assert sorted(gets) == [f"ds/train-{i:06d}.tar" for i in range(5)]
    local_loader = loader(site / "ds", seed=3)
    local_loader.set_epoch(1)
    assert epoch(remote_loader) == epoch(local_loader) != local  # epoch 1: another order, same on both
    assert len(shard_gets(http_server)) == 5  # the second epoch reads the warm cache
    assert ShardCache(options(tmp_path)).usage() == sum((site / "ds" / f"train-{i:06d}.tar").stat().st_size
                                                        for i in range(5))


def test_brace_pattern_url_list_and_pipe_give_the_local_batches(site, http, tmp_path):
    local = epoch(loader(str(site / "ds" / "train-{000000..000004}.tar"), seed=1))
    braces = loader(f"{http}/ds/train-{{000000..000004}}.tar", tmp_path, seed=1)  # no manifest: counts scanned
    assert braces.num_samples == 1000 and epoch(braces) == local
    listed = loader([f"{http}/ds/train-00000{i}.tar" for i in range(5)], tmp_path, seed=1)
    assert epoch(listed) == local
    piped = loader(f"pipe:cat {site}/ds/train-{{000000..000004}}.tar", tmp_path, seed=1)
    assert epoch(piped) == local
    assert epoch(loader(f"file://{site}/ds/train-{{000000..000004}}.tar", seed=1)) == local


def test_resume_over_http_equals_an_uninterrupted_run_and_fetches_only_what_it_reads(site, http, http_server,
                                                                                      tmp_path):
    kw = dict(seed=5, shuffle_window=100, batch_size=50)
    whole = epoch(loader(f"{http}/ds", tmp_path / "a", **kw))
    first = loader(f"{http}/ds", tmp_path / "b", **kw)
    it = iter(first)
    head = [next(it) for _ in range(14)]
    state = first.state_dict()
    http_server.requests.clear()
    resumed = loader(f"{http}/ds", tmp_path / "c", **kw)  # a new machine: empty cache
    resumed.load_state_dict(state)
    tail = epoch(resumed)
    assert head + tail == whole and len(whole) == 20
    # the last 6 batches (300 samples, windows of 100) lie in a few shards: only those were fetched
    by_key = {key: i for i in range(5) for key, _ in index_shard(site / "ds" / f"train-{i:06d}.tar").samples}
    needed = {f"ds/train-{by_key[k]:06d}.tar" for b in tail for k, _, _ in b}
    assert sorted(shard_gets(http_server)) == sorted(needed) and len(needed) < 5


def test_two_ranks_over_http_are_disjoint_with_equal_batch_counts(site, http, tmp_path):
    ranks = [epoch(loader(f"{http}/ds", tmp_path, seed=2, rank=r, world_size=2, batch_size=48)) for r in (0, 1)]
    keys = [[k for b in batches for k, _, _ in b] for batches in ranks]
    assert len(ranks[0]) == len(ranks[1]) == 11
    assert not set(keys[0]) & set(keys[1]) and len(keys[0]) == len(keys[1]) == 500
    assert set(keys[0]) | set(keys[1]) == {k for b in epoch(loader(site / "ds")) for k, _, _ in b}


# ------------------------------------------------------------------------------------------------
# network faults
# ------------------------------------------------------------------------------------------------


def test_a_dropped_connection_continues_where_it_stopped(site, http, http_server, tmp_path):
    http_server.faults["ds/train-000001.tar"] = ["drop", 503, "drop"]
    assert epoch(loader(f"{http}/ds", tmp_path, seed=0)) == epoch(loader(site / "ds", seed=0))
    tries = [r for p, r in http_server.requests if p == "ds/train-000001.tar"]
    size = (site / "ds" / "train-000001.tar").stat().st_size
    # whole file, dropped at half -> Range from half (503) -> Range from half, dropped at 3/4 -> Range from 3/4
    assert tries == [None, f"bytes={size // 2}-", f"bytes={size // 2}-", f"bytes={size // 2 + (size - size // 2) // 2}-"]


@pytest.mark.parametrize("status, words", [(404, "not found (HTTP 404)"), (403, "access refused (HTTP 403"),
                                           (401, "access refused (HTTP 401")])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_404_and_refused_credentials_are_one_line_naming_the_url(http, http_server, tmp_path, status, words,
                                                                  num_workers):
    http_server.faults["ds/train-000003.tar"] = [status] * 5
    with pytest.raises(DatasetError) as info:
        epoch(loader(f"{http}/ds", tmp_path, num_workers=num_workers))
    assert str(info.value).startswith(f"{http}/ds/train-000003.tar: {words}") and "\n" not in str(info.value)
    # not retried: one GET per process that needed it
    assert 1 <= shard_gets(http_server).count("ds/train-000003.tar") <= max(1, num_workers)


def test_5xx_is_retried_then_given_up_naming_the_url(site, http, http_server, tmp_path):
    http_server.faults["ds/manifest.json"] = [500, 502]
    http_server.faults["ds/train-000000.tar"] = [500, 503, 500]
    assert epoch(loader(f"{http}/ds", tmp_path, seed=0)) == epoch(loader(site / "ds", seed=0))
    http_server.faults["ds/manifest.json"] = [500] * 4
    with pytest.raises(DatasetError) as info:
        loader(f"{http}/ds", tmp_path / "x")
    assert str(info.value) == (f"{http}/ds/manifest.json: giving up after 4 tries, the last one: HTTP 500 Internal "
                               "Server Error")
    with pytest.raises(DatasetError, match=r"^http://127.0.0.1:1/ds/manifest.json: giving up after 2 tries, the "
                                           r"last one: URLError: \[Errno 111\] Connection refused$"):
        loader("http://127.0.0.1:1/ds", tmp_path, remote_kw={"retries": 1})


@pytest.mark.parametrize("name", ["altered", "truncated"])
def test_a_shard_changed_on_the_server_is_caught_by_its_sha256(site, http, http_server, tmp_path, caplog, name):
    good = {k for b in epoch(loader(site / "ds")) for k, _, _ in b}
    bad = {k for k, _ in index_shard(site / "ds" / "train-000002.tar").samples}
    changed = loader(f"{http}/{name}", tmp_path, max_corrupt_fraction=0.25)
    keys = {k for b in epoch(changed) for k, _, _ in b}
    assert keys == good - bad and changed.stats["corrupt"] == 200 and changed.stats["valid"] == 800
    assert f"{http}/{name}/train-000002.tar sha256 mismatch" in caplog.text and "changed on the server" in caplog.text
    # the bad copy is not kept: the next run fetches it again
    assert len(list((tmp_path / "cache").glob("*train-000002.tar"))) == 0
    with pytest.raises(DatasetError, match=rf"were corrupt, more than max_corrupt_fraction=0.01. By shard: "
                                           rf"{http}/{name}/train-000002.tar: \d+ corrupt"):
        epoch(loader(f"{http}/{name}", tmp_path))


def test_a_full_cache_disk_is_named(http, tmp_path, monkeypatch):
    class FullDisk:
        def __init__(self, *a, **k):
            self.closed = False

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.closed = True

    monkeypatch.setattr(remote, "open", lambda path, mode: FullDisk(), raising=False)
    with pytest.raises(DiskFullError) as info:
        epoch(loader(f"{http}/ds", tmp_path))
    message = str(info.value)
    assert message.startswith("disk full (no space left on device) while writing ") and "\n" not in message
    assert f"the shard cache's copy of {http}/ds/train-" in message and f"free space on {tmp_path / 'cache'}" in message
    assert not list((tmp_path / "cache").glob("*.part"))


def test_the_cache_stays_under_its_limit_and_still_gives_the_same_batches(site, http, http_server, tmp_path):
    shard = (site / "ds" / "train-000000.tar").stat().st_size
    small = loader(f"{http}/ds", tmp_path, seed=4, shuffle_window=200, batch_size=50,
                   remote_kw={"cache_bytes": 2 * shard + shard // 2})
    assert epoch(small) == epoch(loader(site / "ds", seed=4, shuffle_window=200, batch_size=50))
    assert ShardCache(small.cfg.remote).usage() <= 2 * shard + shard // 2
    assert len(shard_gets(http_server)) == 5  # windows of one shard: each fetched once even so


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_zero_byte_cache_keeps_only_the_shard_in_use(site, http, http_server, tmp_path, num_workers):
    nothing = loader(f"{http}/ds", tmp_path, seed=4, batch_size=50, num_workers=num_workers,
                     remote_kw={"cache_bytes": 0})
    assert epoch(nothing) == epoch(loader(site / "ds", seed=4, batch_size=50))
    shard = max((site / "ds" / f"train-{i:06d}.tar").stat().st_size for i in range(5))
    assert ShardCache(nothing.cfg.remote).usage() <= shard
    # open files outlive their eviction: each process (the loader's own, which indexes the shards, and each data
    # worker) fetches a shard at most once an epoch
    assert 5 <= len(shard_gets(http_server)) <= 5 * (1 + num_workers)


def test_recipes_report_a_remote_error_in_one_line_with_status_2(http, http_server, tmp_path, capsys, monkeypatch):
    from omni.recipe_runtime import run_recipe

    monkeypatch.setattr(sys, "argv", ["vit.py"])
    with pytest.raises(SystemExit) as info:
        run_recipe(lambda: loader(f"{http}/nothing-here", tmp_path))
    assert info.value.code == 2
    assert capsys.readouterr().err == f"vit.py: error: {http}/nothing-here/manifest.json: not found (HTTP 404)\n"


def test_read_manifest_by_url_checks_the_kind(http):
    assert read_manifest(f"{http}/ds/manifest.json", kind="images")["builder"] == "fashion-mnist"
    with pytest.raises(DatasetError, match=rf"^{http}/ds is a dataset of images .* where a dataset of speech is expected"):
        read_manifest(f"{http}/ds", kind="speech")


def test_pipe_that_fails_is_one_line_and_a_chatty_one_still_works(site, tmp_path):
    # 300 kB on stderr before any byte on stdout: a stderr pipe read after stdout would block both processes
    chatty = loader(f"pipe:head -c 300000 /dev/zero >&2; cat {site}/ds/train-000000.tar", tmp_path)
    assert chatty.num_samples == 200
    with pytest.raises(DatasetError, match=r"^'pipe:cat /no/such.tar' exited with status 1: cat: /no/such.tar: No such"):
        loader("pipe:cat /no/such.tar", tmp_path)


def test_a_missing_s3fs_names_the_extra(tmp_path, monkeypatch):
    from omni.deps import install_hint

    monkeypatch.setitem(sys.modules, "s3fs", None)
    hint = 's3fs is not installed: pip install -e ".[remote]" (from the omni checkout)'
    with pytest.raises(ImportError) as info:
        loader("s3://bucket/ds", tmp_path)
    assert install_hint(info.value) == hint
    # in a data worker (counts given: nothing is fetched before the workers start) the same line reaches the loader
    with pytest.raises(ImportError) as info:
        epoch(loader(["s3://bucket/a.tar", "s3://bucket/b.tar"], tmp_path, counts=[3, 4], num_workers=2))
    assert install_hint(info.value) == hint


def test_a_download_killed_midway_leaves_nothing_a_later_run_trusts(site, http, http_server, tmp_path):
    cache = ShardCache(options(tmp_path))
    entry = cache.entry(f"{http}/ds/train-000000.tar", read_manifest(site / "ds")["splits"]["train"]["shards"][0]["sha256"])
    entry.parent.mkdir(parents=True)
    entry.with_name(entry.name + ".part").write_bytes(b"half a shard from a killed run")
    entry.with_name(entry.name + ".lock").touch()
    assert epoch(loader(f"{http}/ds", tmp_path, seed=0)) == epoch(loader(site / "ds", seed=0))
    assert sorted(p.name[21:] for p in entry.parent.glob("*.part")) == []
    assert entry.read_bytes() == (site / "ds" / "train-000000.tar").read_bytes()


# ------------------------------------------------------------------------------------------------
# S3 (moto's server on 127.0.0.1)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(site):
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    import boto3

    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = dict(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
    client = boto3.client("s3", endpoint_url=endpoint, **creds)
    client.create_bucket(Bucket="shards")
    for file in sorted((site / "ds").iterdir()):
        client.upload_file(str(file), "shards", f"fmnist/{file.name}")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                     ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_ENDPOINT_URL", endpoint)):
            mp.setenv(k, v)
        yield endpoint
    server.stop()


def test_s3_dataset_gives_the_local_batches(site, s3, tmp_path):
    local = epoch(loader(site / "ds", seed=7))
    from_env = loader("s3://shards/fmnist", tmp_path / "a", seed=7, num_workers=2)  # AWS_ENDPOINT_URL
    assert epoch(from_env) == local
    options_given = loader("s3://shards/fmnist/train-{000000..000004}.tar", tmp_path / "b", seed=7,
                           remote_kw={"storage_options": {"endpoint_url": s3}})
    assert epoch(options_given) == local
    with pytest.raises(DatasetError, match=r"^s3://shards/fmnist/train-000009.tar: not found$"):
        loader("s3://shards/fmnist/train-000009.tar", tmp_path / "c")


def test_a_recipe_trains_on_a_dataset_url(http, tmp_path):
    """`python recipes/vit.py --data https://host/ds`: the recipe keeps the URL (Path() would fold it into
    'http:/host'), fetches the shards into the cache and trains, as on the local folder."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMNI_SHARD_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "recipes/vit.py", "--preset", "tiny", "--data", f"{http}/ds", "--out",
                           str(tmp_path / "run"), "--set", "steps=2", "progress=False"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert any((tmp_path / "cache").rglob("*.tar")), "the shards were read through the cache"


def test_a_shard_evicted_between_its_fetch_and_its_opening_is_fetched_again(site, http, tmp_path, monkeypatch):
    """Another process (a data worker making room in a small cache) can evict a shard after this one fetched it and
    before it opened it: the reader fetches it again instead of failing or calling the shard corrupt."""
    get, evicted = ShardCache.get, set()

    def get_then_evicted(self, url, *args, **kwargs):
        local, digest = get(self, url, *args, **kwargs)
        if url not in evicted:  # the first fetch of each shard is evicted before its caller opens it
            evicted.add(url)
            self.discard(local)
        return local, digest

    monkeypatch.setattr(ShardCache, "get", get_then_evicted)
    remote = loader(f"{http}/ds", tmp_path, seed=4, batch_size=50)
    assert epoch(remote) == epoch(loader(site / "ds", seed=4, batch_size=50))
    assert len(evicted) == 5
