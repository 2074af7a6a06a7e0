"""The simulated executor (chapter 06): the real scheduler, pages and trace, with time modelled.

`SimModel` stands in for the model: same `forward` signature, logits whose argmax is one fixed
ordinary token, and no tensors of any size. Instead of computing, it advances a `SimClock` by a
cost model of the step:

    step_time = a + b * prefill_tokens + c * decode_rows + d * sum(context lengths)
                  + e * sum(prefill chunk tokens * its context length)

plus `s` seconds per page copied to or from the swap space (preemption_mode="swap"), charged
outside the forward. `fit_cost_model` fits a..e by least squares to a real run's trace
(`python -m minicb profile` does it on this machine); `PRESETS["h100-like"]` is set from
published-style GPU figures and is an assumption, not a measurement. With
`make_sim_engine(..., trace_snapshots=False)` (what the benchmark uses), 10,000 mixed-chat
requests run in about 15 s on two CPU cores, and every result made this way says "simulated"
in its declaration.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

FEATURES = ("a", "b", "c", "d", "e")
FEATURE_MEANING = {
    "a": "seconds per step (fixed cost: weights read, launches, host work)",
    "b": "seconds per prefill token",
    "c": "seconds per decode row",
    "d": "seconds per token of context summed over the step's members (KV reads)",
    "e": "seconds per (prefill chunk token x that member's context length) (attention)",
}
SWAP_MEANING = "seconds per page copied to or from host memory (swap), outside the forward"
SIM_TOKEN = 100  # "t" in the SmolLM2 vocabulary: an ordinary token, never EOS or special


class SimClock:
    """A clock that only moves when told (chapter 06): call it for the time in seconds;
    `sleep(dt)` and `advance(dt)` move it forward. The engine uses `sleep` when it idles."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = float(start)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds})")
        self.t += float(seconds)

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, float(seconds))


@dataclass
class CostModel:
    """Step time as a linear function of the step's shape (chapter 06); see the module text."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    d: float = 0.0
    e: float = 0.0
    s: float = 0.0  # seconds per page copied to or from host memory (swap, chapter 06)
    name: str = "custom"
    source: str = ""  # where the numbers come from: a fit on a machine, or an assumption
    assumption: bool = False  # True for presets not measured here
    fit: dict[str, Any] = field(default_factory=dict)  # r2, num_steps, target, machine

    def predict(self, prefill_tokens: float, decode_rows: float, context_tokens: float,
                prefill_context: float = 0.0) -> float:
        return (self.a + self.b * prefill_tokens + self.c * decode_rows
                + self.d * context_tokens + self.e * prefill_context)

    def predict_features(self, x: np.ndarray) -> np.ndarray:
        """Rows of `step_features` -> predicted seconds."""
        return np.asarray(x, dtype=float) @ self.coefficients

    @property
    def coefficients(self) -> np.ndarray:
        return np.array([self.a, self.b, self.c, self.d, self.e])

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["formula"] = ("step_time = a + b*prefill_tokens + c*decode_rows + "
                          "d*sum(context) + e*sum(prefill_tokens*context) + s*pages_swapped")
        out["meaning"] = {**FEATURE_MEANING, "s": SWAP_MEANING}
        return out

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        known = {k: data[k] for k in (*FEATURES, "s", "name", "source", "assumption", "fit")
                 if k in data}
        model = cls(**known)
        for key in (*FEATURES, "s"):
            value = getattr(model, key)
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"cost model coefficient {key} must be a finite number >= 0, "
                                 f"got {value!r}")
        return model

    @classmethod
    def load(cls, name_or_path: str | Path) -> CostModel:
        """A preset name ('h100-like', 'cpu' = bench/cost_model_cpu.json) or a JSON path."""
        key = str(name_or_path)
        if key in PRESETS:
            return PRESETS[key]
        path = Path(DEFAULT_CPU_COST_MODEL if key == "cpu" else key)
        make = "run `python -m minicb profile` to make one"
        if path.is_dir():
            raise ValueError(f"cost model {key!r} is a directory, not a JSON file")
        if not path.is_file() and key == "cpu":
            raise ValueError(f"cost model 'cpu' reads {str(path)!r}: no such file ({make})")
        if not path.is_file():
            raise ValueError(f"cost model {key!r} is neither a preset {sorted(PRESETS) + ['cpu']}"
                             f" nor a JSON file (no such file; {make})")
        wanted = f"expected a JSON object with coefficients {', '.join(FEATURES)} ({make})"
        try:
            data = json.loads(path.read_text(encoding="utf-8-sig"))
        except UnicodeDecodeError:
            raise ValueError(f"cost model {str(path)!r} is not UTF-8 text: {wanted}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost model {str(path)!r} is not JSON ({exc.msg}, line "
                             f"{exc.lineno}): {wanted}") from None
        except OSError as exc:
            raise ValueError(f"cost model {str(path)!r}: cannot read it ({exc.strerror})") \
                from None
        if not isinstance(data, dict) or not any(k in data for k in FEATURES):
            raise ValueError(f"cost model {str(path)!r} holds no coefficients: {wanted}")
        unknown = sorted(set(data) - {*FEATURES, "s", "name", "source", "assumption", "fit",
                                      "formula", "meaning"})
        if unknown:  # a misspelt coefficient ("E") would silently be 0
            raise ValueError(f"cost model {str(path)!r}: unknown key(s) {unknown}: {wanted}")
        try:
            model = cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"cost model {str(path)!r}: {str(exc).removeprefix('cost model ')}")\
                from None
        missing = [k for k in FEATURES if k not in data]
        if missing:
            raise ValueError(f"cost model {str(path)!r} lacks coefficient(s) "
                             f"{', '.join(missing)}: give each of {', '.join(FEATURES)} (0 for a "
                             "term the model leaves out)")
        return model


DEFAULT_CPU_COST_MODEL = Path(__file__).resolve().parents[2] / "bench" / "cost_model_cpu.json"

# An ASSUMPTION, not a measurement: a Llama-3-8B-class model in bf16 on one H100 SXM, from
# published peak figures (3.35 TB/s HBM, ~989 TFLOPS dense bf16) with assumed efficiencies:
#   a: 16 GB of weights read once per step at ~3 TB/s (~5.3 ms) plus ~0.7 ms launches/host
#   b, c: 2 * 8e9 FLOPs per token at ~600 TFLOPS effective (~27 us per token)
#   d: 128 KiB of K/V per context token (32 layers x 8 kv heads x 128 x 2 x 2 B) at ~3 TB/s
#   e: causal attention FLOPs 4 * 32 * 4096 per (query, key) pair at ~400 TFLOPS
#   s: a 16-token page of that K/V (2 MiB) over PCIe 5.0 x16 at ~50 GB/s
PRESETS: dict[str, CostModel] = {
    "h100-like": CostModel(
        a=6.0e-3, b=2.7e-5, c=2.7e-5, d=4.4e-8, e=1.3e-9, s=4.2e-5, name="h100-like",
        source="assumption: Llama-3-8B-class bf16 on one H100, from published peak bandwidth "
               "and bf16 throughput with assumed efficiencies; not measured",
        assumption=True),
}


# ------------------------------------------------------------------------------ the model
@dataclass
class SimModelConfig:
    """The shape fields the engine reads from a model config, no weights (chapter 06)."""

    vocab_size: int = 49152
    num_layers: int = 0
    num_kv_heads: int = 1
    head_dim: int = 1
    max_position_embeddings: int = 8192
    architecture: str = "simulated"


@dataclass
class SimModelInfo:
    """Stands in for `minicb.model.loader.ModelInfo`: no tokenizer, no reachable EOS
    (chapter 06)."""

    config: SimModelConfig
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = (0,)
    name: str = "simulated"
    path: Path | None = None


def sim_model_info(vocab: int = 49152, num_layers: int = 0,
                   max_position_embeddings: int = 8192) -> SimModelInfo:
    """Model info for the simulated executor (chapter 06). num_layers=0 means the engine's page
    pool allocates no K/V tensors: pages are pure bookkeeping."""
    if vocab <= SIM_TOKEN:
        raise ValueError(f"vocab must be > {SIM_TOKEN} (the simulated output token), got {vocab}")
    return SimModelInfo(SimModelConfig(vocab_size=vocab, num_layers=num_layers,
                                       max_position_embeddings=max_position_embeddings))


class SimModel:
    """A fake model (chapter 06) with the real forward signature. Each forward advances `clock`
    by `cost.predict(...)` of the step's shape and returns logits whose argmax is `token`.

    To keep 10,000-request runs cheap the logits cover ids 0..token only ([N, token + 1]): no
    other id could win anyway. `full_vocab=True` returns the whole [N, vocab] width."""

    def __init__(self, cost: CostModel, clock: SimClock, vocab: int = 49152,
                 token: int = SIM_TOKEN, full_vocab: bool = False) -> None:
        if not 0 <= token < vocab:
            raise ValueError(f"token must be in [0, vocab={vocab}), got {token}")
        self.cost = cost
        self.clock = clock
        self.token = token
        self.width = vocab if full_vocab else token + 1
        self._block = torch.zeros(0, self.width)
        self.attention_backend_name = "simulated"
        self.last_features: tuple[int, int, int, int] | None = None
        self.num_forwards = 0

    def set_attention_backend(self, name: str) -> None:
        self.attention_backend_name = name

    @staticmethod
    def features(meta: Any) -> tuple[int, int, int, int]:
        """(prefill tokens, decode rows, sum of context lengths, sum of chunk*context) of one
        step, from its attention metadata. A member advancing one token counts as a decode
        row, as the attention backends treat it."""
        prefill = decode = prefill_ctx = 0
        for q, ctx in zip(meta.query_lens, meta.context_lens_list):
            if q == 1:
                decode += 1
            else:
                prefill += q
                prefill_ctx += q * ctx
        return prefill, decode, sum(meta.context_lens_list), prefill_ctx

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                kv_caches: list, logits_indices: torch.Tensor) -> torch.Tensor:
        feats = self.features(meta)
        self.last_features = feats
        self.num_forwards += 1
        self.clock.advance(self.cost.predict(*feats))
        n = len(logits_indices)
        if n > len(self._block):  # grow a preallocated block; return contiguous rows of it
            self._block = torch.zeros(max(n, 2 * len(self._block), 64), self.width)
            self._block[:, self.token] = 1.0
        return self._block[:n]

    __call__ = forward


def charge_swaps(pool: Any, clock: SimClock, cost: CostModel) -> None:
    """Make each swap copy of `pool` advance `clock` by `cost.s` seconds a page (chapter 06):
    real copies take time, outside the forward, where the engine runs them."""
    def charged(copy: Any) -> Any:
        def run(pairs: list) -> None:
            clock.advance(cost.s * len(pairs))
            copy(pairs)
        return run
    pool.swap_out, pool.swap_in = charged(pool.swap_out), charged(pool.swap_in)


def make_sim_engine(cost: CostModel | str = "h100-like", vocab: int = 49152,
                    max_position_embeddings: int = 8192, **options: Any) -> Any:
    """An `Engine` on the simulated executor (chapter 06): real scheduler, pages and trace;
    a `SimClock` advanced by `cost`. Options are EngineConfig fields."""
    from minicb.engine import Engine

    cost = CostModel.load(cost) if isinstance(cost, str) else cost
    clock = SimClock()
    model = SimModel(cost, clock, vocab)
    info = sim_model_info(vocab, 0, max_position_embeddings)
    options.setdefault("attention_backend", "torch")
    options.setdefault("device", "cpu")
    engine = Engine((model, info), clock=clock, **options)
    charge_swaps(engine.pool, clock, cost)
    return engine


# ------------------------------------------------------------------------------ fitting
def step_features(trace: list[Any], records: list[Any] | None = None) -> np.ndarray:
    """One row [1, prefill tokens, decode rows, sum of context, sum of chunk*context] per step
    (chapter 06). A member's context after the step is `start + num_tokens`, where the engine
    recorded `Member.start`; in a trace made by hand (start None) it is reconstructed: it grows
    by the tokens the member advances, starts at its prefix-cache hit (from `records`) and
    restarts at 0 when it is preempted (unless it was swapped, keeping its K/V). A member
    advancing one token counts as a decode row, as in `SimModel`."""
    cached = {r.request_id: r.num_cached_tokens for r in (records or [])}
    ctx: dict[str, int] = {}
    rows = []
    for rec in trace:
        for rid in rec.preempted:
            if rid not in rec.swapped:
                ctx[rid] = 0
        prefill = decode = total = prefill_ctx = 0
        for m in rec.members:
            if m.num_tokens <= 0:
                continue
            start = m.start if m.start is not None else \
                ctx.get(m.request_id, cached.get(m.request_id, 0))
            now = ctx[m.request_id] = start + m.num_tokens
            total += now
            if m.num_tokens == 1:
                decode += 1
            else:
                prefill += m.num_tokens
                prefill_ctx += m.num_tokens * now
        rows.append([1.0, prefill, decode, total, prefill_ctx])
    return np.array(rows, dtype=float).reshape(-1, 5)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: refit without the most negative one until none
    is negative (a small active-set method; enough for five features)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def fit_cost_model(trace: list[Any], records: list[Any] | None = None, target: str = "duration",
                   skip: int = 0, name: str = "fitted",
                   use: tuple[str, ...] = FEATURES) -> CostModel:
    """Fit a..e by non-negative least squares to a real run's steps (chapter 06). `target`:
    'duration' (whole step, host work included: what latency sees) or 'forward' (t_forward
    only). `skip` drops the first steps (warm-up). `use` picks which coefficients may be
    non-zero. The fit's R^2 and step count go in `.fit`."""
    return fit_cost_model_runs([(trace, records)], target, skip, name, use)


def fit_cost_model_runs(runs: list[tuple[list[Any], list[Any] | None]],
                        target: str = "duration", skip: int = 0, name: str = "fitted",
                        use: tuple[str, ...] = FEATURES) -> CostModel:
    """`fit_cost_model` over several runs: `runs` is a list of (trace, records) (chapter 06)."""
    if target not in ("duration", "forward"):
        raise ValueError(f"target must be 'duration' or 'forward', got {target!r}")
    unknown = set(use) - set(FEATURES)
    if unknown or "a" not in use:
        raise ValueError(f"use must include 'a' and only name {FEATURES}, got {use!r}")
    xs, ys = [], []
    for trace, records in runs:
        steps = list(trace)[skip:]
        feats = step_features(trace, records)[skip:]
        for rec, row in zip(steps, feats):
            if any(m.num_tokens for m in rec.members):
                xs.append(row)
                ys.append(rec.duration if target == "duration" else rec.t_forward)
    if len(xs) < len(use):
        raise ValueError(f"need at least {len(use)} steps with work to fit, got {len(xs)}")
    x, y = np.array(xs), np.array(ys)
    cols = [FEATURES.index(k) for k in use]
    coef = np.zeros(5)
    # scale columns so the solver sees comparable magnitudes
    scale = np.maximum(np.abs(x[:, cols]).max(axis=0), 1e-12)
    coef[cols] = _nonnegative_lstsq(x[:, cols] / scale, y) / scale
    pred = x @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    model = CostModel(*coef.tolist(), name=name)
    model.fit = {"target": target, "num_steps": len(xs),
                 "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
                 "mean_abs_error_s": float(np.abs(y - pred).mean()),
                 "mean_step_s": float(y.mean()), "total_s": float(y.sum()),
                 "predicted_total_s": float(pred.sum()), "machine": machine_description()}
    return model


def measure_swap_cost(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int = 16,
                      dtype: torch.dtype = torch.float32, device: str = "cpu",
                      num_pages: int = 32, repeats: int = 9) -> float:
    """Seconds per page copied to host memory or back (the cost model's `s`, chapter 06): the
    median over `repeats` of swapping `num_pages` scattered pages out and in, of a page pool
    shaped like the model's, every page written once first (the first write to host memory
    is the OS handing it over, not the copy)."""
    from minicb.kv_cache import PagePool

    pool = PagePool(2 * num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device,
                    num_swap_pages=2 * num_pages)
    pool.every_layer.fill_(1.0)
    pool.swap_store.fill_(1.0)
    order = np.random.default_rng(0)
    times = []
    for _ in range(repeats):
        device_pages = order.permutation(2 * num_pages)[:num_pages].tolist()
        host_pages = order.permutation(2 * num_pages)[:num_pages].tolist()
        start = time.perf_counter()
        pool.swap_out(list(zip(device_pages, host_pages)))
        pool.swap_in(list(zip(host_pages, device_pages)))
        if pool.every_layer.is_cuda:
            torch.cuda.synchronize(pool.every_layer.device)
        times.append((time.perf_counter() - start) / (2 * num_pages))
    return float(np.median(times))


def recompute_seconds(cost: CostModel, num_computed: int, num_cached: int,
                      chunk_size: int) -> float:
    """The forward time recomputing a preempted request adds, by the cost model (chapter 06,
    exercise 6.5): its tokens past the prefix-cache hit (`num_cached`, full prompt pages still
    in the index) prefilled again in chunks of at most `chunk_size`, each chunk of L tokens
    ending at context `end` costing b*L + d*end + e*L*end. No `a`: the chunks ride in steps
    that run anyway, for the other requests or the victim's own next token. (`SimModel`
    charges a 1-token member as a decode row, c + d*end; this formula keeps b and e for it.)"""
    _check_victim(num_computed, num_cached, chunk_size=chunk_size)
    seconds, start = 0.0, num_cached
    while start < num_computed:
        end = min(start + chunk_size, num_computed)
        seconds += cost.b * (end - start) + cost.d * end + cost.e * (end - start) * end
        start = end
    return seconds


def swap_break_even(cost: CostModel, num_computed: int, num_cached: int, page_size: int,
                    chunk_size: int) -> float:
    """Seconds per page copied at which swapping a victim costs what recomputing it does
    (chapter 06, exercise 6.5): swap copies the ceil(num_computed / page_size) pages holding its
    tokens out, and back in all but the `num_cached // page_size` prompt pages it finds still
    cached when it returns (shared, as recompute shares them); a copy cost `s` below this makes
    swap the cheaper answer."""
    _check_victim(num_computed, num_cached, page_size=page_size)
    if num_cached % page_size:
        raise ValueError(f"num_cached counts whole cached pages: a multiple of page_size "
                         f"{page_size}, got {num_cached}")
    pages = math.ceil(num_computed / page_size)
    return (recompute_seconds(cost, num_computed, num_cached, chunk_size)
            / (2 * pages - num_cached // page_size))


def _check_victim(num_computed: int, num_cached: int, **sizes: int) -> None:
    if not 0 <= num_cached <= num_computed or num_computed < 1:
        raise ValueError(f"a victim needs 1 <= num_computed and 0 <= num_cached <= "
                         f"num_computed, got num_computed={num_computed}, "
                         f"num_cached={num_cached}")
    for key, value in sizes.items():
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")


def machine_description() -> dict[str, Any]:
    """Device and CPU facts for a declaration (chapter 06)."""
    import os
    info: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor()
                            or platform.machine(), "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads()}
    if hasattr(os, "getloadavg"):  # other work on the machine slows every step
        info["load_average_1min"] = round(os.getloadavg()[0], 2)
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info
