"""torchrun worker for tests/rollout/test_agentic_group.py (2 CPU ranks, gloo).

``torchrun --standalone --nproc-per-node 2 tests/rollout/agentic_group_worker.py --out F
--log-dir D`` loads assets/agentic-policy on both ranks and plays multi-turn episodes of the
"tool_pid" environment (the "tool" environment with the sandboxed python tool,
logging the pid that ran each step; tests/env_helpers.py) through
tandem/rl/rollout/sampling.py `sample_episodes`, as the RL recipe does:

1. ``rollout.tp = 1``: each rank its own prompts, on a whole copy, with its own pool
   (the reference);
2. ``rollout.tp = 2``: the same prompts and seeds, one generator over the group's
   weight shards; only rank 0 (the leader) has an env pool;
3. greedy, tp = 1 then tp = 2, rank 1 with no prompts (as an evaluation can be).

Rank 0 writes every rank's episodes, metrics and pid to ``F`` (torch.save); the
environment steps of each phase are logged to ``D/<phase>.log``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

# the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import tests.env_helpers  # noqa: E402,F401  (registers "tool_pid")
from tandem.models.hf import load_model  # noqa: E402
from tandem.models.tokenizer import Tokenizer  # noqa: E402
from tandem.parallel.distributed import init_distributed  # noqa: E402
from tandem.parallel.generation_layout import (  # noqa: E402
    GenerationCopy,  # noqa: E402
    GenerationLayout,
    make_layout,
)
from tandem.rl.config.rl_schema import EnvConfig, RolloutConfig  # noqa: E402
from tandem.rl.data.prompts import Prompt, load_prompt_rows  # noqa: E402
from tandem.rl.rollout.sampling import sample_episodes  # noqa: E402
from tandem.rl.workers.env_pool import EnvPool  # noqa: E402

POLICY = "assets/agentic-policy"
TASK = "synthetic:calc_arithmetic?digits=3&num_ops=1&ops=*&tool=python"
ROWS = 12  # rank 0 takes the first 8, rank 1 the last 4 (uneven on purpose)
N = 2  # episodes per prompt


def _episode(s) -> dict:
    return {
        "prompt": s.prompt_ids,
        "completion": s.completion_ids,
        "mask": s.loss_mask,
        "logprobs": s.gen_logprobs,
        "turns": s.info["turns"],
        "tool_calls": s.info["tool_calls"],
        "reward": s.env_reward,
        "finish": s.finish_reason,
        "group": s.group,
        "row": s.row["id"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--log-dir", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    info = init_distributed(force_cpu=True)
    rank, dev = dist.get_rank(), torch.device("cpu")
    model = load_model(POLICY).eval()  # every rank holds the whole model: the copy's source
    tok = Tokenizer.from_dir(POLICY)
    rows = load_prompt_rows(TASK, "auto", split="train", seed=0, n_synthetic=ROWS)
    prompts = [Prompt(index=i, token_ids=[], row=r) for i, r in enumerate(rows)]
    mine = prompts[:8] if rank == 0 else prompts[8:]
    seeds = [1000 + 7 * p.index for p in mine]
    rcfg = RolloutConfig(temperature=1.0, max_tokens=96, block_size=16, cuda_graphs=False)
    out: dict = {"pid": os.getpid(), "world": info.world_size}

    def ecfg(phase: str) -> EnvConfig:
        kwargs = {
            "log": os.path.join(a.log_dir, f"{phase}.log"),
            "tools": ["python"],
            "reward": "math",
            "schemas_in_prompt": False,
        }
        return EnvConfig(name="tool_pid", kwargs=kwargs, max_turns=3, max_total_tokens=512)

    def play(
        phase: str, layout: GenerationLayout, pool: EnvPool | None, prompts, seeds, greedy=False
    ) -> None:
        gen_model, _ = GenerationCopy(model, model.args, layout, dev).build()
        t0 = time.perf_counter()
        samples, metrics = sample_episodes(
            gen_model,
            tok,
            prompts,
            N,
            rcfg,
            ecfg(phase),
            pool,
            seed=0,
            greedy=greedy,
            seeds=seeds,
            layout=layout,
        )
        out[phase] = {
            "episodes": [_episode(s) for s in samples],
            "metrics": metrics,
            "seconds": time.perf_counter() - t0,
        }

    with EnvPool(2) as pool:
        pool.wait_ready()
        play("tp1", GenerationLayout(), pool, mine, seeds)
        play(
            "greedy_tp1",
            GenerationLayout(),
            pool,
            mine if rank == 0 else [],
            seeds if rank == 0 else [],
            True,
        )
    group = make_layout(2)
    # as the recipe: only the leader steps environments
    leader_pool = EnvPool(2) if group.rank == 0 else None
    if leader_pool is not None:
        leader_pool.wait_ready()
    play("tp2", group, leader_pool, mine, seeds)
    play(
        "greedy_tp2",
        group,
        leader_pool,
        mine if rank == 0 else [],
        seeds if rank == 0 else [],
        True,
    )
    out["pool_steps"] = None if leader_pool is None else leader_pool.submitted
    if leader_pool is not None:
        leader_pool.close()
    parts: list = [None] * info.world_size
    dist.all_gather_object(parts, out)
    if rank == 0:
        torch.save(parts, a.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
