"""Shared pytest fixtures. Model checkpoints are built once per session:

  tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir   random tiny HF checkpoints (no tokenizer)
  tiny_checkpoint                                  factory: tiny_checkpoint(arch, tie=False)
  smollm2_dir                                      the bundled model's converted cache directory
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so tests can `import tiny_models`

from tiny_models import make_tiny_checkpoint  # noqa: E402


# --- model checkpoints -------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory `tiny_checkpoint(arch, tie=False, **kw) -> Path`, cached per argument set."""
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", tie: bool = False, **kw) -> Path:
        key = (arch, tie, tuple(sorted(kw.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}{'-tied' if tie else ''}")
            made[key] = make_tiny_checkpoint(folder, arch, tie=tie, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct as a float32 HF checkpoint (converted on first use)."""
    from minicb.model.loader import ensure_bundled
    return ensure_bundled("smollm2-135m")
