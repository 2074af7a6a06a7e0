"""The replayed traces of bench/README.md's priority and fairness sweeps (chapter 06), made
the same way every time: `python bench/make_traces.py DIR` writes

    DIR/chat-urgent.jsonl  200 mixed-chat requests at 10 req/s (Poisson, seed 0), every fifth
                           at priority -1 (urgent; lower goes first under --preemption priority)
    DIR/fair.jsonl         100 chat requests at 25 req/s (Poisson, seed 5), prompts lognormal
                           around 512 tokens, those of 512 or more at priority 1 (served last
                           by priority)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from minicb.benchmark.workload import Workload, get_workload, make_workload, save_workload_file


def main(folder: str) -> None:
    chat = get_workload("mixed-chat", num_requests=200, rate=10)
    urgent = Workload("chat-urgent", [dataclasses.replace(r, priority=-1 if i % 5 == 0 else 0)
                                      for i, r in enumerate(chat.requests)])
    fair = make_workload(100, prompt_lengths="lognormal:512:1.0:16:6000",
                         output_lengths="uniform:16:256", arrival="poisson", rate=25, seed=5)
    by_size = Workload("fair", [dataclasses.replace(r, priority=int(r.prompt_len >= 512))
                                for r in fair.requests])
    for workload in (urgent, by_size):
        print("wrote", save_workload_file(workload, Path(folder) / f"{workload.name}.jsonl"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/minicb-traces")
