"""bench/llama_cpp.py, the side-by-side benchmark against llama.cpp, without llama.cpp: its plan,
and its whole loop (start a server, run the workload, stop it, save, resume, tabulate) with two
`minicb serve` processes of a tiny checkpoint standing in for both servers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "llama_cpp.py"


@pytest.fixture
def peer():
    spec = importlib.util.spec_from_file_location("llama_cpp_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plan_alternates_which_server_goes_first(peer, capsys):
    """Each workload's two servers run back to back, the first alternating from one workload
    and one repeat to the next, so a drifting machine load falls on both sides; --dry-run
    prints the CPU and every command and starts nothing."""
    assert peer.main(["--dry-run", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "vector flags" in out
    rows = [line.split() for line in out.splitlines()[1:]]
    assert len(rows) == 2 * 2 * len(peer.WORKLOADS)
    firsts = [row for i, row in enumerate(rows) if i % 2 == 0]
    assert [r[1] for r in firsts[:2]] == ["0", "0"]
    servers = [next(w for w in r if w in peer.SERVERS) for r in firsts]
    assert servers[:4] == ["minicb", "llama.cpp", "minicb", "llama.cpp"]
    assert servers[len(peer.WORKLOADS)] == "llama.cpp"  # the next repeat starts the other way
    assert any("llama-server" in line and "--parallel 32" in line for line in out.splitlines())


def test_the_loop_runs_saves_resumes_and_tabulates(peer, tiny_llama_dir, tmp_path,
                                                   monkeypatch, capsys):
    """Two stand-in servers, one tiny workload: two runs saved with the load, a table with
    their ratio; run again, nothing is measured twice."""
    monkeypatch.setattr(peer, "WORKLOADS", {"tiny": ("equal-lengths", {
        "num_requests": 2, "prompt_lengths": 8, "output_lengths": 4}, 2)})
    monkeypatch.setitem(peer.COMMANDS, "llama.cpp", peer.minicb_command)
    stand_in = tmp_path / "stand-in"
    stand_in.write_text("")
    out = tmp_path / "results" / "peer"
    argv = ["--model", str(tiny_llama_dir), "--vocab-size", "256", "--repeats", "1",
            "--threads", "1", "--out", str(out), "--llama-server", str(stand_in),
            "--gguf", str(stand_in)]
    assert peer.main(argv) == 0
    saved = json.loads(out.with_suffix(".json").read_text())
    assert [(r["server"], r["result"]["num_requests"], r["result"]["errors"])
            for r in saved["runs"]] == [("minicb", 2, 0), ("llama.cpp", 2, 0)]
    assert all(len(r["load_before"]) == 3 for r in saved["runs"])
    assert saved["cpu"]["model"] and "--repeats 1" in saved["command"]
    row = out.with_suffix(".md").read_text().splitlines()[2]
    assert row.startswith("| tiny |") and "x (median" in row

    def no_server(*args, **kwargs):
        raise AssertionError("a finished run was measured again")
    monkeypatch.setattr(peer, "running", no_server)
    assert peer.main(argv) == 0
    assert json.loads(out.with_suffix(".json").read_text())["runs"] == saved["runs"]


def test_a_run_with_a_failed_request_is_measured_again(peer, tmp_path, monkeypatch):
    """A run in which a request failed is kept under failed_runs, out of the table, and
    measured again by the next invocation; the others are not."""
    import contextlib
    results = iter([{"output_tokens_per_s": 0.0, "tpot_s": {"p50": None}, "errors": 1,
                     "error_reasons": {"boom": 1}}]
                   + [{"output_tokens_per_s": 10.0, "tpot_s": {"p50": 0.1}, "errors": 0,
                       "error_reasons": {}}] * 3)
    monkeypatch.setattr(peer, "running", lambda *a: contextlib.nullcontext("http://x"))
    monkeypatch.setattr(peer, "measure", lambda url, name, args: next(results))
    monkeypatch.setattr(peer, "WORKLOADS", {"tiny": ("equal-lengths", {}, 2)})
    stand_in = tmp_path / "stand-in"
    stand_in.write_text("")
    out = tmp_path / "peer"
    argv = ["--repeats", "1", "--out", str(out), "--llama-server", str(stand_in),
            "--gguf", str(stand_in)]
    peer.main(argv)
    saved = json.loads(out.with_suffix(".json").read_text())
    assert [r["server"] for r in saved["runs"]] == ["llama.cpp"]
    assert [r["server"] for r in saved["failed_runs"]] == ["minicb"]
    peer.main(argv)
    saved = json.loads(out.with_suffix(".json").read_text())
    assert sorted(r["server"] for r in saved["runs"]) == ["llama.cpp", "minicb"]
    assert len(saved["failed_runs"]) == 1
    assert "1.00-1.00x" in out.with_suffix(".md").read_text()

