"""gs:// shards (omni.data.remote through gcsfs) against a fake Google Cloud Storage JSON API server on 127.0.0.1.

The server is a few routes of the real API (https://cloud.google.com/storage/docs/json_api/v1), objects held in a
dict: bucket and object metadata, listing (prefix / delimiter / pages), media download (``alt=media``, Range).
gcsfs is pointed at it the way its own emulator tests are: ``STORAGE_EMULATOR_HOST`` and anonymous credentials
(``token="anon"``), with gcsfs's gRPC bucket-layout probe off (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false), so nothing
leaves loopback and no request goes unanswered for long. Every request the server cannot answer is recorded, and the tests
assert there were none: a gcsfs upgrade that needs more of the API fails here rather than passing by accident."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import load_recipe
# the same content-not-URL view of a sample, and the same loader (omni's retries never apply here: gcsfs's faults
# below are refusals and missing objects, which are not retried)
from test_data_remote import epoch, loader

from omni.data.reader import index_shard
from omni.data.remote import dataset_source
from omni.data.shards import DatasetError, read_manifest

pytest.importorskip("gcsfs", reason="gcsfs is not installed (pip install -e \".[dev]\"): gs:// is not tested")

SHARD_SIZE = 200  # 1000 train samples of tiny_corpora's Fashion-MNIST -> 5 shards of 200
BUCKET = "omni-shards"


# ------------------------------------------------------------------------------------------------
# the fake GCS server
# ------------------------------------------------------------------------------------------------


def object_resource(bucket: str, name: str, data: bytes, generation: int) -> dict:
    """An object's metadata as the JSON API gives it (sizes and generations are strings there)."""
    return {"kind": "storage#object", "id": f"{bucket}/{name}/{generation}", "bucket": bucket, "name": name,
            "size": str(len(data)), "generation": str(generation), "metageneration": "1",
            "contentType": "application/x-tar", "storageClass": "STANDARD",
            "timeCreated": "2026-01-01T00:00:00.000Z", "updated": "2026-01-01T00:00:00.000Z",
            "md5Hash": base64.b64encode(hashlib.md5(data).digest()).decode()}


class FakeGCS(BaseHTTPRequestHandler):
    """GET routes of the JSON API over ``server.objects`` ({(bucket, name): bytes}). ``server.faults[name]`` lists
    the HTTP statuses the next requests for that object get instead (403: a refused credential)."""

    protocol_version = "HTTP/1.1"  # aiohttp keeps connections alive: every answer carries a Content-Length

    def do_GET(self) -> None:
        srv = self.server
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        parts = url.path.split("/")
        with srv.lock:
            srv.requests.append((url.path, query.get("alt"), self.headers.get("Range")))
            if self.headers.get("Authorization"):
                srv.authorized.append(url.path)
        # /storage/v1/b/<bucket>[/o[/<object>]] and /download/storage/v1/b/<bucket>/o/<object>
        download = parts[1:2] == ["download"]
        if download:
            parts = parts[1:]
        if parts[1:4] != ["storage", "v1", "b"] or len(parts) < 5:
            return self.unknown()
        bucket = urllib.parse.unquote(parts[4])
        if bucket not in srv.buckets:
            return self.error(404, f"The specified bucket does not exist: {bucket}")
        if len(parts) == 5 and not download:
            return self.json({"kind": "storage#bucket", "id": bucket, "name": bucket, "location": "US",
                              "storageClass": "STANDARD"})
        if parts[5] != "o":
            return self.unknown()
        if len(parts) == 6 and not download:
            return self.listing(bucket, query)
        name = urllib.parse.unquote("/".join(parts[6:]))  # gcsfs quotes "/" in names as %2F; accept both
        with srv.lock:
            plan = srv.faults.get(name)
            fault = plan.pop(0) if plan else None
        if fault is not None:
            return self.error(fault, f"fault planned for {name}")
        data = srv.objects.get((bucket, name))
        if data is None:
            return self.error(404, f"No such object: {bucket}/{name}")
        if download or query.get("alt") == "media":
            return self.media(data)
        if query.get("alt", "json") != "json":
            return self.unknown()
        return self.json(object_resource(bucket, name, data, srv.generation))

    def listing(self, bucket: str, query: dict) -> None:
        """objects.list: prefix, delimiter (names past it fold into ``prefixes``), maxResults and pageToken."""
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter")
        entries: list[tuple[str, bool]] = []  # (name or prefix, is a prefix), in name order
        for b, name in sorted(self.server.objects):
            if b != bucket or not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if delimiter and delimiter in rest:
                folded = prefix + rest.split(delimiter, 1)[0] + delimiter
                if (folded, True) not in entries:
                    entries.append((folded, True))
            else:
                entries.append((name, False))
        start = int(query.get("pageToken", 0))
        page = entries[start: start + int(query.get("maxResults", 1000))]
        out: dict = {"kind": "storage#objects",
                     "items": [object_resource(bucket, n, self.server.objects[(bucket, n)], self.server.generation)
                               for n, folded in page if not folded],
                     "prefixes": [n for n, folded in page if folded]}
        if start + len(page) < len(entries):
            out["nextPageToken"] = str(start + len(page))
        self.json(out)

    def media(self, data: bytes) -> None:
        """The object's bytes; a Range header (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``) gets 206 or 416."""
        rng = self.headers.get("Range")
        if not rng:
            return self.send(200, data, "application/octet-stream")
        first, _, last = rng.removeprefix("bytes=").partition("-")
        start, end = (len(data) - int(last), len(data) - 1) if not first else (int(first), int(last or len(data) - 1))
        if start >= len(data):
            return self.send(416, b"", "text/plain", {"Content-Range": f"bytes */{len(data)}"})
        end = min(end, len(data) - 1)
        self.send(206, data[start:end + 1], "application/octet-stream",
                  {"Content-Range": f"bytes {start}-{end}/{len(data)}"})

    def unknown(self) -> None:
        with self.server.lock:
            self.server.unknown.append(f"{self.command} {self.path}")
        self.close_connection = True  # a request body we did not read must not be taken for the next request
        self.error(400, f"the fake GCS server does not answer {self.command} {self.path}")

    def error(self, status: int, message: str) -> None:
        self.json({"error": {"code": status, "message": message, "errors": [{"message": message}]}}, status)

    def json(self, value: dict, status: int = 200) -> None:
        self.send(status, json.dumps(value).encode(), "application/json; charset=UTF-8")

    def send(self, status: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # uploads, batch and the rest: nothing a reader needs
        self.unknown()

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_POST

    def log_message(self, *args) -> None:
        pass


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """Quiet when gcsfs hangs up first (it cancels the listing it runs beside an object lookup); loud otherwise."""
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_corpora) -> Path:
    """ds/: omni data fashion-mnist, 5 train shards of 200 samples + 2 test shards, and its manifest."""
    from omni.data.builders_vision import build_fashion_mnist

    root = tmp_path_factory.mktemp("gcs-site")
    build_fashion_mnist(root / "ds", source=tiny_corpora.fashion_mnist, shard_size=SHARD_SIZE, quiet=True)
    return root


@pytest.fixture(scope="module")
def gcs_server(site):
    """The fake server, holding gs://omni-shards/fmnist/ (ds/) and gs://omni-shards/altered/ (ds/ with one label of
    train-000002.tar changed: same size, other bytes)."""
    server = Server(("127.0.0.1", 0), FakeGCS)
    server.lock, server.requests, server.authorized, server.unknown, server.faults = threading.Lock(), [], [], [], {}
    server.buckets, server.generation, server.objects = {BUCKET}, 1, {}
    for file in sorted((site / "ds").iterdir()):
        data = file.read_bytes()
        server.objects[(BUCKET, f"fmnist/{file.name}")] = data
        if file.name == "train-000002.tar":
            data = bytearray(data)
            i = data.index(b"\x00" * 4, 30000)
            data[i:i + 4] = b"ABCD"
            data = bytes(data)
        server.objects[(BUCKET, f"altered/{file.name}")] = data
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    """The server as gcsfs finds it, through the environment a user sets for an emulator (no storage options: the
    recipes pass none): $STORAGE_EMULATOR_HOST; FSSPEC_GS_TOKEN=anon (anonymous credentials: without them gcsfs
    would look for Google's default credentials, the metadata server included); GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=
    false (else gcsfs (2026.10 here) asks the bucket's storage layout over gRPC before every open, which an emulator
    does not answer: 60 s of retries each). fsspec and gcsfs read the last two when imported, so this process gets
    their in-memory equivalents too; data workers and subprocesses get the environment. Fresh request log."""
    import fsspec.config
    import gcsfs.core
    from fsspec.registry import _registry

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{gcs_server.server_address[1]}")
    monkeypatch.setenv("FSSPEC_GS_TOKEN", "anon")
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon"})
    for protocol in ("gs", "gcs"):
        monkeypatch.setitem(_registry, protocol, gcsfs.core.GCSFileSystem)
    gcs_server.requests.clear()
    gcs_server.faults.clear()
    yield gcs_server
    assert gcs_server.unknown == [], "gcsfs asked the fake server for something it does not answer"
    assert gcs_server.authorized == [], "anonymous access sent credentials"


def media_gets(server) -> list[str]:
    """The objects whose bytes were downloaded, one entry per request."""
    return [urllib.parse.unquote(p.split("/o/", 1)[1]) for p, alt, _ in server.requests
            if p.startswith("/download/") or alt == "media"]


def object_requests(server, name: str) -> list[str]:
    """The metadata and media requests for one object."""
    return [p for p, _, _ in server.requests if urllib.parse.unquote(p).endswith(f"/o/{name}")]


# ------------------------------------------------------------------------------------------------
# same batches as the local copy
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_gcs_dataset_gives_the_local_batches_and_fetches_each_shard_once(site, gcs, tmp_path, num_workers):
    local = epoch(loader(site / "ds", seed=3))
    remote_loader = loader(f"gs://{BUCKET}/fmnist", tmp_path, seed=3, num_workers=num_workers)
    assert len(remote_loader) == len(local) == 16 and remote_loader.num_samples == 1000
    assert epoch(remote_loader) == local
    # the manifest (read, never cached) and each of the 5 train shards once: the cache's lock makes two workers share
    assert sorted(media_gets(gcs)) == ["fmnist/manifest.json"] + [f"fmnist/train-{i:06d}.tar" for i in range(5)]
    local_loader = loader(site / "ds", seed=3)
    local_loader.set_epoch(1)
    assert epoch(remote_loader) == epoch(local_loader) != local  # epoch 1: another order, the same on both
    assert len(media_gets(gcs)) == 6  # the second epoch reads the warm cache


def test_brace_pattern_and_storage_options_give_the_local_batches(site, gcs, tmp_path, monkeypatch):
    """Shards by brace pattern (no manifest: counts come from the shards' headers), and the server named by storage
    options instead of the environment (``endpoint_url``, ``token="anon"``)."""
    import fsspec.config

    local = epoch(loader(str(site / "ds" / "train-{000000..000004}.tar"), seed=1))
    braces = loader(f"gs://{BUCKET}/fmnist/train-{{000000..000004}}.tar", tmp_path / "a", seed=1)
    assert braces.num_samples == 1000 and epoch(braces) == local
    endpoint = os.environ["STORAGE_EMULATOR_HOST"]
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    monkeypatch.setitem(fsspec.config.conf, "gs", {})
    gcs.requests.clear()
    given = loader(f"gs://{BUCKET}/fmnist", tmp_path / "b", seed=1,
                   remote_kw={"storage_options": {"endpoint_url": endpoint, "token": "anon"}})
    assert epoch(given) == epoch(loader(site / "ds", seed=1))
    assert len(media_gets(gcs)) == 6  # it was this server that answered


def test_recipes_read_a_gs_dataset_through_dataset_source(site, gcs, tmp_path, monkeypatch):
    """recipes/vit.py's own data path (``--data gs://...`` -> dataset_source -> read_manifest -> ShardLoader, default
    RemoteOptions: the cache from $OMNI_SHARD_CACHE) gives the tensors the local folder gives."""
    import torch

    assert dataset_source(f"gs://{BUCKET}/fmnist") == f"gs://{BUCKET}/fmnist"  # a URL stays a string, not a Path
    assert read_manifest(dataset_source(f"gs://{BUCKET}/fmnist"), kind="images")["builder"] == "fashion-mnist"
    monkeypatch.setenv("OMNI_SHARD_CACHE", str(tmp_path / "cache"))
    vit = load_recipe("vit", "vit_recipe_gcs")
    got = {}
    for name, data in (("gs", f"gs://{BUCKET}/fmnist"), ("local", str(site / "ds"))):
        cfg = vit.parse_args(["--preset", "tiny", "--data", data, "--set", "workers=0"])
        train, evaluation, names = vit.build_data(cfg, 0, 1, torch.device("cpu"))
        got[name] = (names, [next(iter(train))], list(evaluation))
    (names, train, evaluation), (local_names, local_train, local_evaluation) = got["gs"], got["local"]
    assert names == local_names and len(names) == 10
    assert len(evaluation) == len(local_evaluation) > 0
    for (x, y), (lx, ly) in zip(train + evaluation, local_train + local_evaluation):
        assert torch.equal(x, lx) and torch.equal(y, ly)
    # the train and test shards went through the cache, each fetched once
    shards = sorted(n for n in media_gets(gcs) if n.endswith(".tar"))
    assert shards == sorted({f"fmnist/{f.name}" for f in (site / "ds").glob("*.tar")}) and len(shards) == 7
    assert len(list((tmp_path / "cache").glob("*.tar"))) == 7


# ------------------------------------------------------------------------------------------------
# faults: a changed shard, a missing object, a refused credential
# ------------------------------------------------------------------------------------------------


def test_a_shard_changed_on_the_server_is_caught_by_its_sha256(site, gcs, tmp_path, caplog):
    good = {k for b in epoch(loader(site / "ds")) for k, _, _ in b}
    bad = {k for k, _ in index_shard(site / "ds" / "train-000002.tar").samples}
    assert len(bad) == 200
    with caplog.at_level(logging.WARNING):
        changed = loader(f"gs://{BUCKET}/altered", tmp_path, max_corrupt_fraction=0.25)
        keys = {k for b in epoch(changed) for k, _, _ in b}
    assert keys == good - bad and changed.stats["corrupt"] == 200 and changed.stats["valid"] == 800
    assert f"gs://{BUCKET}/altered/train-000002.tar sha256 mismatch" in caplog.text
    # the bad copy is not kept: the next run fetches it again
    assert not list((tmp_path / "cache").glob("*train-000002.tar"))
    with pytest.raises(DatasetError, match=rf"were corrupt, more than max_corrupt_fraction=0.01. By shard: "
                                           rf"gs://{BUCKET}/altered/train-000002.tar: \d+ corrupt"):
        epoch(loader(f"gs://{BUCKET}/altered", tmp_path))


@pytest.mark.parametrize("url", [f"gs://{BUCKET}/fmnist/train-000009.tar", "gs://no-such-bucket/ds/train-000000.tar"])
def test_a_missing_object_is_one_line_naming_the_url_and_not_retried(gcs, tmp_path, url):
    with pytest.raises(DatasetError) as info:
        loader(url, tmp_path)
    assert str(info.value) == f"{url}: not found"
    assert not media_gets(gcs)
    # gcsfs looks the object up, lists its name to tell a folder, and looks it up once more when the listing is
    # empty; omni adds no retry of its own (each would be two more)
    name = url.split("/", 3)[3]
    assert len(object_requests(gcs, name)) <= 2


def test_a_missing_dataset_stops_a_recipe_with_one_line_and_status_2(gcs, tmp_path, capsys, monkeypatch):
    from omni.recipe_runtime import run_recipe

    monkeypatch.setattr(sys, "argv", ["vit.py"])
    with pytest.raises(SystemExit) as info:
        run_recipe(lambda: loader(f"gs://{BUCKET}/nothing-here", tmp_path))
    assert info.value.code == 2
    assert capsys.readouterr().err == f"vit.py: error: gs://{BUCKET}/nothing-here/manifest.json: not found\n"


@pytest.mark.parametrize("status", [403, 401])
def test_a_refused_credential_is_one_line_naming_the_url_and_not_retried(gcs, tmp_path, status):
    """GCS answers 403 (gcsfs: OSError "Forbidden: <request URL>\\n<message>") or 401 (gcsfs: HttpError code 401)."""
    name = "fmnist/train-000003.tar"
    gcs.faults[name] = [status] * 20
    with pytest.raises(DatasetError) as info:
        epoch(loader(f"gs://{BUCKET}/fmnist", tmp_path))
    assert str(info.value) == (f"gs://{BUCKET}/{name}: access refused (fault planned for {name}"
                               f"{', 401' if status == 401 else ''}): check the credentials")
    # gcsfs falls back from a refused object lookup to a listing and asks once more; omni adds no retry of its own
    assert len(object_requests(gcs, name)) == 20 - len(gcs.faults[name]) <= 3


def test_a_missing_gcsfs_names_the_extra(tmp_path, monkeypatch):
    from omni.deps import install_hint

    monkeypatch.setitem(sys.modules, "gcsfs", None)
    with pytest.raises(ImportError) as info:
        loader(f"gs://{BUCKET}/ds", tmp_path)
    assert install_hint(info.value) == 'gcsfs is not installed: pip install -e ".[remote]" (from the omni checkout)'
