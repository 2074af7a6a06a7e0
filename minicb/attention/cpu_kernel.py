"""The CPU kernel backend (chapter 08): decode rows attend over their pages in place
(`paged_decode.c`, float32 or bfloat16 caches), where the reference copies them out first; for
one decoded row (`cpu_ops.c`), `gemv` streams each weight once and `decode_layer` runs a layer in
one call. The rest is the reference's. Built with `cc` (or `$CC`) once per source, flags,
compiler and CPU, into `$MINICB_CACHE/kernels`."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from minicb.attention import torch_ref
from minicb.attention.metadata import AttentionMetadata, int_tensor
from minicb.attention.torch_ref import rms_norm, rope, store_kv  # noqa: F401 (the backend API)
from minicb.config import cache_root, cpuinfo

SOURCE = Path(__file__).with_name("paged_decode.c")
SOURCES = (SOURCE, SOURCE.with_name("cpu_ops.c"))
# -march=native: built where it runs (the cache key names the CPU); -fopenmp: the loops' threads
# are PyTorch's own (the same libgomp.so.1); no -ffast-math, which would set flush-to-zero for
# the whole process: `omp simd reduction` already lets the compiler vectorize the dot products;
# -fno-strict-aliasing: the bfloat16 path writes a row's bits as integers and reads them as floats
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing", "-fPIC", "-shared")
KEEP_BUILDS = 4  # builds kept in the cache: other checkouts or compilers may share it
PROFILE_NAME = "minicb::paged_decode_attention"
DTYPES = (torch.float32, torch.bfloat16)  # cache dtypes the attention kernel reads

_lock = threading.Lock()  # one build per process, even when engines start in several threads
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {  # C function -> argument types
    **dict.fromkeys(("paged_decode_attention", "paged_decode_attention_bf16"),
                    [_P, _I, _P, _P, _P, _P, _I, _P, *[_I] * 6, _F, _I]),
    "gemv_f32": [_P, _P, _P, _P, _I, _I, _I, _I],
    "decode_layer_f32": [_P, _P, _P, _P, _F, *[_P] * 12, _I, _P, _P, *[_I] * 6, _F, _I],
}


def _compiler() -> list[str] | None:
    """The C compiler's command line: $CC (which may be "ccache gcc"), else cc or gcc."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def library_path(compiler: list[str]) -> Path:
    """Where the built kernels live: one file per source, flags, compiler and CPU."""
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except FileNotFoundError as exc:
        raise RuntimeError(f"the C compiler {shlex.join(compiler)!r} was not found") from exc
    key = hashlib.sha256("\n".join([*(s.read_text() for s in SOURCES), " ".join(CFLAGS),
                                    shlex.join(compiler), version, cpuinfo("flags", "Features")
                                    or platform.processor() or platform.machine()]
                                   ).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"paged_decode-{key}.so"


def _build(compiler: list[str], target: Path) -> ctypes.CDLL:
    """Compile into a file of our own, load it, rename it to `target` (never half a file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.stem}-{os.getpid()}.so")
    try:
        done = subprocess.run([*compiler, *CFLAGS, *map(str, SOURCES), "-o", str(tmp), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{shlex.join(compiler)} could not build "
                               f"{', '.join(s.name for s in SOURCES)}:\n"
                               f"{done.stderr.strip()[-2000:]}")
        library = ctypes.CDLL(str(tmp))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    # each change to the sources, flags or compiler makes a new build, and nothing else removes
    # the old: keep the newest (a process that loaded a removed one keeps its mapping)
    builds = sorted(target.parent.glob("paged_decode-*.so"), key=lambda p: p.stat().st_mtime)
    for old in builds[:-KEEP_BUILDS]:
        old.unlink(missing_ok=True)
    return library


def _load(compiler: list[str]) -> ctypes.CDLL:
    path = library_path(compiler)
    try:
        library = ctypes.CDLL(str(path))  # built before, by this or another process
    except OSError:  # not built yet, or a damaged file in the cache: build it (again)
        library = _build(compiler, path)
    for name, argtypes in _SIGNATURES.items():
        getattr(library, name).argtypes = argtypes
    return library


@functools.cache
def _built() -> ctypes.CDLL | str:
    """The compiled kernels, or why they could not be built (tried once per process)."""
    try:
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError("no C compiler found (set CC, or install gcc)")
        return _load(compiler)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return str(exc)


def library() -> ctypes.CDLL:
    """The compiled kernels, built on first use; RuntimeError saying why not."""
    with _lock:
        built = _built()
    if isinstance(built, str):
        raise RuntimeError(f"the CPU attention kernel is unavailable: {built}")
    return built


def unavailable_reason() -> str | None:
    """None if the kernels build and load here, else why not (tried once per process)."""
    try:
        library()
    except RuntimeError as exc:
        return str(exc)
    return None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight.T (+ bias) for a few float32 CPU rows, weight [out, in] contiguous."""
    y = torch.empty(x.shape[0], weight.shape[0])
    x = x if x.is_contiguous() else x.contiguous()
    library().gemv_f32(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                       y.data_ptr(), len(x), *weight.shape, torch.get_num_threads())
    return y


def decode_layer(x: torch.Tensor, weights: list[torch.Tensor | None], eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    """One decoded float32 row x [1, hidden] through a layer (`DecoderLayer.row_weights`), in
    place, in one C call: dispatched from Python, its thirty operations cost a sixth of a step."""
    k_cache, v_cache = kv_cache
    _check_metadata(meta, k_cache)
    page_size, kv_heads, head_dim = k_cache.shape[1:]
    hidden, q_size, inter = x.shape[1], weights[6].shape[1], weights[9].shape[1]
    pos = meta.context_lens_list[0] - 1
    slot = meta.page_table_list[0][pos // page_size] * page_size + pos % page_size
    scratch = torch.empty(2 * hidden + 2 * q_size + 2 * kv_heads * head_dim + 2 * inter)
    weights = [w if w is None or w.is_contiguous() else w.contiguous() for w in weights]
    failed = library().decode_layer_f32(
        x.data_ptr(), scratch.data_ptr(), weights[0].data_ptr(), weights[1].data_ptr(), eps,
        *(None if w is None else w.data_ptr() for w in weights[2:]), cos.data_ptr(),
        sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot, meta.page_tables.data_ptr(),
        meta.context_lens.data_ptr(), page_size, hidden, q_size // head_dim, kv_heads, head_dim,
        inter, scale, torch.get_num_threads())
    if failed:
        raise MemoryError("the CPU attention kernel could not allocate its score buffers")
    return x


def _check_metadata(meta: AttentionMetadata, k_cache: torch.Tensor) -> None:
    """What the C code trusts, checked once per step (where C would read out of bounds)."""
    num_pages = k_cache.shape[0]
    if meta.cache.get("cpu_kernel_checked") == num_pages:  # every layer's cache has this shape
        return
    tables, lens = meta.page_tables, meta.context_lens
    for name, t in (("page_tables", tables), ("context_lens", lens)):
        if t.dtype != torch.int32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"the CPU attention kernel needs {name} as a contiguous int32 CPU "
                             f"tensor, got {t.dtype} on {t.device}")
    nd = meta.num_decodes
    if k_cache.shape[1] != meta.page_size:
        raise ValueError(f"caches hold pages of {k_cache.shape[1]} tokens, the metadata says "
                         f"{meta.page_size}")
    if lens[:nd].tolist() != meta.context_lens_list[:nd]:
        raise ValueError("context_lens and context_lens_list disagree")
    needed = int_tensor([-(-n // meta.page_size) for n in meta.context_lens_list[:nd]])
    width = tables.shape[1]
    owned = tables[:nd][torch.arange(width)[None, :] < needed[:, None]]
    if needed.max() > width or (owned.numel() and (owned.min() < 0 or owned.max() >= num_pages)):
        raise ValueError(f"a decode row's page table is too short or names a page outside the "
                         f"cache's {num_pages} pages")
    meta.cache["cpu_kernel_checked"] = num_pages


def attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Write rows [0, num_decodes) of `out` with the kernel."""
    nd = meta.num_decodes
    if not nd:
        return
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[-2]
    if q.shape[0] != meta.query_start_list[-1] or out.shape != q.shape:
        raise ValueError(f"q has {q.shape[0]} rows and out {out.shape[0]}; the metadata's "
                         f"members have {meta.query_start_list[-1]} query rows")
    if num_heads % num_kv_heads or k_cache.shape[-1] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q has {num_heads} heads of {head_dim}, the caches are "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _check_metadata(meta, k_cache)
    qd = q[:nd].float()  # the kernel computes in float32 whatever the caches hold
    if qd.stride(2) != 1 or qd.stride(1) != head_dim:
        qd = qd.contiguous()
    od = out[:nd] if out.dtype == torch.float32 and out.is_contiguous() else \
        torch.empty(nd, num_heads, head_dim)
    tables, lens = meta.page_tables, meta.context_lens
    fn = getattr(library(), "paged_decode_attention" + ("_bf16" if k_cache.dtype ==
                                                        torch.bfloat16 else ""))
    # named in torch.profiler tables (a ctypes call is otherwise invisible to it; chapter 08);
    # the threads are this thread's setting: a server's engine thread has its own OpenMP state
    with torch.profiler.record_function(PROFILE_NAME):
        failed = fn(qd.data_ptr(), qd.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                    od.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(), nd,
                    num_heads, num_kv_heads, head_dim, meta.page_size,
                    max(meta.context_lens_list[:nd]), scale, torch.get_num_threads())
    if failed:
        raise MemoryError("the CPU attention kernel could not allocate its score buffers")
    if od.data_ptr() != out.data_ptr():
        out[:nd] = od


@functools.cache  # once per kind of cache and process
def _warn_reference(dtype: torch.dtype, device: torch.device) -> None:
    logging.getLogger("minicb").warning(f"the cpu kernel reads contiguous float32 or bfloat16 "
                                        f"CPU caches: {dtype} on {device} take the torch reference")


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, D] -> [T, heads, D]: decode rows by the kernel, chunks by the reference."""
    if not (q.device.type == "cpu" and k_cache.dtype == v_cache.dtype and k_cache.dtype in DTYPES
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        _warn_reference(k_cache.dtype, k_cache.device)
        return torch_ref.attend(q, k_cache, v_cache, meta, scale)
    out = torch.empty(q.shape, dtype=q.dtype)
    attend_decodes(q, k_cache, v_cache, meta, scale, out)
    torch_ref.attend_prefills(q, k_cache, v_cache, meta, scale, out)
    return out
