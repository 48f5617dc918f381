"""Build the policy (or any HF-format model) for training: tokenizer, weights, sharding.

Weights are materialised once, in full, on rank 0 (an HF folder or a seeded
from-scratch init) and broadcast into the sharded model, so the same config
gives the same starting weights on every layout.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from models.args import ModelArgs
from models.flavors import get_flavor
from models.hf import check_weight_shapes, hf_to_tandem, load_args, read_hf_state_dict, save_hf
from models.tokenizer import Tokenizer, build_char_tokenizer
from models.transformer import Transformer


class ModelSetupError(Exception):
    """The model/tokenizer settings do not fit together; str() is one line."""


def build_tokenizer(tokenizer: str | None, model_path: str | None, cache_dir: str) -> Tokenizer:
    """``builtin:char`` builds the self-contained character tokenizer into cache_dir."""
    src = tokenizer or model_path
    if src is None:
        raise ModelSetupError("model.tokenizer: required when model.path is not set (a folder or 'builtin:char')")
    if src == "builtin:char":
        # One folder per rank: ranks build it at the same time and must not read a half-written file.
        rank_dir = os.path.join(cache_dir, f"rank-{os.environ.get('RANK', '0')}")
        os.makedirs(rank_dir, exist_ok=True)
        return build_char_tokenizer(rank_dir)
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
        raise ModelSetupError(f"{'model.path' if path else 'model.flavor'}: {_one_line(e)}") from None
    if tokenizer.vocab_size > args.vocab_size:
        key = "model.path" if path else "model.flavor"
        raise ModelSetupError(f"{key}: vocab_size {args.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
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
    model = Transformer(args)
    model.init_weights(seed)
    torch.set_rng_state(torch_state)
    return {k: v for k, v in model.state_dict().items()}


def load_full_state(model: nn.Module, full: dict[str, torch.Tensor] | None) -> None:
    """Load rank 0's full state dict into a (possibly sharded) model."""
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized() and dist.get_world_size() > 1,
                            strict=True)
    set_model_state_dict(model, full or {}, options=opts)


def gather_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank calls; rank 0 gets the full CPU state dict."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def export_hf(model: nn.Module, args: ModelArgs, tokenizer: Tokenizer | None, out_dir: str, rank: int) -> None:
    """Collective: write the model as an HF folder (rank 0 writes)."""
    state = gather_full_state(model)
    if rank == 0:
        save_hf(state, args, out_dir, tokenizer=tokenizer)


def build_sharded_model(args: ModelArgs, mesh, device: torch.device, *, path: str | None, seed: int,
                        param_dtype: str, reduce_dtype: str, cpu_offload: bool, is_main: bool,
                        trainable: bool = True, activation_checkpoint: str = "none",
                        compile: bool = False) -> nn.Module:
    """Meta-init, TP over ``mesh["tp"]``, activation checkpointing, compile, FSDP2 over the
    data-parallel mesh, then rank 0's full weights broadcast in.

    FSDP2 wraps even a single data-parallel rank (its mixed-precision casts),
    except under TP, where a one-rank FSDP mesh adds nothing to shard."""
    from parallel.ac import apply_ac
    from parallel.compile import apply_compile
    from parallel.fsdp import apply_fsdp
    from parallel.mesh import dp_mesh
    from parallel.tp import apply_tp

    with torch.device("meta"):
        model = Transformer(args)
    tp = mesh["tp"].size()
    if tp > 1:
        apply_tp(model, mesh["tp"])
    if trainable:
        apply_ac(model, activation_checkpoint)
    if compile:
        apply_compile(model)
    on_gpu = device.type != "cpu"
    if tp == 1 or mesh["dp_replicate"].size() * mesh["dp_shard"].size() > 1:
        apply_fsdp(model, dp_mesh(mesh), param_dtype=param_dtype if on_gpu else "float32",
                   reduce_dtype=reduce_dtype if on_gpu else "float32", cpu_offload=cpu_offload)
    model.to_empty(device=device)
    model.reset_rope()
    load_full_state(model, full_initial_state(args, path, seed) if is_main else None)
    if not trainable:
        model.requires_grad_(False).eval()
    return model
