"""Hugging Face checkpoint folders in and out.

Reads ``config.json`` + safetensors (single file or sharded with
``model.safetensors.index.json``), renames tensors to Tandem's module tree and
back, and writes folders that ``transformers.AutoModelForCausalLM`` loads.
Export -> reload is bit-exact (no dtype change unless asked). Tied models may
omit ``lm_head.weight`` on disk; we write it omitted, as transformers does.
MoE experts are one tensor per expert on disk
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``) and one stacked 3-D
parameter here (``layers.{i}.moe.experts.w1``, expert ``e`` at index ``e``):
stacked on load, split (copied) on export. A vision-language model's tower keeps HF's
names (``visual.blocks.{i}.attn.qkv.weight``, ...); its LM is named like Qwen2's
(transformers 5 writes both so; its in-memory ``model.language_model.`` / ``model.visual.``
prefixes are read too). GPT-OSS's router and fused, interleaved experts are translated by
tandem/models/gpt_oss.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tandem.models import gpt_oss
from tandem.models.args import ModelArgs
from tandem.models.image_processor import CONFIG_FILE as IMAGE_CONFIG
from tandem.models.image_processor import ImageProcessor
from tandem.models.transformer import Transformer
from tandem.models.vlm import make_model

if TYPE_CHECKING:
    from tandem.models.tokenizer import Tokenizer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Present in some old checkpoints; derived from the config, so safe to drop.
_IGNORED_HF = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _ignored(name: str, args: ModelArgs) -> bool:
    """Tensors a folder may hold that the model does not use: old RoPE buffers, and
    DeepSeek-V3's multi-token-prediction layers (indices past ``num_hidden_layers``)."""
    if _IGNORED_HF.match(name):
        return True
    m = _LAYER.match(name)
    return args.is_mla and m is not None and int(m.group(1)) >= args.num_layers


# (HF pattern, Tandem pattern); {i} is the layer index.
_NAME_PAIRS = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.attention.q_norm.weight"),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.attention.k_norm.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.self_attn.o_proj.bias", "layers.{i}.attention.wo.bias"),  # GPT-OSS
    ("model.layers.{i}.self_attn.sinks", "layers.{i}.attention.sinks"),  # GPT-OSS
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.moe.gate.weight"),
    (
        "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
        "layers.{i}.moe.shared_experts.w1.weight",
    ),
    (
        "model.layers.{i}.mlp.shared_expert.down_proj.weight",
        "layers.{i}.moe.shared_experts.w2.weight",
    ),
    (
        "model.layers.{i}.mlp.shared_expert.up_proj.weight",
        "layers.{i}.moe.shared_experts.w3.weight",
    ),
    ("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.{i}.moe.shared_expert_gate.weight"),
    # DeepSeek-V3: multi-head latent attention, the router's correction bias, shared experts
    # (plural on disk; `tandem_to_hf` renames Qwen2-MoE's singular for it)
    ("model.layers.{i}.self_attn.q_a_proj.weight", "layers.{i}.attention.wq_a.weight"),
    ("model.layers.{i}.self_attn.q_a_layernorm.weight", "layers.{i}.attention.q_a_norm.weight"),
    ("model.layers.{i}.self_attn.q_b_proj.weight", "layers.{i}.attention.wq_b.weight"),
    ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", "layers.{i}.attention.wkv_a.weight"),
    (
        "model.layers.{i}.self_attn.kv_a_layernorm.weight",
        "layers.{i}.attention.kv_a_norm.weight",
    ),
    ("model.layers.{i}.self_attn.kv_b_proj.weight", "layers.{i}.attention.wkv_b.weight"),
    ("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.moe.expert_bias"),
    *(
        (
            f"model.layers.{{i}}.mlp.shared_experts.{p}_proj.weight",
            f"layers.{{i}}.moe.shared_experts.{w}.weight",
        )
        for p, w in (("gate", "w1"), ("down", "w2"), ("up", "w3"))
    ),
    # Qwen3.5's gated DeltaNet layers (tandem/models/linear_attention.py keeps HF's names)
    *(
        (f"model.layers.{{i}}.linear_attn.{p}", f"layers.{{i}}.attention.{p}")
        for p in (
            "in_proj_qkv.weight",
            "in_proj_z.weight",
            "in_proj_b.weight",
            "in_proj_a.weight",
            "conv1d.weight",
            "dt_bias",
            "A_log",
            "norm.weight",
            "out_proj.weight",
        )  # fmt: skip
    ),
] + [
    (f"model.layers.{{i}}.self_attn.{p}_proj.{kind}", f"layers.{{i}}.attention.w{p}.{kind}")
    for p in "qkv"
    for kind in ("weight", "bias")
]


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_HF_TO_TANDEM = [(_compile(h), t) for h, t in _NAME_PAIRS]
_TANDEM_TO_HF = [(_compile(t), h) for h, t in _NAME_PAIRS]

# One expert's projection on disk <-> a slice of the stacked parameter.
_EXPERT_PROJ = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_HF_EXPERT = re.compile(
    r"model\.layers\.(?P<i>\d+)\.mlp\.experts\.(?P<e>\d+)\.(?P<p>gate|down|up)_proj\.weight$"
)
_TANDEM_EXPERTS = re.compile(r"layers\.(?P<i>\d+)\.moe\.experts\.(?P<w>w[123])$")


def _rename(name: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.format(i=m.group("i")) if "{i}" in target else target
    return None


_VISION = "visual."
_HF_PREFIXES = (("model.language_model.", "model."), ("model.visual.", _VISION))


def canonical_hf_name(name: str) -> str:
    """The on-disk (hub) form of an HF tensor name: transformers 5's in-memory VLM
    prefixes dropped."""
    for old, new in _HF_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def hf_name_to_tandem(name: str) -> str | None:
    """Tandem name for an HF tensor name, or None when it has no counterpart."""
    name = canonical_hf_name(name)
    if name.startswith(_VISION):
        return name
    return _rename(name, _HF_TO_TANDEM)


def tandem_name_to_hf(name: str) -> str | None:
    """HF name for a Tandem tensor name, or None when it has no counterpart."""
    if name.startswith(_VISION):
        return name
    return _rename(name, _TANDEM_TO_HF)


def _stack_experts(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Pop the per-expert HF tensors out of ``sd`` and return them stacked, Tandem names."""
    found: dict[str, dict[int, torch.Tensor]] = {}
    for name in [n for n in sd if _HF_EXPERT.match(n)]:
        m = _HF_EXPERT.match(name)
        target = f"layers.{m['i']}.moe.experts.{_EXPERT_PROJ[m['p'] + '_proj']}"
        found.setdefault(target, {})[int(m["e"])] = sd.pop(name)
    stacked = {}
    for target, experts in found.items():
        if sorted(experts) != list(range(args.num_experts)):
            missing = sorted(set(range(args.num_experts)) - set(experts))
            extra = sorted(set(experts) - set(range(args.num_experts)))
            raise KeyError(
                f"{target}: experts {missing} missing, {extra} unexpected "
                f"(config num_experts={args.num_experts})"
            )
        stacked[target] = torch.stack([experts[e] for e in range(args.num_experts)])
    return stacked


def hf_to_tandem(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Rename an HF state dict to Tandem names. For tied models ``output.weight`` is
    the embedding tensor (whether or not the HF dict carried ``lm_head.weight``).
    Per-expert tensors are stacked into 3-D parameters."""
    sd = dict(sd)
    if args.model_type == "gpt_oss":
        out: dict[str, torch.Tensor] = gpt_oss.hf_to_tandem(sd)
    else:
        out = _stack_experts(sd, args)
    for name, tensor in sd.items():
        if _ignored(name, args):
            continue
        new = hf_name_to_tandem(name)
        if new is None:
            raise KeyError(f"unknown HF tensor {name!r} for model_type {args.model_type!r}")
        out[new] = tensor
    if args.tie_word_embeddings:
        if "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        elif "output.weight" in out:
            out["tok_embeddings.weight"] = out["output.weight"]
    return out


def tandem_to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Rename a Tandem state dict to HF names; tied models drop ``lm_head.weight``
    (keeping the embedding, recovered from ``output.weight`` if that is all there is).
    Stacked expert parameters become one tensor per expert (copies: safetensors
    refuses tensors that share storage)."""
    out: dict[str, torch.Tensor] = {}
    if args.model_type == "gpt_oss":
        sd = dict(sd)
        out.update(gpt_oss.tandem_to_hf(sd))
    for name, tensor in sd.items():
        m = _TANDEM_EXPERTS.match(name)
        if m:
            proj = {w: p for p, w in _EXPERT_PROJ.items()}[m["w"]]
            for e in range(tensor.shape[0]):
                out[f"model.layers.{m['i']}.mlp.experts.{e}.{proj}.weight"] = tensor[e].clone()
            continue
        new = tandem_name_to_hf(name)
        if new is None:
            raise KeyError(f"tensor {name!r} has no Hugging Face counterpart")
        if args.is_mla:
            new = new.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        out[new] = tensor
    if args.tie_word_embeddings and "lm_head.weight" in out:
        lm_head = out.pop("lm_head.weight")
        out.setdefault("model.embed_tokens.weight", lm_head)
    return out


# ---------------------------------------------------------------------- reading
def read_json_object(file: Path) -> dict[str, Any]:
    """A JSON object file; FileNotFoundError / ValueError (one line naming it) otherwise."""
    if not file.is_file():
        raise FileNotFoundError(f"no {file.name} in {file.parent}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def load_args(path: str | Path) -> ModelArgs:
    """ModelArgs from ``config.json``; eos ids also gathered from ``generation_config.json``."""
    path = Path(path)
    args = ModelArgs.from_hf(read_json_object(path / "config.json"))
    if args.vision is not None and (path / IMAGE_CONFIG).is_file():
        processor = ImageProcessor.from_dir(path)
        args = args.replace(vision=dataclasses.replace(args.vision, processor=processor))
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        extra = json.loads(gen_file.read_text()).get("eos_token_id")
        extra = [extra] if isinstance(extra, int) else (extra or [])
        args.eos_token_id = args.eos_token_id + [i for i in extra if i not in args.eos_token_id]
    return args


def tensor_files(path: str | Path) -> dict[str, str]:
    """Map each tensor name in an HF folder to the safetensors file holding it."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = path / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    with _open_safetensors(single) as f:
        return {name: SINGLE_FILE for name in f.keys()}


def _open_safetensors(file: Path) -> Any:
    """``safe_open(file)``; a truncated or garbage file is a ValueError naming it."""
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as e:
        raise ValueError(
            f"{file}: not a readable safetensors file ({str(e).strip().splitlines()[0]})"
        ) from None


def check_weight_shapes(path: str | Path, args: ModelArgs) -> None:
    """ValueError naming the file and tensor unless every safetensors file in ``path``
    opens and each tensor the model uses has the shape ``args`` (config.json) gives.
    Reads headers only."""
    path = Path(path)
    with torch.device("meta"):
        model = make_model(args)
    expected = {n: list(t.shape) for n, t in tandem_to_hf(model.state_dict(), args).items()}
    for fname in sorted(set(tensor_files(path).values())):
        with _open_safetensors(path / fname) as f:
            for name in f.keys():
                shape = list(f.get_slice(name).get_shape())
                name = canonical_hf_name(name)
                if name in expected and shape != expected[name]:
                    raise ValueError(
                        f"{path / fname}: {name} has shape {shape}, but "
                        f"config.json makes it {expected[name]}"
                    )


def read_hf_state_dict(
    path: str | Path, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Read tensors (all, or only ``names``) from an HF folder, HF names, on CPU."""
    path = Path(path)
    files = tensor_files(path)
    wanted = set(files) if names is None else set(names)
    missing = wanted - set(files)
    if missing:
        raise KeyError(f"tensors {sorted(missing)} not found in {path}")
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    sd: dict[str, torch.Tensor] = {}
    for fname, fnames in sorted(by_file.items()):
        with _open_safetensors(path / fname) as f:
            for name in fnames:
                sd[name] = f.get_tensor(name)
    return sd


def _check_tensor_names(model: Transformer, files: dict[str, str], path: Path) -> None:
    """Clear errors for tensors in the folder the model lacks, and the reverse."""
    expected = set(tandem_to_hf(model.state_dict(), model.args))  # meta model: no copies
    found = {canonical_hf_name(n) for n in files if not _ignored(n, model.args)}
    if model.args.tie_word_embeddings:
        found.discard("lm_head.weight")
    unknown = sorted(found - expected)
    if unknown:
        where = ", ".join(f"{n} (in {files.get(n, 'its file')})" for n in unknown)
        raise KeyError(f"unexpected tensors in {path} for {model.args.model_type}: {where}")
    missing = sorted(expected - found)
    if missing:
        raise KeyError(
            f"tensors missing from {path}: {missing} (files: {sorted(set(files.values()))})"
        )


def load_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """Build a Transformer from an HF folder: meta construction, then load into ``device``."""
    path = Path(path)
    args = load_args(path)
    files = tensor_files(path)
    with torch.device("meta"):
        model = make_model(args)
    _check_tensor_names(model, files, path)
    check_weight_shapes(path, args)
    model.to_empty(device=device).to(dtype)
    hf_sd = read_hf_state_dict(path, [n for n in files if not _ignored(n, args)])
    model.load_state_dict(hf_to_tandem(hf_sd, args), strict=True)
    model.reset_rope()
    return model


# ---------------------------------------------------------------------- writing
def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in insertion order; a tensor larger than max_bytes gets its own shard."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_hf(
    state_dict: dict[str, torch.Tensor],
    args: ModelArgs,
    path: str | Path,
    tokenizer: Tokenizer | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write an HF folder from a full (unsharded) Tandem state dict.

    Writes config.json, generation_config.json, safetensors (sharded with an
    index when over ``max_shard_bytes``) and, if given, the tokenizer files.
    ``dtype`` casts floating tensors; None keeps them as they are.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in tandem_to_hf(state_dict, args).items():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.to("cpu").contiguous()
    for stale in [path / SINGLE_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    shards = _shards(tensors, max_shard_bytes)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE_FILE), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata=meta)
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    _write_configs(args, path, tensors, tokenizer)
    if tokenizer is not None:
        tokenizer.save(path)
    return path


def _write_configs(
    args: ModelArgs, path: Path, tensors: dict[str, torch.Tensor], tokenizer: Tokenizer | None
) -> None:
    config: dict[str, Any] = args.to_hf()
    float_dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(float_dtypes) == 1:
        name = _dtype_name(float_dtypes.pop())
        config["dtype"] = name  # transformers 5.x
        config["torch_dtype"] = name  # transformers 4.x
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if args.vision is not None:
        args.vision.processor.save(path)
    eos = list(args.eos_token_id)
    if tokenizer is not None:
        eos += [i for i in tokenizer.eos_token_ids if i not in eos]
    gen: dict[str, Any] = {"bos_token_id": args.bos_token_id, "eos_token_id": eos or None}
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        gen["pad_token_id"] = tokenizer.pad_token_id
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
