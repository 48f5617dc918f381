"""The device seam (tandem/device.py): what the CPU and a type with no row answer, and the
fallbacks features take on a device without a capability (one log line, or one ConfigError).

A type with no row is exercised with ``meta`` tensors: a real device type that is neither the
CPU nor CUDA, so the code paths a port's device takes run here.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tandem import device as seam
from tandem.models.flavors import get_flavor
from tandem.rl.core.configlib import ConfigError


def test_the_cpu_row_and_a_type_without_one():
    cpu = seam.capabilities("cpu")
    assert seam.backend_for(torch.device("cpu")) == cpu.backend == "gloo"
    assert cpu.exact and not cpu.graphs and not cpu.triton and not cpu.mixed_precision
    assert seam.capabilities(torch.device("cuda", 3)).collective == "nccl"
    assert seam.capabilities("npu").backend == "cpu:gloo,npu:hccl"
    # a PrivateUse1 type with no row (the name need not be registered with torch)
    assert seam.capabilities("openreg") is seam.GENERIC
    assert seam.capabilities("openreg:1") is seam.GENERIC


def test_register_adds_a_row(monkeypatch):
    monkeypatch.setattr(seam, "DEVICES", dict(seam.DEVICES))
    row = seam.Capabilities("cpu:gloo,openreg:occl", collective="occl")
    seam.register("openreg", row)
    assert seam.capabilities("openreg") is row and seam.backend_for("openreg") == row.backend


def test_cpu_answers_without_an_accelerator():
    cpu = torch.device("cpu")
    assert seam.max_memory_allocated(cpu) is None and seam.memory_allocated(cpu) is None
    assert seam.total_memory(cpu) is None
    seam.reset_peak_memory_stats(cpu)  # nothing to reset: no error
    seam.synchronize(cpu)
    assert seam.supports_dtype(cpu, torch.float8_e4m3fn)
    host = torch.arange(4.0)
    assert seam.pin(host, cpu) is host  # no page-locking for a CPU-resident pool
    assert seam.compute_capability(cpu) is None
    if seam.accelerator_type() == "cpu":
        assert seam.current_device() == cpu and seam.device_count() == 0
        assert seam.rng_state() is None and seam.dispatch_keys() == ("CPU",)
        assert seam.pick_device(0) == cpu


def test_peak_memory_metric_falls_back_to_the_process_rss():
    import resource

    from tandem.rl.core.system import allocated_gb, peak_memory_gb

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    assert peak_memory_gb(torch.device("cpu")) == pytest.approx(rss, rel=0.05)
    assert allocated_gb(torch.device("cpu")) is None


def test_fallback_logs_one_line_per_type_and_feature_and_none_for_the_cpu(caplog):
    seam._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="tandem.device"):
        for _ in range(3):
            seam.fallback(torch.device("meta"), "feature-x", "thing y")
        seam.fallback("cpu", "feature-x", "thing y")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["feature-x: device meta has no thing y; using the fallback"]


def test_kernels_on_a_device_without_triton_take_the_pytorch_reference(caplog, kernels):
    from tandem.kernels.dispatch import use_triton

    kernels(None)
    seam._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="tandem.device"):
        assert not use_triton(torch.empty(2, device="meta"))
        assert not use_triton(torch.empty(2, device="meta"))
    assert [r.getMessage() for r in caplog.records] == [
        "kernels: device meta has no Triton backend (the PyTorch references run); "
        "using the fallback"
    ]


def test_a_collective_of_a_gloo_group_uses_the_cpu():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert seam.collective_device() == torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_an_fp8_pool_on_a_device_without_fp8_is_one_config_error(monkeypatch):
    from tandem.rl.generator.kv_cache import KVCache, make_quant

    quant = make_quant("fp8_e4m3", "per_token", None)
    args = get_flavor("debug-qwen3")
    assert KVCache(args, 2, 4, torch.float32, torch.device("cpu"), quant).data.dtype == quant.dtype
    monkeypatch.setattr(seam, "supports_dtype", lambda device, dtype: dtype != quant.dtype)
    with pytest.raises(ConfigError, match=r"^rollout.kv_dtype: device cpu cannot hold"):
        KVCache(args, 2, 4, torch.float32, torch.device("cpu"), quant)


def test_graph_capture_is_refused_where_the_row_has_none():
    with pytest.raises(RuntimeError, match="device cpu: no graph capture"):
        seam.capture("cpu", lambda: None)


def test_the_test_accelerator_is_reached_through_the_seam():
    """PyTorch's PrivateUse1 test accelerator (``torch_openreg``, docs/devices.md), only where it
    is installed: torch autoloads it, the seam reports and picks it, gives it the generic row,
    and a tensor computed there comes back equal to the CPU's."""
    pytest.importorskip("torch_openreg", reason="PyTorch's test accelerator is not installed")
    assert seam.accelerator_type() == "openreg"
    dev = seam.pick_device(0)
    assert dev == torch.device("openreg", 0) and seam.capabilities(dev) is seam.GENERIC
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal((x.to(dev) * 2).cpu(), x * 2)


def test_rl_exact_is_refused_on_a_device_whose_row_does_not_declare_it(monkeypatch):
    """The exact path declares what it needs (``exact``): the CPU row has it; a device type
    without it gets the table's one-line ConfigError (tandem/rl/config/composes.py), and the
    same type with it does not."""
    from pathlib import Path

    from tandem.rl.config.composes import Facts, check_composes
    from tandem.rl.config.schema import load_config

    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml"
    cfg = load_config(str(quickstart), ["rl.exact=true"])
    check_composes(Facts(cfg, device="cpu"))
    with pytest.raises(ConfigError, match=r"^rl.exact: rl.exact does not run with a device") as e:
        check_composes(Facts(cfg, device="meta"))
    assert "\n" not in str(e.value)
    monkeypatch.setattr(
        seam, "DEVICES", {**seam.DEVICES, "meta": seam.Capabilities("gloo", exact=True)}
    )
    check_composes(Facts(cfg, device="meta"))
