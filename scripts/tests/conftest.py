"""What the scripts' tests share: loading a script as a module, and the real model (fetched and
converted by scripts/fetch-model.py, cached in ~/.cache/kvtier)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[1]


def load_script(file_name: str) -> ModuleType:
    """A script of scripts/ (their names have dashes) as a module."""
    spec = importlib.util.spec_from_file_location(file_name.replace("-", "_"), SCRIPTS / file_name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The Hugging Face directory of SmolLM2-135M-Instruct (fetched on first use)."""
    import vllm_harness

    return vllm_harness.model_dir()


@pytest.fixture(scope="session")
def gguf_path(model_dir: Path) -> Path:
    """The GGUF the directory was converted from (kept beside it)."""
    path = model_dir.parent / "gguf" / load_script("fetch-model.py").GGUF_NAME
    assert path.is_file(), f"{path} missing after scripts/fetch-model.py"
    return path
