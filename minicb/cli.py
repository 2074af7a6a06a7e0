"""What every `python -m minicb` command's parser shares (chapters 06 and 08): a help format
that shows each flag's default, and the engine flags that `bench`, `sweep` and `serve` take
alike. Imported by `minicb.benchmark` and `minicb.serving`; imports only the engine's config."""

from __future__ import annotations

import argparse

from minicb.config import PREEMPTION_MODES


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """argparse's help with every flag's default (unless its help already says what the default
    is), and descriptions as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """An argparse parser for `python -m minicb <command>` whose help shows the defaults."""
    return argparse.ArgumentParser(prog=f"python -m minicb {prog}", description=description,
                                   formatter_class=HelpFormatter)


def add_full_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Two answers to a full KV cache beside preemption (chapter 06): swap a victim's K/V out
    instead of recomputing it, and reject an arrival the cache cannot take (bench, sweep,
    serve)."""
    parser.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default=None,
                        help="what a preempted request's K/V becomes: recompute (freed, "
                             "computed again when it returns; None: recompute) or swap (copied "
                             "to host memory and back; recomputed when the swap space is full)")
    parser.add_argument("--num-swap-pages", type=int, default=None, metavar="N",
                        help="with --preemption-mode swap: host pages of swap space (None: as "
                             "many as the KV pool has)")
    parser.add_argument("--reject-when-full", action="store_true",
                        help="a request that arrives when the free KV pages, less what the "
                             "waiting prompts will take, cannot hold its prompt finishes at "
                             "once as rejected (the server answers 503) instead of waiting")


def check_full_cache_flags(preemption_mode: str | None, num_swap_pages: int | None) -> None:
    """Refuse --num-swap-pages below 1 or without --preemption-mode swap, naming the flags
    (the engine's own message names its options) (chapter 06)."""
    if num_swap_pages is None:
        return
    if num_swap_pages < 1:
        raise ValueError(f"--num-swap-pages must be >= 1, got {num_swap_pages}")
    if preemption_mode != "swap":
        raise ValueError("--num-swap-pages sizes the swap space: it needs --preemption-mode "
                         "swap")
