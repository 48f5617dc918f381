"""LoRA in every recipe: the ``[lora]`` section, the adapters' first values, checkpoints, exports.

The math and the module swap are tandem/models/lora.py; sharding is tandem/parallel/lora.py.
Here is what a recipe needs around them:

- `LoraConfig` (``[lora]``; ``rank = 0`` is off) and `LoraSetup`, which the one model builder
  (tandem/rl/core/modeling.py) applies to the trained model only: fresh adapters from the
  job seed, or an existing PEFT adapter (``lora.adapter_path``) to continue from;
- `checkpoint_module`: what DCP saves for a model, the trainable parameters alone when it has
  adapters (the frozen base is rebuilt from ``model.path`` / the seed at every start, so a
  checkpoint holds the adapters and their AdamW state, and is a few MB);
- `save_exports`: ``hf/`` with the adapters merged into the base (in the base's dtype) and
  ``hf-adapter/`` in PEFT's format next to it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tandem.models.args import ModelArgs
from tandem.models.hf import save_hf
from tandem.models.hf_adapter import load_adapter, read_adapter_config, save_adapter, spec_matches
from tandem.models.lora import (
    TARGETS,
    LoraSpec,
    has_lora,
    init_adapter_state,
    is_adapter,
    merge_state,
)
from tandem.parallel.ac import clean_fqn
from tandem.rl.core.configlib import ConfigError, require

ADAPTER_DIR = "hf-adapter"  # beside the hf/ export


@dataclass
class LoraConfig:
    """LoRA adapters on the trained model (every recipe): a frozen base, small trainable
    low-rank adapters."""

    rank: int = 0  # adapter rank r; 0 = off (every weight trains)
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input in training forwards (sft, dpo,
    # reward_model; the rl recipe needs 0)
    targets: list[str] = field(  # adapted in every block: q, k, v, o (attention), gate, up, down
        # (MLP and shared expert), experts (each routed expert)
        default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"]
    )
    adapter_path: str | None = None  # a PEFT LoRA folder (adapter_config.json +
    # adapter_model.safetensors) to continue training from; its r, lora_alpha and target_modules
    # must equal rank, alpha and targets

    def validate(self) -> None:
        require(self.rank >= 0, f"lora.rank: must be >= 0 (0 = off), got {self.rank}")
        require(self.alpha > 0, f"lora.alpha: must be > 0, got {self.alpha}")
        require(0.0 <= self.dropout < 1.0, f"lora.dropout: must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        require(not unknown, f"lora.targets: unknown {unknown} (choose from {', '.join(TARGETS)})")
        require(
            bool(self.targets) and len(set(self.targets)) == len(self.targets),
            f"lora.targets: must list each target once, got {self.targets}",
        )
        if self.adapter_path is None:
            return
        require(self.rank > 0, "lora.adapter_path: set lora.rank (> 0) to train the adapter")
        try:
            cfg = read_adapter_config(self.adapter_path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"lora.adapter_path: {str(e).strip().splitlines()[0]}") from None
        why = spec_matches(cfg, self.spec())
        require(why is None, f"lora.adapter_path: lora has {why} ({self.adapter_path})")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def spec(self, *, trainable: tuple[str, ...] = (), base_model: str | None = None) -> LoraSpec:
        return LoraSpec(
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
            targets=tuple(self.targets),
            trainable=trainable,
            base_model=base_model,
        )

    def setup(
        self,
        seed: int,
        *,
        base_model: str | None = None,
        trainable: tuple[str, ...] = (),
    ) -> LoraSetup | None:
        """What the model builder needs (None when LoRA is off); the rl recipe runs without
        dropout (a row of tandem/rl/config/composes.py)."""
        if not self.enabled:
            return None
        return LoraSetup(
            self.spec(trainable=trainable, base_model=base_model), seed, self.adapter_path
        )


@dataclass(frozen=True)
class LoraSetup:
    """The adapters a built model gets: `LoraSpec`, the seed of fresh ones, or a PEFT folder."""

    spec: LoraSpec
    seed: int = 0
    adapter_path: str | None = None

    def keeping(self, *modules: str) -> LoraSetup:
        """The same adapters, with ``modules`` (e.g. a new score head) trained in full
        beside them."""
        return dataclasses.replace(
            self, spec=dataclasses.replace(self.spec, trainable=self.spec.trainable + modules)
        )

    def initial(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The adapters' first values (CPU, fp32, full): read from ``adapter_path`` or fresh."""
        if self.adapter_path is not None:
            return load_adapter(self.adapter_path, shapes)
        return init_adapter_state(shapes, self.seed)


def checkpoint_module(model: nn.Module) -> nn.Module:
    """What a checkpoint holds of ``model``: the model itself, or with adapters a module holding
    the very trainable Parameter objects (adapters, and e.g. a new score head) under their clean
    names, so DCP saves and loads those and the optimizer state, which is theirs alone."""
    if not has_lora(model):
        return model
    root = nn.Module()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        *path, leaf = clean_fqn(name).split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, p)
    return root


def merged_state(state: dict[str, torch.Tensor], spec: LoraSpec | None) -> dict[str, torch.Tensor]:
    """A full state dict with any adapters merged into their base weights (`merge_state`)."""
    return state if spec is None else merge_state(state, spec.scale)


def save_exports(
    state: dict[str, torch.Tensor],
    args: ModelArgs,
    out_dir: str,
    tokenizer: Any,
    spec: LoraSpec | None,
) -> None:
    """Rank 0, a full CPU state dict: ``out_dir`` as an HF folder, the adapters merged in when there
    are any (and then ``hf-adapter/`` beside it, PEFT's format, unless routed experts were adapted:
    PEFT has no counterpart for Tandem's per-expert adapters)."""
    if spec is None or not any(is_adapter(k) for k in state):
        save_hf(state, args, out_dir, tokenizer=tokenizer)
        return
    save_hf(merge_state(state, spec.scale), args, out_dir, tokenizer=tokenizer)
    if "experts" not in spec.targets:
        adapters = {k: v for k, v in state.items() if is_adapter(k)}
        save_adapter(
            adapters,
            spec,
            os.path.join(os.path.dirname(os.path.abspath(out_dir)), ADAPTER_DIR),
            base_model=spec.base_model,
        )
