"""The data layer's user-facing error, in a module of its own so that every data module (the manifest code in
omni.data.shards, the fetching in omni.data.remote) can raise it without importing each other."""

from __future__ import annotations


class DatasetError(RuntimeError):
    """A dataset folder is missing, incomplete or does not match its manifest; or a shard / manifest URL cannot be
    fetched (not found, access refused, retries spent). Recipes and the CLI report it in one line (exit 2)."""
