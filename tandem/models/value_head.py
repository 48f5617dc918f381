"""A transformer trunk with a scalar head: reward models and (later) PPO critics.

`ScalarHeadModel` is our `Transformer` with its LM head removed and a
``Linear(hidden, 1)`` ``score`` head reading the final-norm hidden state, so it
gives one scalar per position: a critic uses every position, a reward model the
last real token of each sequence (`last_token_scores`).

On disk it is an HF-like folder: ``config.json`` (the trunk's HF config with a
``*ForSequenceClassification`` architecture and ``num_labels = 1``) and
safetensors holding the trunk under HF names (``model.*``, as tandem/models/hf.py
writes them) plus ``score.weight`` / ``score.bias``. Departure from
transformers' sequence-classification heads: ours has a bias, which a critic
needs; the Bradley-Terry loss cannot see a shared shift, so a reward model
trained on pairs keeps it at its initial 0, and transformers (which loads the
folder and ignores ``score.bias``) then gives the same scores.

Like tandem/models/transformer.py this file knows nothing of parallelism; the
``layers`` property only lets tandem/parallel/fsdp.py shard it block by block.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn

from tandem.models.args import ModelArgs
from tandem.models.attention import AttentionBackend
from tandem.models.hf import SINGLE_FILE, hf_to_tandem, load_args, read_hf_state_dict, tandem_to_hf
from tandem.models.transformer import Transformer

if TYPE_CHECKING:
    from tandem.models.tokenizer import Tokenizer

__all__ = [
    "HEAD_KEYS",
    "ScalarHeadModel",
    "initial_scalar_state",
    "last_token_scores",
    "load_scalar_model",
    "save_scalar_model",
    "scalar_state_from_hf",
    "scalar_state_to_hf",
]

HEAD_KEYS = ("score.weight", "score.bias")  # the same names in Tandem and on disk
_TRUNK = "trunk."


class ScalarHeadModel(nn.Module):
    """Transformer trunk (no LM head) + ``score = Linear(hidden, 1)``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.trunk = Transformer(args)
        self.trunk.output = None  # the vocab projection is never used: drop its memory
        self.score = nn.Linear(args.hidden_size, 1)

    @property
    def layers(self) -> nn.ModuleDict:
        """The trunk's blocks, so parallel/ can shard this model as it shards a Transformer."""
        return self.trunk.layers

    def reset_rope(self) -> None:
        self.trunk.reset_rope()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Trunk as `Transformer.init_weights`; head N(0, 1/sqrt(hidden + 1)), zero bias.

        The head's scale keeps initial scores O(1) whatever the width, so the
        Bradley-Terry loss starts near log 2 instead of saturating.
        """
        self.trunk.init_weights(seed)
        w = self.score.weight
        gen = None
        if seed is not None and w.device.type != "meta":
            gen = torch.Generator(device=w.device).manual_seed(seed + 1)
        nn.init.normal_(w, mean=0.0, std=1.0 / math.sqrt(self.args.hidden_size + 1), generator=gen)
        nn.init.zeros_(self.score.bias)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        attn: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """tokens ``[B, S]`` -> one score per position ``[B, S]`` (fp32)."""
        h = self.trunk(tokens, positions=positions, attn=attn, return_hidden=True)  # [B, S, D]
        # clone: FSDP2 hooks a module's output for backward, which must not be a view
        return self.score(h).squeeze(-1).float().clone()  # [B, S]


def last_token_scores(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The score at each row's last real token: ``scores [B, S]``, ``lengths [B]`` -> ``[B]``.

    Rows are right-padded, so with causal attention the last real token has
    seen the whole sequence and nothing of the padding.
    """
    idx = (lengths.to(scores.device).long() - 1).clamp(min=0)  # [B]
    return scores.gather(1, idx[:, None]).squeeze(1)


# ---------------------------------------------------------------------- state dicts
def scalar_state_to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Tandem names (``trunk.*``, ``score.*``) -> HF names (``model.*``, ``score.*``)."""
    trunk = {k[len(_TRUNK) :]: v for k, v in sd.items() if k.startswith(_TRUNK)}
    head = {k: v for k, v in sd.items() if not k.startswith(_TRUNK)}
    unknown = sorted(set(head) - set(HEAD_KEYS))
    if unknown:
        raise KeyError(f"tensors {unknown} are neither trunk nor score head")
    out = tandem_to_hf(trunk, args)
    out.pop("lm_head.weight", None)
    return {**out, **head}


def scalar_state_from_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF names -> Tandem names; a causal-LM folder's ``lm_head`` is dropped, and
    the head is taken when present (a reward-model folder) and left out otherwise."""
    head = {k: sd[k] for k in HEAD_KEYS if k in sd}
    trunk = hf_to_tandem({k: v for k, v in sd.items() if k not in HEAD_KEYS}, args)
    trunk.pop("output.weight", None)
    return {**{_TRUNK + k: v for k, v in trunk.items()}, **head}


def initial_scalar_state(args: ModelArgs, path: str | None, seed: int) -> dict[str, torch.Tensor]:
    """Full starting weights on CPU: trunk from an HF folder (policy or reward model)
    or a seeded from-scratch init; the head from the folder if it has one, else seeded.

    The global RNG is left as it was, so building the model does not move the
    training run's random stream.
    """
    rng = torch.get_rng_state()
    fresh = ScalarHeadModel(args)
    fresh.init_weights(seed)
    torch.set_rng_state(rng)
    state = dict(fresh.state_dict())
    if path:
        loaded = scalar_state_from_hf(read_hf_state_dict(path), args)
        missing = sorted(set(state) - set(loaded) - set(HEAD_KEYS))
        if missing:
            raise KeyError(
                f"tensors missing from {path}: {missing[:4]}{' ...' if len(missing) > 4 else ''}"
            )
        state.update(loaded)
    return state


# ---------------------------------------------------------------------- folders
def _hf_config(args: ModelArgs, tokenizer: Tokenizer | None) -> dict:
    config = args.to_hf()
    config["architectures"] = [
        a.replace("ForCausalLM", "ForSequenceClassification")
        for a in config.get("architectures", [])
    ]
    config["num_labels"] = 1
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        # transformers pools at the last non-pad token
        config["pad_token_id"] = tokenizer.pad_token_id
    return config


def save_scalar_model(
    state: dict[str, torch.Tensor],
    args: ModelArgs,
    path: str | Path,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write a full (unsharded) `ScalarHeadModel` state dict as an HF-like folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu").contiguous() for k, v in scalar_state_to_hf(state, args).items()
    }
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(_hf_config(args, tokenizer), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(path)
    return path


def load_scalar_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> ScalarHeadModel:
    """A `ScalarHeadModel` from a folder `save_scalar_model` wrote (head required)."""
    args = load_args(path)
    sd = scalar_state_from_hf(read_hf_state_dict(path), args)
    missing = [k for k in HEAD_KEYS if k not in sd]
    if missing:
        raise KeyError(f"{path} has no score head ({missing}); is it a reward-model folder?")
    with torch.device("meta"):
        model = ScalarHeadModel(args)
    model.to_empty(device=device)
    model.load_state_dict(sd, strict=True)
    model.to(dtype)
    model.reset_rope()
    return model
