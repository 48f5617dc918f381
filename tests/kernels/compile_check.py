"""Compile rl.exact's Triton kernels for a GPU (sm_90) without one: Triton's front end, its
lowering and ptxas, as on an H200, with the configurations the host wrappers launch. Catches
what the interpreter lets through (it runs the kernels as numpy, not as compiled code).

Run without ``TRITON_INTERPRET`` (interpreted kernels cannot be compiled), as
test_triton_batch_invariant.py does: ``python tests/kernels/compile_check.py``.
"""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tandem.kernels import triton_batch_invariant as tbi

PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}
MM_INTS = (
    "M N K stride_am stride_ak stride_bk stride_bn stride_biasm stride_biasn stride_cm stride_cn"
).split()
ATTN_INTS = (
    "stride_qt stride_qh stride_qd stride_kn stride_kh stride_kd stride_vn stride_vh "
    "stride_vd stride_it stride_ot stride_oh stride_od G D"
).split()


def _compile(fn, signature: dict[str, str], constexprs: dict[str, object], **options: int) -> None:  # noqa: ANN001
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )
    print("compiled", fn.__name__, constexprs)


def main() -> None:
    for dtype, (bm, bn, bk, warps, stages) in tbi.CONFIG.items():
        ptr = PTR[dtype]
        sig = {
            "a_ptr": ptr,
            "b_ptr": ptr,
            "bias_ptr": ptr,
            "c_ptr": ptr,
            **dict.fromkeys(MM_INTS, "i32"),
            "alpha": "fp32",
            "beta": "fp32",
        }
        for bias in (False, True):
            _compile(
                tbi._mm_kernel,
                sig,
                {
                    "HAS_BIAS": bias,
                    "INTERPRETED": False,
                    "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
                    "BLOCK_M": bm,
                    "BLOCK_N": bn,
                    "BLOCK_K": bk,
                },
                num_warps=warps,
                num_stages=stages,
            )
    sig = {
        "q_ptr": "*bf16",
        "k_ptr": "*bf16",
        "v_ptr": "*bf16",
        "idx_ptr": "*i64",
        "len_ptr": "*i64",
        "out_ptr": "*fp32",
        **dict.fromkeys(ATTN_INTS, "i32"),
        "scale": "fp32",
    }
    for levels in (1, 8):  # Qwen3-1.7B's heads: 16 query / 8 KV heads of 128
        _compile(
            tbi._attention_kernel,
            sig,
            {
                "G_P": 2,
                "D_P": 128,
                "KC": tbi.KEY_CHUNK,
                "LEVELS": levels,
                "LOG2_D": 7,
                "LOG2_KC": tbi.KEY_CHUNK.bit_length() - 1,
            },
            num_warps=tbi.ATTN_WARPS,
        )


if __name__ == "__main__":
    main()
