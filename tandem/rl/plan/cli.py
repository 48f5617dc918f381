"""``train.py --config X --plan``: the architecture and target cluster a config names, the
`Planner`'s table for its layout (tandem/rl/plan/planner.py), the smallest layout that fits,
and the exit status that says whether it does."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any

from tandem import device as seam
from tandem.models.args import ModelArgs
from tandem.models.lora import is_adapter
from tandem.parallel.generation_layout import check_divisible
from tandem.parallel.mesh import Degrees
from tandem.rl.core.configlib import ConfigError
from tandem.rl.plan import long_context as lc
from tandem.rl.plan.async_modes import async_plans
from tandem.rl.plan.devices import DeviceSpec, device_spec
from tandem.rl.plan.planner import (
    DEFAULT_DEVICE_GB,
    GB,
    USABLE,
    Layout,
    Planner,
    RankPlan,
    Settings,
    rank_kinds,
)


def plan_args(cfg: Any) -> tuple[ModelArgs, str]:
    """The architecture to plan for and where it came from: model.flavor, model.path's
    config.json when that folder is here, else plan.flavor (planning before a download)."""
    from tandem.models.flavors import get_flavor
    from tandem.models.hf import load_args

    m = cfg.model
    if m.flavor is not None:
        return get_flavor(m.flavor), f"model.flavor {m.flavor!r}"
    if os.path.isfile(os.path.join(m.path, "config.json")):
        try:
            return load_args(m.path), f"{m.path}/config.json"
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(
                f"model.path: {m.path}/config.json: {str(e).strip().splitlines()[0]}"
            ) from None
    if cfg.plan.flavor is None:
        raise ConfigError(
            f"plan.flavor: model.path {m.path} has no config.json on this "
            "machine; name its architecture with --plan.flavor (a flavor of "
            "tandem/models/flavors.py)"
        )
    return (
        get_flavor(cfg.plan.flavor),
        f"plan.flavor {cfg.plan.flavor!r} (model.path {m.path} is not here)",
    )


def target(cfg: Any) -> tuple[int, int, float]:
    """(nodes, devices per node, device bytes): [plan] where set; else the config's own layout
    (dp_shard = -1 filling this machine's GPUs, or nothing) and this machine's GPU or 80 GB."""
    p, par = cfg.plan, cfg.parallel
    fixed = par.pp * par.dp_replicate * par.tp * par.cp
    local_gpus = seam.device_count()
    nodes = p.nodes or 1
    if p.devices_per_node:
        per_node = p.devices_per_node
    elif par.dp_shard != -1:
        per_node = -(-fixed * par.dp_shard // nodes)
    else:
        per_node = max(local_gpus, fixed)
    if p.device_memory_gb:
        mem = p.device_memory_gb * GB
    elif p.device:
        mem = device_spec(p.device, p.devices_file).memory_gb * GB
    elif local_gpus:
        mem = float(seam.total_memory(seam.current_device()) or DEFAULT_DEVICE_GB * GB)
    else:
        mem = DEFAULT_DEVICE_GB * GB
    return nodes, per_node, mem


def config_layout(cfg: Any, planner: Planner, world: int, per_node: int, mem: float) -> Layout:
    from tandem.rl.core.modeling import check_moe_layout
    from tandem.rl.update.policy import check_layout

    d = cfg.parallel.resolve(world)
    par = cfg.parallel
    check_layout(planner.args, Degrees(**d), par.pp_schedule, par.cp_style)
    check_moe_layout(planner.args, cfg.parallel.ep, d)
    lay = Layout(ep=par.ep, **d)
    g = cfg.rollout.tp or (
        planner.auto_rollout_tp(lay, mem, per_node) if planner.s.recipe == "rl" else 1
    )
    if world % g:
        raise ConfigError(f"rollout.tp: {g} does not divide the {world} ranks")
    reason = check_divisible(planner.args, g)
    if reason:
        raise ConfigError(f"rollout.tp: {reason}")
    return dataclasses.replace(lay, rollout_tp=g)


def format_plan(plans: list[RankPlan], mem: float) -> str:
    """The per-rank table: one column per kind of rank, GB."""
    width = 34
    head = "".join(f"{p.kind:>16}" for p in plans)
    lines = [f"{'GB per rank':<{width}}{head}"]
    for phase in ("update", "rollout"):
        keys = list(dict.fromkeys(k for p in plans for k in getattr(p, phase)))
        if not keys:
            continue
        lines.append(phase)
        for k in keys:
            lines.append(
                f"  {k:<{width - 2}}"
                + "".join(f"{getattr(p, phase).get(k, 0) / GB:>16.2f}" for p in plans)
            )
        lines.append(
            f"  {'total':<{width - 2}}"
            + "".join(f"{sum(getattr(p, phase).values()) / GB:>16.2f}" for p in plans)
        )
        if phase == "rollout":
            lines.append(
                f"  {'full-length sequences in the pool':<{width - 2}}"
                + "".join(f"{p.kv_sequences:>16d}" for p in plans)
            )
            if any(p.freed[0] for p in plans):  # rollout.weight_dtype: room for more KV
                lines.append(
                    f"  {'freed by weight_dtype (GB, seqs)':<{width - 2}}"
                    + "".join(f"{f'{p.freed[0] / GB:.2f}, {p.freed[1]}':>16}" for p in plans)
                )
    lines.append(f"{'peak':<{width}}" + "".join(f"{p.peak / GB:>16.2f}" for p in plans))
    lines.append(
        f"{'share of the device':<{width}}" + "".join(f"{p.peak / mem:>15.0%} " for p in plans)
    )
    return "\n".join(lines)


def decode_floor(name: str, spec: DeviceSpec, plans: list[RankPlan]) -> str:
    """The least time of one decode step on ``spec``: every rank reads its generation shard once
    per step, at the device's memory bandwidth (the KV reads come on top)."""
    shard = max(p.rollout.get("generation shard", 0) for p in plans)
    return (
        f"decode floor on {name} ({spec.memory_gb:g} GB, {spec.bandwidth_gbs:g} GB/s): "
        f"{shard / GB:.2f} GB of generation shard read per step, at least "
        f"{shard / (spec.bandwidth_gbs * GB) * 1e3:.2f} ms a step"
    )


def run_plan(cfg: Any) -> int:
    """``train.py --plan``: print the plan; the exit status says whether the config's
    layout fits."""
    from tandem.rl.core import errors

    args, source = plan_args(cfg)
    s = Settings.from_config(cfg)
    planner = Planner(args, s)
    nodes, per_node, mem = target(cfg)
    world = nodes * per_node - cfg.rollout.gen_ranks  # split mode: the trainers' layout
    lay = config_layout(cfg, planner, world, per_node, mem)
    plans = async_plans(cfg, planner, lay, planner.plan(lay))
    print(f"model: {args.model_type}, {args.num_params() / 1e9:.2f} B parameters ({source})")
    if s.lora is not None:
        n = sum(math.prod(shape) for name, shape in planner.shapes if is_adapter(name))
        print(
            f"LoRA: rank {s.lora.rank} on {', '.join(s.lora.targets)}: {n / 1e6:.1f} M trained "
            f"parameters ({n / args.num_params():.2%}); the reference is the base with the "
            "adapters off"
        )
    print(
        f"target: {nodes} node(s) x {per_node} devices, {mem / GB:.1f} GB each; a layout fits "
        f"when its peak is at most {USABLE:.0%} ({USABLE * mem / GB:.1f} GB)"
    )
    print(
        f"layout: {lay.describe()}"
        f"{' (auto)' if not cfg.rollout.tp and s.recipe == 'rl' else ''}; compute "
        f"{str(s.compute_dtype).removeprefix('torch.')}, generation "
        f"{str(s.gen_dtype).removeprefix('torch.')}, {planner.micro_batch(lay)[0]} tokens per "
        f"micro-batch, activation_checkpoint={s.ac}"
    )
    print(format_plan(plans, mem))
    if cfg.plan.device:
        print(
            decode_floor(
                cfg.plan.device, device_spec(cfg.plan.device, cfg.plan.devices_file), plans
            )
        )
    if s.recipe == "rl" and not cfg.rollout.gen_ranks:  # split mode: the generators' pool is set
        kinds = rank_kinds(planner.args, lay, s.pp_schedule)
        room = lc.kv_room(planner, lay, USABLE * mem, kinds)
        print(lc.format_kv_room(room, cfg.rollout.max_tokens, s.max_len - 1))
    worst = max(plans, key=lambda p: p.peak)
    fits = worst.peak <= USABLE * mem
    smallest, best = (
        (planner.smallest(nodes, per_node, mem), planner.best(world, per_node, mem))
        if not cfg.rollout.gen_ranks
        else (None, None)
    )  # colocated layouts only
    if smallest:
        print(
            f"smallest layout that fits: {smallest[0].describe()} (peak {smallest[1] / GB:.1f} GB)"
        )
    if best:
        print(
            f"least model parallelism that fits on {world} ranks: {best[0].describe()} (peak "
            f"{best[1] / GB:.1f} GB)\n  {best[0].overrides(moe=args.is_moe)}"
        )
    if fits:
        print(f"fits: peak {worst.peak / GB:.1f} GB ({worst.kind}, {worst.peak_phase()} phase)")
        return errors.EXIT_OK
    hint = (
        f"; smallest layout that fits: {smallest[0].describe()}"
        if smallest
        else "; no layout of this cluster fits"
    )
    print(
        f"error: plan: {worst.peak / GB:.1f} GB per rank ({worst.kind}, {worst.peak_phase()} "
        f"phase) is over {USABLE:.0%} of {mem / GB:.0f} GB{hint}",
        file=sys.stderr,
        flush=True,
    )
    return errors.EXIT_PLAN
