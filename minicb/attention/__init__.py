"""Attention over the paged KV cache (chapter 01; GPU kernels in chapter 07, CPU ones in 08). A
backend is a module with `torch_ref`'s `store_kv`, `attend`, `rms_norm` and `rope`, over caches
[num_pages, page_size, num_kv_heads, head_dim] and one step's `AttentionMetadata`."""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

from minicb.attention.metadata import AttentionMetadata, build_metadata, int_tensor

__all__ = ["AttentionMetadata", "build_metadata", "get_backend", "int_tensor", "resolve_backend"]


def resolve_backend(name: str = "auto", device: str = "cpu") -> str:
    """'auto': Triton on CUDA, else the C kernels where they build; MINICB_ATTENTION overrides."""
    source = "attention_backend"
    if name == "auto" and os.environ.get("MINICB_ATTENTION"):
        name, source = os.environ["MINICB_ATTENTION"], "MINICB_ATTENTION (environment)"
    on_cuda, auto = str(device).startswith("cuda"), name == "auto"
    name = ("triton" if on_cuda else "cpu") if auto else name
    if name not in BACKENDS:
        raise ValueError(f"{source} must be 'auto', 'torch', 'triton' or 'cpu', got {name!r}")
    if name == "triton" and not on_cuda and not get_backend("triton")._interpreted():
        # refuse now, not as an error in every request
        raise ValueError("attention_backend='triton' on the CPU needs Triton's interpreter: set "
                         "TRITON_INTERPRET=1 before anything imports triton, or use 'torch'")
    if name == "cpu":
        if on_cuda:
            raise ValueError("attention_backend='cpu' is the C kernel for the CPU: on CUDA use "
                             "'triton' or 'torch'")
        reason = get_backend("cpu").unavailable_reason()
        if reason and auto:
            _warn_once(f"{reason}; using the torch reference for attention")
            return "torch"
        if reason:
            raise ValueError(f"attention_backend='cpu': {reason}; use 'torch'")
    return name


@functools.cache  # once per message and process
def _warn_once(message: str) -> None:
    logging.getLogger("minicb").warning(message)


BACKENDS = {"torch": "torch_ref", "triton": "triton_ops", "cpu": "cpu_kernel"}  # name -> module


def get_backend(name: str) -> ModuleType:
    """The module implementing the backend API for a resolved backend name."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}")
    return importlib.import_module(f"minicb.attention.{BACKENDS[name]}")
