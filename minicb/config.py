"""`EngineConfig` (chapter 01, grown in chapters 02-08) and the device and cache helpers."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

POLICIES = ("single", "static", "dynamic", "continuous", "chunked", "pd")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
QUANTIZATIONS = (None, "int8")  # int8: weight-only, see minicb/model/quant.py
DTYPES = ("auto", "float32", "bfloat16", "float16")
PREEMPTIONS = ("newest", "priority", "deadline", "fair")
PREEMPTION_MODES = ("recompute", "swap")


def is_int(value: object) -> bool:
    """An int that is not a bool (True is an int to Python, never a count or an id here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """An int or float that is not a bool, NaN or infinite: what every numeric knob needs."""
    # NaN compares false; an int too large for a float (10**400) is no knob's value either
    return (is_int(value) or isinstance(value, float)) and abs(value) <= sys.float_info.max


def is_positive_int(value: object) -> bool:
    return is_int(value) and value >= 1


def torch_dtype(name: str, device: str):
    """The torch dtype a `dtype` knob names: "auto" is float32 on the CPU, bfloat16 on CUDA."""
    import torch
    if name == "auto":
        name = "float32" if torch.device(device).type == "cpu" else "bfloat16"
    return getattr(torch, name)


def resolve_device(device: object, quantization: str | None = None) -> str:
    """The device a `device` knob names, checked; "auto": CUDA if torch sees a GPU (chapter 07)."""
    import torch
    if str(device) == "auto":  # the CPU if a CPU-only option (int8 weights) is asked
        return "cuda" if torch.cuda.is_available() and not quantization else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r} "
                         f"(minicb runs on those)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = ("it is a CPU-only build: install a CUDA build of torch (README, 'Running on a "
               "GPU')" if torch.version.cuda is None else "no GPU is visible")
        raise ValueError(f"device={device!r}, but torch {torch.__version__} cannot use CUDA "
                         f"({why}); use device='cpu'")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}, but torch sees {torch.cuda.device_count()} "
                         f"CUDA GPU(s), numbered from 0")
    return str(device)


def cpuinfo(*names: str) -> str | None:
    """The value of the first /proc/cpuinfo line whose name starts with one of `names`, or None."""
    try:
        with open("/proc/cpuinfo") as lines:
            values = (line.split(":", 1)[1].strip() for line in lines if line.startswith(names))
            return next(values, None)
    except OSError:
        return None


def cache_root() -> Path:
    """Where minicb keeps what it builds once: $MINICB_CACHE, else ~/.cache/minicb."""
    return Path(os.environ.get("MINICB_CACHE") or Path.home() / ".cache" / "minicb").expanduser()


@dataclass
class EngineConfig:
    """Every knob of the engine; names follow vLLM's where vLLM has the same knob."""

    policy: str = "pd"
    page_size: int = 16
    num_pages: int | None = None  # None: 1024 on the CPU; on CUDA sized from free memory, at
    # most max_num_seqs full-length contexts
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    chunk_size: int = 256
    min_chunk: int = 1
    batch_timeout: float = 8  # dynamic batching: steps (int) or seconds (float with seconds=True)
    batch_timeout_in_seconds: bool = False
    enable_prefix_caching: bool = True
    # who waits first and who is preempted first when decodes need a page (chapter 06): "newest"
    # (first come first served), "priority" (by `priority`), "deadline" (earliest first) or
    # "fair" (the tenant served the fewest tokens so far first)
    preemption: str = "newest"
    # with preemption="priority": a waiting request's priority improves by one for every this
    # many steps it has waited, so a stream of important requests cannot starve it (chapter 06)
    priority_aging_steps: int | None = None
    # a bound on preemption loss (chapter 06): a request preempted this many times is admitted
    # again only with pages for its whole life (prompt + max_tokens) and is never preempted
    # again; 0 reserves every request's whole life from the start. None: no bound
    max_preemptions: int | None = None
    # what a preempted request's K/V becomes (chapter 06, vLLM's knob): "recompute" frees its
    # pages and computes them again when it returns; "swap" copies them to `num_swap_pages`
    # pages of host memory and back (None: as many as num_pages), recomputing only when the
    # swap space is full
    preemption_mode: str = "recompute"
    num_swap_pages: int | None = None
    # another answer to a full cache (chapter 06): a request that arrives when the free pages,
    # less what the waiting prompts will take, cannot hold its prompt finishes at once with
    # finish_reason "rejected" (the server answers 503) instead of waiting
    reject_when_full: bool = False
    check_invariants: bool = False
    # per-step copies of the waiting queue, page tables, slots and cached pages in the trace
    # (what the step-through pictures draw); False keeps each StepRecord as small as its batch,
    # for long benchmark runs where those copies would cost more than the step
    trace_snapshots: bool = True
    attention_backend: str = "auto"
    device: str = "auto"  # CUDA when torch sees a GPU, else the CPU (`resolve_device`)
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA; a model passed in loaded: its own
    # "int8": weight-only int8 projections (CPU decode speed); with a model passed in already
    # loaded, None accepts it as it is and "int8" requires it loaded with quantization="int8"
    quantization: str | None = None
    use_cuda_graphs: bool = True
    gpu_memory_utilization: float = 0.9
    # speculative decoding by prompt lookup (chapter 08): up to this many guessed tokens per
    # decode member and step, checked by the same forward; 0 turns it off
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4  # the longest run of last tokens looked up in the request
    prompt_lookup_min: int = 2  # the shortest

    def __post_init__(self) -> None:
        policy = self.policy
        if isinstance(policy, type):
            raise ValueError(f"policy={policy.__name__} is a class: pass an instance, "
                             f"policy={policy.__name__}()")
        if not (policy in POLICIES if isinstance(policy, str) else hasattr(policy, "schedule")):
            raise ValueError(f"policy must be one of {POLICIES} or a Scheduler, got {policy!r}")

        for names, ok, what in (
                (("page_size", "max_num_seqs", "max_num_batched_tokens", "chunk_size",
                  "min_chunk", "prompt_lookup_max", "prompt_lookup_min"), is_positive_int,
                 "a positive integer"),
                (("num_pages", "priority_aging_steps", "num_swap_pages"),
                 lambda v: v is None or is_positive_int(v), "a positive integer or None"),
                (("max_preemptions",), lambda v: v is None or is_int(v) and v >= 0,
                 "an integer >= 0 or None"),
                (("enable_prefix_caching", "check_invariants", "trace_snapshots",
                  "reject_when_full", "use_cuda_graphs", "batch_timeout_in_seconds"),
                 lambda v: isinstance(v, bool), "True or False"),
                (("num_speculative_tokens",), lambda v: is_int(v) and v >= 0, "an integer >= 0"),
                (("batch_timeout",), lambda v: is_finite_number(v) and v >= 0,
                 "a finite number >= 0"),
                (("gpu_memory_utilization",), lambda v: is_finite_number(v) and 0 < v <= 1,
                 "in (0, 1]"),
                (("quantization",), lambda v: v in QUANTIZATIONS, "None or 'int8'"),
                (("page_size",), lambda v: v & (v - 1) == 0, "a power of two"),
                (("prompt_lookup_min",), lambda v: v <= self.prompt_lookup_max,
                 f"<= prompt_lookup_max ({self.prompt_lookup_max})")):
            for name in names:
                if not ok(getattr(self, name)):
                    raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r:.80}")
        for name, allowed in (("dtype", DTYPES), ("preemption", PREEMPTIONS),
                              ("preemption_mode", PREEMPTION_MODES),
                              ("attention_backend", ATTENTION_BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name, does, knob, value in (
                ("priority_aging_steps", "ages priorities", "preemption", "priority"),
                ("num_swap_pages", "sizes the swap space", "preemption_mode", "swap")):
            if getattr(self, name) is not None and getattr(self, knob) != value:
                raise ValueError(f"{name} {does}: it needs {knob}={value!r}")
        if self.quantization and str(self.device).startswith("cuda"):
            raise ValueError("quantization='int8' is a CPU option (torch's int8-weight CPU "
                             "kernel); on CUDA use dtype='bfloat16'")
        # a Scheduler instance is held to the rules of the policy it names (PDScheduler() is "pd")
        kind = policy if isinstance(policy, str) else getattr(policy, "name", None)
        for applies, small, big, why in (
                (kind in ("chunked", "pd"), "max_num_batched_tokens", "max_num_seqs",
                 ", or running decodes cannot all advance in one step"),
                (kind == "pd", "chunk_size", "max_num_seqs", ""),
                (kind == "pd", "chunk_size", "min_chunk", ""),
                (kind == "pd", "max_num_batched_tokens", "min_chunk",
                 ", or a chunk that size never fits a step and prefills never start")):
            low, high = getattr(self, small), getattr(self, big)
            if applies and low < high:
                raise ValueError(f"{small} ({low}) must be >= {big} ({high}) under policy "
                                 f"{kind!r}{why}")
        if self.device != "auto":
            resolve_device(self.device)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build from keyword arguments, refusing unknown names with the list of known ones."""
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(kwargs) - known):
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)
