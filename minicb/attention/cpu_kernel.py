"""The CPU kernel backend (chapter 08): decode rows attend over their pages in place, through
a small C kernel (`paged_decode.c`), instead of the torch reference's gathered copy of every
context. Prefill chunks, KV stores, RMSNorm and RoPE are the torch reference's own.

Why: in a decode step of 32 requests on SmolLM2 the reference spends about a quarter of the
step copying keys and values out of their pages (`index_select`) and then reads the copy again
in `scaled_dot_product_attention`; the kernel reads each key and value once, where it lies.

The kernel is compiled once with the system C compiler (`cc`, or `$CC`) and cached under
`$MINICB_CACHE/kernels`, keyed by its source, the flags, the compiler and this CPU. Where no
compiler works, `attention_backend="auto"` keeps the torch reference and `"cpu"` is refused
with the compiler's own message. It reads float32 or bfloat16 caches on the CPU and computes in
float32; anything else (float16) takes the reference's decode path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from minicb.attention import AttentionMetadata, _warn_once, int_tensor, torch_ref
from minicb.attention.torch_ref import rms_norm, rope, store_kv  # noqa: F401 (the backend API)
from minicb.config import cache_root, cpuinfo

SOURCE = Path(__file__).with_name("paged_decode.c")
# -march=native: built where it runs (the cache key names the CPU); -fopenmp: the loop's threads
# are PyTorch's own (the same libgomp.so.1); no -ffast-math, which would set flush-to-zero for
# the whole process: `omp simd reduction` already lets the compiler vectorize the dot products;
# -fno-strict-aliasing: the bfloat16 path writes a row's bits as integers and reads them as floats
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing", "-fPIC", "-shared")

PROFILE_NAME = "minicb::paged_decode_attention"
DTYPES = (torch.float32, torch.bfloat16)  # cache dtypes the kernel reads

_kernels = None  # cache dtype -> the loaded function, once built
_failure: str | None = None  # why it could not be built, once tried
_lock = threading.Lock()  # one build per process, even when engines start in several threads


def _umask() -> int:
    """The process's umask. os.umask reads it only by setting it, which for a moment would
    change it for every thread: Linux shows it in /proc instead."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _compiler() -> list[str] | None:
    """The C compiler's command line: $CC (which may be "ccache gcc"), else cc or gcc."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def library_path(compiler: list[str]) -> Path:
    """Where the built kernel lives: one file per source, flags, compiler and CPU."""
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except FileNotFoundError as exc:
        raise RuntimeError(f"the C compiler {shlex.join(compiler)!r} was not found") from exc
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(CFLAGS), shlex.join(compiler),
                                    version, cpuinfo("flags", "Features")
                                    or platform.processor() or platform.machine()]
                                   ).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"paged_decode-{key}.so"


def _build(compiler: list[str], target: Path) -> ctypes.CDLL:
    """Compile into a temporary file, load it, then move it to `target` (atomic: a concurrent
    build never sees half a file, and the library loaded is the one just built even if another
    process replaces or removes `target` meanwhile)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*compiler, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{shlex.join(compiler)} could not build {SOURCE.name}:\n"
                               f"{done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755 & ~_umask())  # mkstemp made it private: a shared cache reads it
        library = ctypes.CDLL(tmp)
        os.replace(tmp, target)
        _prune(target.parent)
        return library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


KEEP_BUILDS = 4  # builds kept in the cache: other checkouts or compilers may share it


def _prune(folder: Path, keep: int = KEEP_BUILDS) -> None:
    """Remove all but the `keep` newest kernel builds: each change to the source, the flags or
    the compiler makes a new one (about 30 KB), and nothing else ever removes the old. A
    process that loaded a removed file keeps its mapping; the next load rebuilds."""
    builds = sorted(folder.glob("paged_decode-*.so"), key=lambda p: p.stat().st_mtime,
                    reverse=True)
    for old in builds[keep:]:
        old.unlink(missing_ok=True)


def _load(compiler: list[str]) -> ctypes.CDLL:
    path = library_path(compiler)
    try:
        return ctypes.CDLL(str(path))  # built before, by this or another process
    except OSError:  # not built yet, or a damaged file in the cache: build it (again)
        return _build(compiler, path)


def _declare(fn):
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, *[i64] * 6, ctypes.c_float, i64]
    fn.restype = ctypes.c_int
    return fn


def kernel(cache_dtype: torch.dtype = torch.float32):
    """The compiled kernel for float32 or bfloat16 caches, built on first use; RuntimeError
    saying why not."""
    global _kernels, _failure
    if _kernels is not None:  # every layer of every step: no lock once built
        return _kernels[cache_dtype]
    with _lock:
        if _kernels is None and _failure is None:
            try:
                compiler = _compiler()
                if compiler is None:
                    raise RuntimeError("no C compiler found (set CC, or install gcc)")
                library = _load(compiler)
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _failure = str(exc)
            else:
                _kernels = {torch.float32: _declare(library.paged_decode_attention),
                            torch.bfloat16: _declare(library.paged_decode_attention_bf16)}
    if _kernels is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {_failure}")
    return _kernels[cache_dtype]


def unavailable_reason() -> str | None:
    """None if the kernel builds and loads here, else why not (tried once per process)."""
    try:
        kernel()
    except RuntimeError as exc:
        return str(exc)
    return None


def _runs_here(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and k_cache.dtype == v_cache.dtype and k_cache.dtype in DTYPES
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def _check_metadata(meta: AttentionMetadata, k_cache: torch.Tensor) -> None:
    """What the C code trusts, checked once per step (the reference would raise an IndexError
    where C would read out of bounds)."""
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
    fn = kernel(k_cache.dtype)
    # named in torch.profiler tables (a ctypes call is otherwise invisible to it; chapter 08)
    with torch.profiler.record_function(PROFILE_NAME):
        failed = fn(qd.data_ptr(), qd.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                    od.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
                    nd, num_heads, num_kv_heads, head_dim, meta.page_size,
                    max(meta.context_lens_list[:nd]), scale,
                    torch.get_num_threads())  # this thread's setting: a server's engine thread
    if failed:                                # has its own OpenMP state
        raise MemoryError("the CPU attention kernel could not allocate its score buffers")
    if od.data_ptr() != out.data_ptr():
        out[:nd] = od


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, D] over the paged caches -> [T, heads, D]: decode rows through the kernel,
    prefill chunks through the torch reference."""
    if not _runs_here(q, k_cache, v_cache):
        _warn_once(f"the cpu attention kernel reads contiguous float32 or bfloat16 caches on the "
                   f"CPU; these ({k_cache.dtype}, {k_cache.device}) take the torch reference")
        return torch_ref.attend(q, k_cache, v_cache, meta, scale)
    out = torch.empty(q.shape, dtype=q.dtype)
    attend_decodes(q, k_cache, v_cache, meta, scale, out)
    torch_ref.attend_prefills(q, k_cache, v_cache, meta, scale, out)
    return out
