"""`python -m minicb bench serve`, vLLM's `bench serve` command line (chapters 06 and 08),
against `minicb serve` on loopback: a vLLM command line runs unchanged, prints vLLM's summary
block and writes vLLM's result keys, with the benchmark contract's declaration beside them."""

from __future__ import annotations

import json
import socket

import pytest

from minicb import Engine
from minicb.__main__ import main
from minicb.benchmark.serve import goodput_slo, serve_parser
from minicb.benchmark.sim import make_sim_engine
from minicb.serving.server import ServerThread, create_app

# what vLLM's `bench serve --save-result` writes, whatever the percentiles asked
VLLM_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
             "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
             "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests")


@pytest.fixture(scope="module")
def sim_server():
    """A server on the simulated model: no weights, a vocabulary of 49,152 tokens (vLLM's
    random dataset draws ids below 10,000), steps timed by the cost model."""
    app = create_app(make_sim_engine(policy="pd", num_pages=512), "sim-model")
    with ServerThread(app) as url:
        yield url


def test_a_vllm_command_line_runs_unchanged(sim_server, tmp_path, capsys):
    """vLLM's flags, as its users type them: the summary block in ms (mean, median, P99) and
    a result file with vLLM's keys, every request completed; minicb's contract summary (max
    ITL among it) under "minicb"."""
    argv = ["bench", "serve", "--backend", "openai", "--base-url", sim_server,
            "--endpoint", "/v1/completions", "--model", "sim-model", "--dataset-name", "random",
            "--random-input-len", "64", "--random-output-len", "8", "--random-range-ratio", "0.5",
            "--num-prompts", "12", "--request-rate", "inf", "--ignore-eos", "--save-result",
            "--result-dir", str(tmp_path), "--result-filename", "r.json", "--disable-tqdm"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in printed
    for line in ("Successful requests:                     12", "Mean TTFT (ms):",
                 "Median TPOT (ms):", "P99 ITL (ms):"):
        assert line in printed
    result = json.loads((tmp_path / "r.json").read_text())
    assert all(key in result for key in VLLM_KEYS)
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["request_rate"] == "inf" and result["backend"] == "openai"
    for metric in ("ttft", "tpot", "itl"):
        assert result[f"p99_{metric}_ms"] >= result[f"median_{metric}_ms"] > 0
    assert 12 * 32 <= result["total_input_tokens"] <= 12 * 96  # 64 +- 50%
    assert 12 * 4 <= result["total_output_tokens"] <= 12 * 12  # 8 +- 50%, run to the end
    summary = result["minicb"]["results"]["openai"]
    assert summary["completed"] == 12 and summary["max_itl_s"]["p99"] > 0
    assert result["minicb"]["declaration"]["workload"] == "random"


def test_vllms_default_file_name_and_chosen_percentiles(sim_server, tmp_path, monkeypatch,
                                                        capsys):
    """Without --result-filename the file is vLLM's LABEL-RATEqps-MODEL-DATE.json; the
    percentiles and metrics asked are the keys written."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "serve", "--base-url", sim_server, "--num-prompts", "4",
                 "--random-input-len", "16", "--random-output-len", "4", "--request-rate", "50",
                 "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90",
                 "--goodput", "ttft:0.000001", "--save-result", "--disable-tqdm"]) == 0
    printed = capsys.readouterr().out
    assert "Request rate configured (RPS):           50.00" in printed
    [path] = tmp_path.glob("openai-50.0qps-sim-model-*.json")
    result = json.loads(path.read_text())
    assert "p90_e2el_ms" in result and "p50_ttft_ms" in result and "p99_ttft_ms" not in result
    assert result["request_goodput"] == 0  # nobody meets a TTFT of a nanosecond


def test_the_chat_backend_sends_the_prompts_text(word_model, capsys):
    """openai-chat sends each prompt as text (from the server's /detokenize) to the chat
    endpoint."""
    app = create_app(Engine(word_model, policy="pd", num_pages=128), "tiny")
    with ServerThread(app) as url:
        assert main(["bench", "serve", "--backend", "openai-chat", "--base-url", url,
                     "--num-prompts", "3", "--random-input-len", "8", "--random-output-len",
                     "3", "--vocab-size", "256", "--disable-tqdm"]) == 0
    assert "Successful requests:                     3" in capsys.readouterr().out


def test_minicbs_own_workloads_run_through_bench_serve(tiny_model, tmp_path, capsys):
    """--workload sends one of minicb's scenarios; its declaration goes in the file."""
    app = create_app(Engine(tiny_model, policy="pd", num_pages=256), "tiny")
    with ServerThread(app) as url:
        assert main(["bench", "serve", "--base-url", url, "--workload", "mixed-chat",
                     "--num-prompts", "3", "--vocab-size", "256", "--disable-tqdm",
                     "--save-result", "--result-filename", str(tmp_path / "w.json")]) == 0
    result = json.loads((tmp_path / "w.json").read_text())
    assert result["completed"] == 3
    assert result["minicb"]["declaration"]["workload"] == "mixed-chat"


def test_no_server_or_a_wrong_model_is_one_line_not_a_traceback(sim_server, capsys):
    """A server that is not running, or a model it does not serve: exit code 2 and a line
    saying what to do."""
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "1"]) == 2
    assert "is the server running?" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", sim_server, "--model", "gpt-9",
                 "--num-prompts", "1", "--disable-tqdm"]) == 2
    assert "the warm-up request failed (404)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--goodput", "ttft"], "KEY:MILLISECONDS"),
    (["--goodput", "itl:5"], "KEY:MILLISECONDS"),
    (["--goodput", "ttft:soon"], "not a number"),
    (["--random-range-ratio", "1"], "--random-range-ratio must be in [0, 1)"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--percentile-metrics", "ttft,speed"], "--percentile-metrics takes names among"),
    (["--metric-percentiles", "99,x"], "--metric-percentiles takes"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "ending in"),
    (["--workload", "mixed-chat", "--workload-file", "x.jsonl"], "not both"),
])
def test_bad_flags_are_named_before_anything_is_sent(argv, message, capsys):
    """Each bad flag is refused with its name, exit code 2, before any request."""
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *argv]) == 2
    assert message in capsys.readouterr().err


def test_goodput_takes_vllms_milliseconds_and_every_flag_has_help():
    """--goodput's milliseconds become the contract's seconds (e2el is minicb's e2e)."""
    assert goodput_slo(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 0.5, "tpot": 0.05,
                                                                 "e2e": 2.0}
    assert all(action.help for action in serve_parser()._actions)
