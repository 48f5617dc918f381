"""The RL recipe's start-up checks (one ConfigError line for what a layout cannot run yet) and
its episode endpoint (``env.kind = "http"``), kept out of tandem/rl/recipes/rl.py."""

from __future__ import annotations

from typing import Any

from tandem import device as seam
from tandem.parallel.distributed import DistInfo
from tandem.rl.config.schema import ConfigError
from tandem.rl.rollout.modes import ROLLOUT_MODES
from tandem.rl.update.cp_batch import check_cp_settings


def prompt_room(cfg: Any) -> int:
    """The longest prompt in tokens: ``data.max_length`` less ``rollout.max_tokens`` (a
    ConfigError line when nothing is left)."""
    room = cfg.data.max_length - cfg.rollout.max_tokens
    if room < 1:
        raise ConfigError(
            f"data.max_length: {cfg.data.max_length} leaves no room for prompts "
            f"after rollout.max_tokens {cfg.rollout.max_tokens}"
        )
    return room


def check_rl_settings(cfg: Any, info: DistInfo, needs_values: bool) -> None:
    """One ConfigError line for settings the layout cannot run yet (before any model is built);
    ``needs_values``: the advantage needs a critic."""
    r, device = cfg.rl, info.device
    check_cp_settings(cfg)
    if cfg.env.kind == "http":
        from tandem.rl.serve import episodes as http_episodes

        http_episodes.one_generation_group(cfg.rollout, info.world_size)
    tp_pp = cfg.parallel.tp * cfg.parallel.pp
    if tp_pp > 1 and (needs_values or cfg.distill.teachers):
        what = f"rl.advantage = {r.advantage!r} (a critic)" if needs_values else "distill.teachers"
        raise ConfigError(
            f"parallel.tp / parallel.pp: {what} runs with FSDP2 (+HSDP) only so far; "
            "set tp = pp = 1"
        )
    if r.exact and (not seam.capabilities(device).exact or tp_pp > 1):
        raise ConfigError(
            "rl.exact: batch-invariant kernels are validated for the CPU with "
            "parallel.tp = pp = 1 only so far (the CUDA path, "
            "tandem/kernels/triton_batch_invariant.py, passes its tests under the "
            "Triton interpreter but has not run on a GPU: scripts/gpu_check.sh part "
            f"'exact') (device {device.type}, tp x pp = {tp_pp}); set "
            "rl.exact = false"
        )
    if ROLLOUT_MODES.cap(cfg.rollout.mode, "streams"):
        what = [
            k
            for k, bad in (
                ("env.name", cfg.env.name),
                ("rl.dynamic_sampling", r.dynamic_sampling),
                ("parallel.tp / parallel.pp", tp_pp > 1),
            )
            if bad
        ]
        if what:
            raise ConfigError(
                f"rollout.mode: {cfg.rollout.mode!r} runs single-turn rollouts "
                "without dynamic sampling on parallel.tp = pp = 1 so far; unset " + ", ".join(what)
            )
    if r.exact and cfg.rollout.tp > 1:
        raise ConfigError(
            "rl.exact: bitwise equality needs the generation layout to compute like "
            "the update's (rollout.tp = the training tp = 1), got rollout.tp = "
            f"{cfg.rollout.tp}"
        )


def episode_server(cfg: Any, info: DistInfo, tok: Any) -> Any:
    """``env.kind = "http"``: the endpoint harnesses play episodes through, for the whole run,
    on rank 0 (tandem/rl/serve); None elsewhere and otherwise."""
    if cfg.env.kind != "http" or info.rank != 0:
        return None
    from tandem.rl.serve import episodes as http_episodes

    return http_episodes.start_server(cfg.env, cfg.job.name, tok.vocab_size)
