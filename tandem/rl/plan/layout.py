"""What the memory planner plans over: a `Layout` (the update's mesh degrees, the expert and
the generation degrees) and the `Settings` it reads from a config (tandem/rl/plan/planner.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.kernels.weight_quant import FORMATS as WEIGHT_FORMATS
from tandem.models.lora import LoraSpec
from tandem.parallel.mesh import Degrees


@dataclass(frozen=True)
class Layout(Degrees):
    """The update's mesh degrees (tandem/parallel/mesh.py), the expert-parallel degree (1,
    or dp_shard for an MoE model) and the generation layout's degree."""

    rollout_tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.world_size

    def describe(self) -> str:
        dp = (
            f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard}"
            if self.dp_replicate > 1
            else f"dp_shard={self.dp_shard}"
        )
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        rollout = f"rollout.tp={self.rollout_tp}"
        return f"{self.world} ranks: pp={self.pp} {dp}{cp} tp={self.tp}{ep}, {rollout}"

    def overrides(self, moe: bool = False) -> str:
        """The command-line overrides of this layout (``--parallel.ep`` too for an MoE model,
        ``--parallel.cp`` where it is split)."""
        ep = f" --parallel.ep={self.ep}" if moe or self.ep > 1 else ""
        cp = f" --parallel.cp={self.cp}" if self.cp > 1 else ""
        return (
            f"--parallel.pp={self.pp} --parallel.dp_replicate={self.dp_replicate} "
            f"--parallel.dp_shard={self.dp_shard} --parallel.tp={self.tp}{ep}{cp} "
            f"--rollout.tp={self.rollout_tp}"
        )


@dataclass(frozen=True)
class Settings:
    """The plain numbers the planner reads from a config (tandem/rl/config/schema.py)."""

    recipe: str = "rl"
    compute_dtype: torch.dtype = torch.bfloat16  # FSDP2 mixed precision (a GPU target)
    reduce_dtype: torch.dtype = torch.float32
    gen_dtype: torch.dtype = torch.bfloat16
    tokens: int = 4096  # per micro-batch and rank
    ac: str = "none"
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 0  # advanced.pp_microbatches
    seq_len: int = 2048  # pipeline rows
    offload_optimizer: bool = False
    cpu_offload: bool = False
    reference: bool = False  # a frozen second copy (rl.kl_coef > 0, dpo's online reference)
    critic: bool = False
    kv_cache_gb: float = 1.0
    kv_quant: Any = None  # rollout.kv_dtype's FP8 format (a KVQuant); None: gen_dtype
    block_size: int = 16
    max_num_seqs: int = 256
    max_len: int = 2048  # the generator's max_model_len
    prompts_per_step: int = 16
    num_samples: int = 8
    vocab_parallel: bool = True
    bucket_bytes: int = 256 << 20
    chunk_tokens: int = 1024
    cp_style: str = "ulysses"  # parallel.cp_style (rl recipe; tandem/rl/plan/long_context.py)
    lora: LoraSpec | None = None  # adapters on a frozen base (tandem/models/lora.py)
    weight_format: Any = None  # rollout.weight_dtype's format (tandem/kernels/weight_quant.py)

    @classmethod
    def from_config(cls, cfg: Any) -> Settings:
        t, p, r, ro, a = cfg.training, cfg.parallel, cfg.rl, cfg.rollout, cfg.advanced
        rl = t.recipe == "rl"
        if rl:
            tokens = r.micro_batch_tokens
        else:
            # packed rows of data.max_length; dpo / reward_model score chosen and rejected together
            tokens = (
                t.micro_batch_size
                * cfg.data.max_length
                * (2 if t.recipe in ("dpo", "reward_model") else 1)
            )
        gen = t.mixed_precision_param if ro.dtype == "auto" else ro.dtype
        from tandem.rl.algorithms import ADVANTAGES

        lora = cfg.lora.spec() if cfg.lora.enabled else None

        return cls(
            recipe=t.recipe,
            compute_dtype=getattr(torch, t.mixed_precision_param),
            reduce_dtype=getattr(torch, t.mixed_precision_reduce),
            gen_dtype=getattr(torch, gen),
            tokens=tokens,
            ac=p.activation_checkpoint,
            pp_schedule=p.pp_schedule,
            pp_microbatches=a.pp_microbatches,
            seq_len=cfg.data.max_length,
            offload_optimizer=rl and r.offload_optimizer,
            cpu_offload=p.cpu_offload,
            reference=lora is None
            and (
                (rl and r.kl_coef > 0)
                or (t.recipe == "dpo" and cfg.preference.reference == "online")
            ),
            critic=rl and ADVANTAGES.cap(r.advantage, "needs_values", False),
            kv_cache_gb=ro.kv_cache_gb,
            kv_quant=ro.kv_quant_format(),
            block_size=ro.block_size,
            max_num_seqs=ro.max_num_seqs,
            max_len=cfg.data.max_length + 1,
            prompts_per_step=r.prompts_per_step,
            num_samples=r.num_samples,
            vocab_parallel=ro.vocab_parallel,
            bucket_bytes=a.reshard_bucket_mb << 20,
            chunk_tokens=a.logprob_chunk_tokens,
            cp_style=p.cp_style,
            lora=lora,
            weight_format=WEIGHT_FORMATS.get(ro.weight_dtype),
        )
