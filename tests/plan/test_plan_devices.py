"""The planner's device table (tandem/rl/plan/devices.py): built-in rows, rows a devices file adds
or replaces, one-line errors for a bad file or an unknown name, and the decode floor the plan
prints from a device's bandwidth."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.rl.core import errors
from tandem.rl.core.configlib import ConfigError
from tandem.rl.plan.cli import decode_floor
from tandem.rl.plan.devices import DeviceSpec, device_spec

ROOT = Path(__file__).resolve().parents[2]


def test_built_in_rows_and_a_file_that_adds_and_replaces(tmp_path):
    assert device_spec("h200") == DeviceSpec(141.0, 4800.0)
    f = tmp_path / "devices.toml"
    f.write_text(
        "[h200]\nmemory_gb = 96\nbandwidth_gbs = 4000\n[npu-x]\nmemory_gb = 64\n"
        "bandwidth_gbs = 1600.5\n"
    )
    assert device_spec("h200", str(f)) == DeviceSpec(96.0, 4000.0)
    assert device_spec("npu-x", str(f)) == DeviceSpec(64.0, 1600.5)
    assert device_spec("h100", str(f)) == DeviceSpec(80.0, 3350.0)  # the rest stay


@pytest.mark.parametrize(
    "text, message",
    [
        ("[x]\nmemory_gb = 64\n", r"\[x\]: expected exactly memory_gb and bandwidth_gbs"),
        ("[x]\nmemory_gb = -1\nbandwidth_gbs = 2\n", r"\[x\]: memory_gb must be a positive"),
        ("[x]\nmemory_gb = 1\nbandwidth_gbs = true\n", r"\[x\]: bandwidth_gbs must be a positive"),
        ("[x\n", r"devices.toml: "),
    ],
)
def test_a_bad_devices_file_is_one_line_naming_file_and_key(tmp_path, text, message):
    f = tmp_path / "devices.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=r"^plan.devices_file: .*" + message) as e:
        device_spec("x", str(f))
    assert "\n" not in str(e.value)


def test_an_unknown_device_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"^plan.device: unknown device 'h300' \(known: a100"):
        device_spec("h300")


def test_decode_floor_reads_the_largest_generation_shard_at_the_bandwidth():
    plans = [SimpleNamespace(rollout={"generation shard": 8e9}), SimpleNamespace(rollout={})]
    line = decode_floor("d", DeviceSpec(80.0, 2000.0), plans)
    # 8 GB / 2000 GB/s = 4 ms
    assert line == (
        "decode floor on d (80 GB, 2000 GB/s): 8.00 GB of generation shard read per "
        "step, at least 4.00 ms a step"
    )


def test_plan_takes_memory_from_the_named_device_and_refuses_an_unknown_one():
    def plan(*extra):
        cmd = [sys.executable, "train.py", "--config", "configs/grpo.toml", "--plan", *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    r = plan("--plan.device=h200", "--plan.devices_per_node=8")
    assert r.returncode == errors.EXIT_OK, r.stderr
    assert "8 devices, 141.0 GB each" in r.stdout
    assert "decode floor on h200 (141 GB, 4800 GB/s)" in r.stdout
    r = plan("--plan.device=h300")
    assert r.returncode == errors.EXIT_CONFIG
    assert r.stderr.startswith("error: plan.device: unknown device 'h300'"), r.stderr
