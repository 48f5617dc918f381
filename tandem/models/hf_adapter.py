"""LoRA adapters in PEFT's folder format, out and in.

A folder holds ``adapter_config.json`` (``peft_type = "LORA"``, ``r``, ``lora_alpha``,
``target_modules`` as HF module names) and ``adapter_model.safetensors`` with keys
``base_model.model.<HF module>.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight``
(``[out, r]``), which is what ``peft.PeftModel.from_pretrained(hf_model, folder)`` reads.
Tandem's adapter names map through the base weight's HF name (tandem/models/hf.py):
``layers.3.attention.wq.lora_A.weight`` <->
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``.

Adapters on grouped experts (3-D, one per expert) have no counterpart here: transformers
5 stores experts as fused 3-D parameters that PEFT adapts differently, so `save_adapter`
refuses them (the merged ``hf/`` export carries them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tandem.models.hf import hf_name_to_tandem, read_json_object, tandem_name_to_hf
from tandem.models.lora import LoraSpec, base_name

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# Tandem target name -> the HF module names PEFT's target_modules matches (by suffix)
HF_TARGETS = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}


def _peft_key(name: str) -> str:
    """Tandem adapter name -> PEFT key."""
    hf = tandem_name_to_hf(base_name(name))
    if hf is None or not hf.endswith(".weight"):
        raise KeyError(f"adapter {name!r} has no Hugging Face module")
    part = "lora_A" if "lora_A" in name else "lora_B"
    return f"{_PREFIX}{hf.removesuffix('.weight')}.{part}.weight"


def _tandem_key(key: str) -> str | None:
    """PEFT key -> Tandem adapter name (None: not a LoRA A/B weight of a known module)."""
    if not key.startswith(_PREFIX):
        return None
    rest = key.removeprefix(_PREFIX)
    for part in ("lora_A", "lora_B"):
        suffix = f".{part}.weight"
        if rest.endswith(suffix):
            base = hf_name_to_tandem(rest.removesuffix(suffix) + ".weight")
            return None if base is None else base.removesuffix(".weight") + suffix
    return None


def save_adapter(
    adapters: dict[str, torch.Tensor],
    spec: LoraSpec,
    path: str | Path,
    base_model: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a PEFT LoRA folder from Tandem-named adapter tensors (CPU, full, unsharded)."""
    if "experts" in spec.targets:
        raise ValueError(
            "adapters on grouped experts have no PEFT counterpart here (the merged hf/ holds them)"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in adapters.items():
        t = t.detach().to("cpu")
        tensors[_peft_key(name)] = (t.to(dtype) if dtype is not None else t).contiguous()
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(HF_TARGETS[t] for t in spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """``adapter_config.json`` of a PEFT folder, checked to be a plain LoRA Tandem can run:
    ValueError (one line naming the file and field) for DoRA, rsLoRA, per-module ranks or
    alphas, biases, layer subsets, fan-in-fan-out or target modules Tandem does not adapt."""
    file = Path(path) / CONFIG
    cfg = read_json_object(file)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type is {cfg.get('peft_type')!r}, not 'LORA'")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{file}: bias = {cfg['bias']!r} is not supported (plain LoRA only)")
    for key in (
        "use_dora",
        "use_rslora",
        "fan_in_fan_out",
        "rank_pattern",
        "alpha_pattern",
        "layers_to_transform",
        "modules_to_save",
        "target_parameters",
        "lora_bias",
    ):
        if cfg.get(key):  # absent, null, false or empty: plain LoRA
            raise ValueError(f"{file}: {key} = {cfg[key]!r} is not supported (plain LoRA only)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if type(r) is not int or r < 1:
        raise ValueError(f"{file}: r must be an integer >= 1 (the LoRA rank), got {r!r}")
    if type(alpha) not in (int, float) or not 0 < alpha < math.inf:
        raise ValueError(f"{file}: lora_alpha must be a number > 0, got {alpha!r}")
    targets = cfg.get("target_modules")
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{file}: target_modules must be a list of module names, got {targets!r}")
    known = {v: k for k, v in HF_TARGETS.items()}
    odd = sorted(set(targets) - set(known))
    if odd:
        raise ValueError(
            f"{file}: target_modules {odd} are not adapted by Tandem (known: {sorted(known)})"
        )
    cfg["tandem_targets"] = sorted(known[t] for t in targets)
    return cfg


def load_adapter(path: str | Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A PEFT folder's adapters under Tandem names, checked against ``shapes`` (every adapter the
    model has, `tandem.models.lora.adapter_shapes`): KeyError / ValueError naming the file and
    tensor for one missing, unknown or of another shape."""
    path = Path(path)
    file = path / WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"no {WEIGHTS} in {path}")
    try:
        tensors = load_file(str(file))
    except Exception as e:  # noqa: BLE001  (safetensors raises its own SafetensorError)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{file}: not a readable safetensors file ({why})") from None
    out = {}
    for key, t in tensors.items():
        name = _tandem_key(key)
        if name is None or name not in shapes:
            raise KeyError(f"{file}: {key} is not an adapter of this model")
        if tuple(t.shape) != shapes[name]:
            raise ValueError(
                f"{file}: {key} has shape {list(t.shape)}, the model's adapter {list(shapes[name])}"
            )
        out[name] = t.float()
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise KeyError(
            f"{file}: no tensor for the model's adapters {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''} ({len(missing)} of {len(shapes)})"
        )
    return out


def spec_matches(cfg: dict[str, Any], spec: LoraSpec) -> str | None:
    """Why a read adapter config does not describe ``spec`` (None: it does)."""
    if int(cfg["r"]) != spec.rank:
        return f"rank {spec.rank}, but the adapter has r = {cfg['r']}"
    if float(cfg["lora_alpha"]) != spec.alpha:
        return f"alpha {spec.alpha:g}, but the adapter has lora_alpha = {cfg['lora_alpha']}"
    if (
        sorted(set(spec.targets) & set(HF_TARGETS)) != cfg["tandem_targets"]
        or "experts" in spec.targets
    ):
        return (
            f"targets {sorted(spec.targets)}, but the adapter's target_modules give "
            f"{cfg['tandem_targets']}"
        )
    return None
