"""Fixtures of the trainer tests: a small SST-2-format sample, each test in its own folder."""

from __future__ import annotations

import pytest

from zenflow.train.data import write_sst2_sample


@pytest.fixture(autouse=True)
def _no_stray_hw_json(tmp_path, monkeypatch):
    """Runs read ./hw.json by default: run every test from its own empty folder."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    # 20 training rows: with 4 per step an epoch is 5 steps, so 6 steps cross an epoch.
    return write_sst2_sample(tmp_path_factory.mktemp("sample"), n=20, n_dev=12)
