"""Datasets as webdataset tar shards.

* ``omni.data.builders``: ``omni data ...`` builders (fashion-mnist, images, speech-synth,
  librispeech, gym, minari, text) that write ``<out>/<split>-NNNNNN.tar`` + ``manifest.json``;
* ``omni.data.shards``: the manifest format, atomic shard writing, and for readers
  ``read_manifest`` / ``shard_urls`` (only shards listed in a complete manifest are trusted);
* ``omni.data.cli``: the ``omni data ...`` / ``omni tokenizer fit`` subcommands of the ``omni`` command.

Builders import their heavy dependencies lazily, so importing this package stays cheap.
"""

from omni.data.shards import DatasetError, read_manifest, shard_urls, verify_dataset

__all__ = ["DatasetError", "read_manifest", "shard_urls", "verify_dataset"]
