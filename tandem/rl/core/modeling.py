"""Build the policy (or any HF-format model) for training: tokenizer, weights, sharding.

Weights are materialised once, in full, on rank 0 (an HF folder or a seeded
from-scratch init) and broadcast into the sharded model, so the same config
gives the same starting weights on every layout.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from tandem.models.args import ModelArgs
from tandem.models.flavors import get_flavor
from tandem.models.hf import check_weight_shapes, hf_to_tandem, load_args, read_hf_state_dict
from tandem.models.lora import adapter_shapes, apply_lora, lora_spec_of
from tandem.models.tokenizer import Tokenizer, build_char_tokenizer
from tandem.models.vl_template import build_vl_char_tokenizer
from tandem.models.vlm import make_model
from tandem.rl.core.configlib import ConfigError
from tandem.rl.core.lora import LoraSetup, save_exports


class ModelSetupError(Exception):
    """The model/tokenizer settings do not fit together; str() is one line."""


def build_tokenizer(tokenizer: str | None, model_path: str | None, cache_dir: str) -> Tokenizer:
    """``builtin:char`` builds the self-contained character tokenizer into cache_dir."""
    src = tokenizer or model_path
    if src is None:
        raise ModelSetupError(
            "model.tokenizer: required when model.path is not set (a folder or 'builtin:char')"
        )
    if src in ("builtin:char", "builtin:vl-char"):
        # One folder per rank: ranks build it at the same time and must not read a half-written
        # file.
        rank_dir = os.path.join(cache_dir, f"rank-{os.environ.get('RANK', '0')}")
        os.makedirs(rank_dir, exist_ok=True)
        return (
            build_char_tokenizer(rank_dir)
            if src == "builtin:char"
            else build_vl_char_tokenizer(rank_dir)
        )
    key = "model.tokenizer" if tokenizer else "model.path"
    try:
        return Tokenizer.from_dir(src)
    except (OSError, ValueError, KeyError) as e:
        raise ModelSetupError(f"{key}: {src}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def model_args(flavor: str | None, path: str | None, tokenizer: Tokenizer) -> ModelArgs:
    try:
        args = load_args(path) if path else get_flavor(flavor)  # type: ignore[arg-type]
    except (OSError, ValueError, KeyError) as e:
        raise ModelSetupError(
            f"{'model.path' if path else 'model.flavor'}: {_one_line(e)}"
        ) from None
    if tokenizer.vocab_size > args.vocab_size:
        key = "model.path" if path else "model.flavor"
        raise ModelSetupError(
            f"{key}: vocab_size {args.vocab_size} is smaller than the "
            f"tokenizer's {tokenizer.vocab_size}"
        )
    return args


def full_initial_state(args: ModelArgs, path: str | None, seed: int) -> dict[str, torch.Tensor]:
    """The starting weights in full (CPU, fp32 for from-scratch)."""
    if path:
        try:
            check_weight_shapes(path, args)
            return hf_to_tandem(read_hf_state_dict(path), args)
        except (OSError, ValueError, KeyError) as e:
            raise ModelSetupError(f"model.path: {_one_line(e)}") from None
    torch_state = torch.get_rng_state()
    model = make_model(args)
    model.init_weights(seed)
    torch.set_rng_state(torch_state)
    return {k: v for k, v in model.state_dict().items()}


def load_full_state(
    model: nn.Module, full: dict[str, torch.Tensor] | None, mesh: Any = None
) -> None:
    """Load rank 0's full state dict into a (possibly sharded) model; a ``mesh`` over part of the
    world (one side of a split world, tandem/parallel/split.py) has every rank pass the full
    state and copy its own shards out of it (torch's loaders scatter from global rank 0, which
    is not among the mesh's ranks)."""
    if mesh is not None and dist.is_initialized() and mesh.size() < dist.get_world_size():
        _copy_own_shards(model, full or {})
        return
    broadcast = dist.is_initialized() and dist.get_world_size() > 1
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=True)
    set_model_state_dict(model, full or {}, options=opts)


@torch.no_grad()
def _copy_own_shards(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Each parameter's local shard (a DTensor's region) copied from the full tensor; no
    collective."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    state = get_model_state_dict(model)
    missing = sorted(state.keys() - full.keys())
    if missing:
        raise ModelSetupError(f"model.path: the weights lack {missing[0]} ({len(missing)} missing)")
    for name, t in state.items():
        src = full[name]
        if isinstance(t, DTensor):
            shape, offset = compute_local_shape_and_global_offset(
                t.shape, t.device_mesh, t.placements
            )
            region = tuple(slice(o, o + n) for o, n in zip(offset, shape))
            t.to_local().copy_(src[region])
        else:
            t.copy_(src)


def gather_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank calls; rank 0 gets the full CPU state dict."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def export_hf(
    model: nn.Module, args: ModelArgs, tokenizer: Tokenizer | None, out_dir: str, rank: int
) -> None:
    """Collective: write the model as an HF folder (rank 0 writes); with LoRA adapters, merged,
    and the adapters alone in PEFT's format beside it (tandem/rl/core/lora.py)."""
    state = gather_full_state(model)
    if rank == 0:
        save_exports(state, args, out_dir, tokenizer, lora_spec_of(model))


@dataclass(frozen=True)
class BuildSpec:
    """How a model is laid out for training, from the [training] and [parallel] sections."""

    param_dtype: str = "float32"  # FSDP2 compute dtype on a GPU (CPU always computes in float32)
    reduce_dtype: str = "float32"
    cpu_offload: bool = False
    activation_checkpoint: str = "none"
    compile: bool = False
    ep: int = 1  # expert parallelism over the FSDP2 shard ranks (MoE models)
    train_vision: bool = False  # vision-language models: the tower trains too (model.train_vision)
    lora: LoraSetup | None = None  # adapters on a trained model (set by a recipe for the model it
    # trains)

    @classmethod
    def from_config(
        cls, training: Any, parallel: Any, model: Any = None, lora: LoraSetup | None = None
    ) -> BuildSpec:
        return cls(
            param_dtype=training.mixed_precision_param,
            reduce_dtype=training.mixed_precision_reduce,
            cpu_offload=parallel.cpu_offload,
            activation_checkpoint=parallel.activation_checkpoint,
            compile=parallel.compile,
            ep=parallel.ep,
            lora=lora,
            train_vision=bool(getattr(model, "train_vision", False)),
        )


def check_moe_layout(args: Any, ep: int, sizes: dict[str, int]) -> None:
    """One line (ConfigError) unless the degrees ``sizes`` (dp_shard, tp, pp, dp_replicate) and
    ``parallel.ep`` suit the model, as tandem/parallel/expert_parallel.py's `validate_ep` says."""
    from tandem.parallel.expert_parallel import validate_ep

    try:
        validate_ep(args, ep, **{a: sizes[a] for a in ("dp_shard", "tp", "pp", "dp_replicate")})
    except ValueError as e:
        raise ConfigError(f"parallel.ep: {e}") from None


def parallelize_model(
    model: nn.Module,
    mesh: Any,
    device: torch.device,
    spec: BuildSpec,
    *,
    trainable: bool = True,
    tp: bool = True,
) -> nn.Module:
    """Every model Tandem trains or scores goes through here, on the meta device: TP (when
    ``tp`` and the mesh has a TP axis > 1), activation checkpointing (trainable models),
    compile, and FSDP2 by the one rule of `tandem.parallel.parallelize`. CPU computes in float32."""
    from tandem.parallel.parallelize import parallelize

    dense = not getattr(getattr(model, "args", None), "num_experts", 0)
    if not trainable and spec.ep > 1 and dense:
        # a dense teacher beside an MoE policy: no experts to split, FSDP2 shards it as usual
        spec = dataclasses.replace(spec, ep=1)
    check_moe_layout(
        getattr(model, "args", None),
        spec.ep,
        {a: mesh[a].size() for a in ("dp_shard", "tp", "pp", "dp_replicate")},
    )
    on_gpu = device.type != "cpu"
    return parallelize(
        model,
        mesh,
        tp_enabled=tp,
        ac=spec.activation_checkpoint if trainable else "none",
        compile=spec.compile,
        param_dtype=spec.param_dtype if on_gpu else "float32",
        reduce_dtype=spec.reduce_dtype if on_gpu else "float32",
        cpu_offload=spec.cpu_offload,
        ep=spec.ep,
    )


def build_model(
    make: Callable[[], nn.Module],
    initial_state: Callable[[], dict[str, torch.Tensor]],
    mesh: Any,
    device: torch.device,
    spec: BuildSpec,
    *,
    is_main: bool,
    trainable: bool = True,
    tp: bool = True,
) -> nn.Module:
    """The one model builder (policy, reference, critic, reward model, teachers): ``make()``
    on the meta device, `parallelize_model`, then rank 0's ``initial_state()`` (the full
    weights, CPU) broadcast into the shards, so every layout starts from the same weights.
    A vision-language model's tower is frozen unless ``spec.train_vision``.
    Pipeline stages use `parallelize_model` the same way (tandem/rl/update/policy.py)."""
    with torch.device("meta"):
        model = make()
    lora = spec.lora if trainable else None
    shapes = {}
    if lora is not None:  # a frozen base with adapters (tandem/models/lora.py), before any sharding
        apply_lora(model, lora.spec)
        shapes = adapter_shapes(model)
    parallelize_model(model, mesh, device, spec, trainable=trainable, tp=tp)
    model.to_empty(device=device)
    model.reset_rope()
    load_full_state(model, with_adapters(initial_state(), lora, shapes) if is_main else None, mesh)
    if not trainable:
        model.requires_grad_(False).eval()
    elif hasattr(model, "visual") and not spec.train_vision:
        # a frozen tower: the same on every rank, never in a gradient collective
        model.visual.requires_grad_(False)
    return model


def with_adapters(
    full: dict[str, torch.Tensor], lora: LoraSetup | None, shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """``full`` plus the adapters' first values (fresh, or ``lora.adapter_path``'s)."""
    if lora is None:
        return full
    try:
        return {**full, **lora.initial(shapes)}
    except (OSError, ValueError, KeyError) as e:
        raise ModelSetupError(f"lora.adapter_path: {_one_line(e)}") from None


def lora_shapes(args: ModelArgs, lora: LoraSetup) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every adapter the whole model gets (pipeline stages take their share)."""
    with torch.device("meta"):
        model = make_model(args)
    apply_lora(model, lora.spec)
    return adapter_shapes(model)


def build_transformer(
    args: ModelArgs,
    path: str | None,
    seed: int,
    mesh: Any,
    device: torch.device,
    spec: BuildSpec,
    *,
    is_main: bool,
    trainable: bool = True,
) -> nn.Module:
    """A causal LM (policy, reference, teacher) from an HF folder or a seeded from-scratch init."""
    return build_model(
        lambda: make_model(args),
        lambda: full_initial_state(args, path, seed),
        mesh,
        device,
        spec,
        is_main=is_main,
        trainable=trainable,
    )


def build_scalar_model(
    args: ModelArgs,
    path: str | None,
    seed: int,
    mesh: Any,
    device: torch.device,
    spec: BuildSpec,
    *,
    is_main: bool,
    trainable: bool = True,
) -> nn.Module:
    """A transformer trunk with a scalar head (reward model, critic); no TP (its recipes check)."""
    from tandem.models.value_head import ScalarHeadModel, initial_scalar_state

    def initial() -> dict[str, torch.Tensor]:
        try:
            return initial_scalar_state(args, path, seed)
        except (OSError, ValueError, KeyError) as e:
            raise ModelSetupError(f"model.path: {_one_line(e)}") from None

    if spec.lora is not None:  # the score head is new: it trains in full beside the adapters
        spec = dataclasses.replace(spec, lora=spec.lora.keeping("score"))
    return build_model(
        lambda: ScalarHeadModel(args),
        initial,
        mesh,
        device,
        spec,
        is_main=is_main,
        trainable=trainable,
        tp=False,
    )
