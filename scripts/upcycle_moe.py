"""Turn a dense HF folder into a Qwen3-MoE one whose experts start as copies of its MLP.

    python scripts/upcycle_moe.py assets/quickstart-policy assets/quickstart-moe-policy \
        --experts 4 --per-token 2

Sparse upcycling (Komatsuzaki et al., 2022): every expert of a layer is the dense
layer's SwiGLU, and the top-k weights are renormalised to sum to 1
(``norm_topk_prob``), so the MoE model computes exactly what the dense one did,
whatever the router picks, until training moves the experts apart. The router
starts from N(0, ``--router-std``) weights (near-uniform routing). Tokenizer files
are copied. This is how the MoE quickstart gets a policy that can already do
some of its task without a download.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.models.hf import hf_to_tandem, load_args, read_hf_state_dict, save_hf  # noqa: E402


def upcycle(
    src: Path,
    dst: Path,
    experts: int,
    per_token: int,
    router_std: float,
    aux_coef: float,
    seed: int,
) -> None:
    dense = load_args(src)
    if dense.model_type != "qwen3":
        raise SystemExit(
            f"error: {src}: upcycling writes Qwen3-MoE from a qwen3 model, got {dense.model_type}"
        )
    args = dataclasses.replace(
        dense,
        model_type="qwen3_moe",
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=dense.intermediate_size,
        norm_topk_prob=True,
        router_aux_loss_coef=aux_coef,
    )
    sd = hf_to_tandem(read_hf_state_dict(src), dense)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sd.items():
        if ".feed_forward." not in name:
            out[name] = t
            continue
        prefix, w = name.split(".feed_forward.")
        w = w.removesuffix(".weight")  # w1 [I, D], w2 [D, I], w3 [I, D]
        out[f"{prefix}.moe.experts.{w}"] = t.unsqueeze(0).repeat(experts, 1, 1).contiguous()
        if w == "w1":
            out[f"{prefix}.moe.gate.weight"] = (
                torch.randn(experts, dense.hidden_size, generator=gen) * router_std
            )
    save_hf(out, args, dst)
    for f in src.iterdir():
        if f.name.startswith(
            ("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "generation_config")
        ):
            shutil.copy(f, dst / f.name)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--per-token", type=int, default=2)
    ap.add_argument("--router-std", type=float, default=0.02)
    ap.add_argument("--aux-coef", type=float, default=0.001)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    upcycle(a.src, a.dst, a.experts, a.per_token, a.router_std, a.aux_coef, a.seed)


if __name__ == "__main__":
    main()
