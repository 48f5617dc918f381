"""The devices ``train.py --plan`` knows by name (``plan.device``): memory and memory bandwidth,
from the vendors' data sheets; ``plan.devices_file`` (TOML, one table per device) adds rows or
replaces these. docs/devices.md."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.rl.core.configlib import ConfigError, tomllib


@dataclass(frozen=True)
class DeviceSpec:
    memory_gb: float  # device memory, GB (1e9 bytes)
    bandwidth_gbs: float  # memory bandwidth, GB/s


DEVICES: dict[str, DeviceSpec] = {
    "a100-80gb": DeviceSpec(80.0, 2039.0),  # NVIDIA A100 80GB SXM
    "h100": DeviceSpec(80.0, 3350.0),  # NVIDIA H100 SXM
    "h200": DeviceSpec(141.0, 4800.0),  # NVIDIA H200 SXM
    "mi300x": DeviceSpec(192.0, 5300.0),  # AMD Instinct MI300X
}


def read_devices(path: str) -> dict[str, DeviceSpec]:
    """The rows of a devices file: ``[NAME]`` tables with ``memory_gb`` and ``bandwidth_gbs``
    (positive numbers); anything else is a ConfigError naming the file and the key."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"plan.devices_file: {path}: {e}") from None
    rows = {}
    for name, row in raw.items():
        where = f"plan.devices_file: {path}: [{name}]"
        if not isinstance(row, dict) or set(row) != {"memory_gb", "bandwidth_gbs"}:
            raise ConfigError(f"{where}: expected exactly memory_gb and bandwidth_gbs")
        for key, value in row.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{where}: {key} must be a positive number, got {value!r}")
        rows[name] = DeviceSpec(float(row["memory_gb"]), float(row["bandwidth_gbs"]))
    return rows


def device_spec(name: str, devices_file: str | None = None) -> DeviceSpec:
    """The row ``name`` of the built-in table, or of ``devices_file`` (which wins)."""
    table = {**DEVICES, **(read_devices(devices_file) if devices_file else {})}
    if name not in table:
        raise ConfigError(
            f"plan.device: unknown device {name!r} (known: {', '.join(sorted(table))}; "
            "add it with plan.devices_file)"
        )
    return table[name]
