"""Session-wide set-up: a private cache for the demo model, shared by child processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _noria_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("noria-cache")
    os.environ["NORIA_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def demo_path(_noria_cache: Path) -> Path:
    from noria.frontend.demo_model import ensure_demo

    return ensure_demo()


@pytest.fixture(scope="session")
def demo_tokenizer(demo_path: Path):
    from noria.frontend.processor import load_tokenizer

    return load_tokenizer(str(demo_path))
