"""`python -m minicb demo`, the main job of `make demo`, on the bundled model."""

from __future__ import annotations

import pytest

from minicb.__main__ import DEMO_QUESTIONS, main


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--quantization", "int8"]], ids=["float32", "int8"])
def test_demo_answers_every_question_with_timing(smollm2_dir, capsys, extra):
    assert main(["demo", "--max-tokens", "6", *extra]) == 0
    out = capsys.readouterr().out
    assert out.startswith("loaded smollm2-135m in ")
    assert ("int8 weights" in out.splitlines()[0]) == bool(extra)
    for question in DEMO_QUESTIONS:
        assert f">>> {question}\n" in out
    assert out.count("TTFT ") == len(DEMO_QUESTIONS)
    assert "tokens/s over" in out


def test_unknown_command_prints_usage(capsys):
    assert main(["fly"]) == 2
    assert "usage: python -m minicb {demo," in capsys.readouterr().err
