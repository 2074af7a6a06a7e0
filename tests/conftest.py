"""Shared pytest fixtures. Model checkpoints are built once per session:

  tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir   random tiny HF checkpoints (no tokenizer)
  tiny_checkpoint                                  factory: tiny_checkpoint(arch, tie=False)
  smollm2_dir                                      the bundled model's converted cache directory
  tiny_model, word_model                           the tiny Llama loaded; with a word tokenizer
  make_engine                                      factory: an Engine on the tiny Llama
  static, continuous                               the seed's R1..R4 example under each policy

Plain functions and constants the test modules share live in helpers.py, tiny_models.py (tiny
checkpoints and engine comparisons) and paged_cases.py (paged attention cases).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Tiny models gain nothing from threads, and on a shared 2-core machine two spinning threads
# per process make steps several times slower. Notebooks run in their own kernels and keep the
# default.
torch.set_num_threads(int(os.environ.get("MINICB_TEST_THREADS", "1")))

sys.path.insert(0, str(Path(__file__).parent))  # so tests can `import helpers`, `tiny_models`

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


# --- engines -----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_model(tiny_llama_dir):
    """A loaded `(model, info)` pair of the tiny Llama, shared by every engine test."""
    from minicb.model.loader import load_model
    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="session")
def word_model(tiny_model):
    """The tiny Llama with a word-level tokenizer ("w3 w17 ...") and a chat template: text
    for the server's and LLM's tests (test_serve, test_llm_api)."""
    import dataclasses

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model, info = tiny_model
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w9"
    return model, dataclasses.replace(info, tokenizer=tok)


@pytest.fixture
def make_engine(tiny_model):
    """Factory: `make_engine(policy="pd", **config)` -> Engine on the tiny Llama with invariant
    checks on (every engine test runs them)."""
    from minicb import Engine

    def make(policy: str = "pd", **options):
        options.setdefault("check_invariants", True)
        options.setdefault("num_pages", 256)
        return Engine(tiny_model, policy=policy, **options)

    return make


@pytest.fixture(scope="module")
def static():
    """The seed's R1..R4 example under static batching (test_viz)."""
    from minicb.course import viz
    return viz.seed_example("static")


@pytest.fixture(scope="module")
def continuous():
    """The seed's R1..R4 example under continuous batching (test_viz)."""
    from minicb.course import viz
    return viz.seed_example("continuous")
