"""Shared fixtures."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

import omni.tokenizers.base as base

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "timeseries_plugin"


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """examples/timeseries_plugin installed into a temp site dir as a distribution with an
    `omni.tokenizers` entry point (what `pip install examples/timeseries_plugin` writes), with the
    registry restored afterwards."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(EXAMPLE / "omni_timeseries.py", site)
    dist = site / "omni_timeseries-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: omni-timeseries\nVersion: 0.1.0\n")
    entry = [ln for ln in (EXAMPLE / "pyproject.toml").read_text().splitlines() if ln.startswith("timeseries =")][0]
    (dist / "entry_points.txt").write_text("[omni.tokenizers]\n" + entry.replace('"', "") + "\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(base, "_ENTRY_POINTS_LOADED", False)
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    yield
    sys.modules.pop("omni_timeseries", None)


@pytest.fixture(scope="module")
def one_thread():
    """torch on one intra-op thread: for tiny matmuls on a loaded 2-core box the thread pool costs far
    more than the work itself (100x seen). Modules opt in with pytestmark."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
