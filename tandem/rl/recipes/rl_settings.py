"""The RL recipe's start-up settings (the prompts' room, the generation tp the features fix)
and its episode endpoint (``env.kind = "http"``), kept out of tandem/rl/recipes/rl.py."""

from __future__ import annotations

from typing import Any

from tandem.parallel.distributed import DistInfo
from tandem.rl.config.composes import derived_rollout_tp
from tandem.rl.config.schema import ConfigError


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


def derived_tp(cfg: Any, info: DistInfo) -> int:
    """``rollout.tp`` with what the run's features fix resolved (`derived_rollout_tp`, said once
    on rank 0); 0 (auto) otherwise, for `generation_copy` to size."""
    derived = derived_rollout_tp(cfg, info.world_size)
    if derived is None:
        return cfg.rollout.tp
    tp, why = derived
    if info.is_main:
        print(f"rollout.tp = {tp}: {why}", flush=True)
    return tp


def episode_server(cfg: Any, info: DistInfo, tok: Any) -> Any:
    """``env.kind = "http"``: the endpoint harnesses play episodes through, for the whole run,
    on rank 0 (tandem/rl/generator/serve); None elsewhere and otherwise."""
    if cfg.env.kind != "http" or info.rank != 0:
        return None
    from tandem.rl.rollout import episodes as http_episodes

    return http_episodes.start_server(cfg.env, cfg.job.name, tok.vocab_size)
