"""EngineConfig (chapter 01): its defaults, its limits, and every bad value refused with the
field named; the device, cache and CPU helpers of config.py."""

from __future__ import annotations

import io

import pytest

import minicb.config
from minicb import EngineConfig
from minicb.config import cache_root, cpuinfo, resolve_device


def test_engine_config_defaults():
    """EngineConfig's defaults are the ones the README quotes."""
    c = EngineConfig()
    assert (c.policy, c.page_size, c.max_num_seqs, c.max_num_batched_tokens, c.chunk_size,
            c.trace_snapshots, c.gpu_memory_utilization, c.prompt_lookup_max,
            c.prompt_lookup_min) == ("pd", 16, 16, 256, 256, True, 0.9, 4, 2)


@pytest.mark.parametrize("options", [
    dict(max_preemptions=0), dict(gpu_memory_utilization=1.0),
    dict(prompt_lookup_min=3, prompt_lookup_max=3), dict(batch_timeout=0)])
def test_engine_config_accepts_its_limits(options):
    """EngineConfig accepts the edges of its ranges."""
    EngineConfig(**options)


@pytest.mark.parametrize("options, message", [
    (dict(min_chunk=0), r"min_chunk must be a positive integer"),
    (dict(priority_aging_steps=4, preemption="deadline"), r"needs preemption='priority'"),
    (dict(batch_timeout_in_seconds=1), r"batch_timeout_in_seconds must be True or False"),
    (dict(num_speculative_tokens=True), r"num_speculative_tokens must be an integer"),
    (dict(prompt_lookup_min=0), r"^prompt_lookup_min must be a positive integer"),
    (dict(quantization="int8", device="cuda:0"), r"quantization='int8' is a CPU option"),
    (dict(device="meta"), r"minicb runs on those"),
    (dict(device=None), r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got None"),
])
def test_engine_config_refuses_with_the_field_named(options, message):
    """A bad EngineConfig value is refused with its field named."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_from_kwargs_names_the_unknown_and_the_known_options():
    """An unknown option is refused naming it and listing the known ones."""
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['seed'\]; known: "
                                         r"\[.*'max_num_seqs'.*\]"):
        EngineConfig.from_kwargs(seed=1)


def test_resolve_device_checks_a_named_device():
    """resolve_device checks a named device."""
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="minicb runs on those"):
        resolve_device("meta")


def test_an_empty_minicb_cache_is_the_default(monkeypatch, tmp_path):
    """MINICB_CACHE set but empty means the default cache, not the current directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MINICB_CACHE", "")
    assert cache_root() == tmp_path / ".cache" / "minicb"
    monkeypatch.setenv("MINICB_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"


def test_cpuinfo_takes_any_name_and_the_whole_value(monkeypatch):
    """cpuinfo looks for any of the names it is given and returns the whole value."""
    lines = "processor\t: 0\nFeatures\t: fp asimd\nmodel name\t: Chip: rev 2\n"
    monkeypatch.setattr(minicb.config, "open", lambda _: io.StringIO(lines), raising=False)
    assert cpuinfo("flags", "Features") == "fp asimd"
    assert cpuinfo("model name") == "Chip: rev 2"
