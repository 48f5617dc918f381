"""LoRA against full weights on one CPU process: update-step time and bytes, refill seconds
and bytes.

    python bench/lora.py                               # the quickstart policy and a 100M flavor
    python bench/lora.py --sizes quickstart --repeat 7 --rank 16 --threads 1

For each model, in the same process and on the same batch:

* the update step (tandem/rl/update/loss.py: packed micro-batches of the GRPO loss, backward,
  AdamW), full weights (the reference) against rank ``--rank`` adapters on q, k, v, o, gate, up,
  down (tandem/models/lora.py): the median wall time of ``--repeat`` steps after one warm-up,
  the bytes the step keeps (parameters, gradients, AdamW moments) and the bytes one
  micro-batch saves for backward (autograd's saved tensors, parameters excluded);
* the refill of the rollout's generation copy (tandem/parallel/generation_layout.py
  `GenerationCopy`):
  a full copy each rollout (the reference) against the LoRA copy, whose base moved once and
  whose later builds move the adapters alone; the median seconds of the builds after the first
  and the bytes each moves; ``check s`` is the part of a LoRA refill spent on the adapters'
  checksum against the trainer's (tandem/parallel/checksum.py).

Prints one table and the ratios LoRA / full. One process, fp32, no FSDP2: the bytes are what
a rank holds without sharding (FSDP2 divides each by the shard count alike).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.models.args import ModelArgs  # noqa: E402

SIZES = {  # name -> ModelArgs kwargs (None: the quickstart's HF folder)
    "quickstart": None,
    "100m": dict(
        model_type="qwen3",
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
}


def _args(size: str) -> ModelArgs:
    from tandem.models.hf import load_args

    kw = SIZES[size]
    return load_args(ROOT / "assets" / "quickstart-policy") if kw is None else ModelArgs(**kw)


def _samples(vocab: int, n: int, prompt: int, completion: int):
    from tandem.rl.rollout.types import RolloutSample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        p = torch.randint(1, vocab, (prompt,), generator=g).tolist()
        c = torch.randint(1, vocab, (completion,), generator=g).tolist()
        out.append(
            RolloutSample(
                group=i // 4,
                prompt_ids=p,
                completion_ids=c,
                loss_mask=[True] * completion,
                gen_logprobs=[-1.0] * completion,
                finish_reason="stop",
                text="",
                row={"id": i},
            )
        )
    return out


def _model(args: ModelArgs, rank: int):
    from tandem.models.lora import LoraSpec, adapter_shapes, apply_lora, init_adapter_state
    from tandem.models.transformer import Transformer

    model = Transformer(args)
    model.init_weights(0)
    spec = None
    if rank:
        spec = LoraSpec(rank=rank, alpha=2.0 * rank)
        apply_lora(model, spec)
        model.load_state_dict(init_adapter_state(adapter_shapes(model), 0), strict=False)
    return model, spec


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _saved_bytes(model: torch.nn.Module, run) -> int:
    """Distinct storages autograd saves while ``run()`` builds its graph (parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    del out
    return sum(n for ptr, n in seen.items() if ptr not in params)


class _Update:
    """One model's update step on a fixed batch (`step()` returns its seconds)."""

    def __init__(self, args: ModelArgs, rank: int, samples) -> None:
        from tandem.rl.algorithms import AGGREGATIONS, POLICY_LOSSES, make_norm
        from tandem.rl.config.rl_schema import RLConfig
        from tandem.rl.core.optim import build_optimizer
        from tandem.rl.update.loss import LossInputs, LossSpec, completion_tensors
        from tandem.rl.update.packing import pack_micro_batches

        self.model, _ = _model(args, rank)
        self.opt = build_optimizer(
            self.model, lr=1e-4, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0
        )
        dev = torch.device("cpu")
        mask, gen_logp, self.width = completion_tensors(samples, dev)
        adv = torch.linspace(-1, 1, len(samples))[:, None].expand_as(mask).contiguous()
        r = RLConfig()
        self.spec = LossSpec(
            policy_loss=POLICY_LOSSES.get("ppo_clip"),
            policy_cfg=r,
            aggregation=AGGREGATIONS.get("token_mean"),
            kl_estimator=None,
            kl_coef=0.0,
            entropy_coef=0.0,
        )
        self.inp = LossInputs(
            mask=mask,
            old_logp=None,
            advantages=adv,
            gen_logp=gen_logp,
            ref_logp=None,
            seen_logp=torch.zeros_like(mask),
        )
        self.norm = make_norm(mask)
        self.mbs = pack_micro_batches(samples, list(range(len(samples))), 1024, dev)
        self.kept = 0

    def _loss(self, mb):  # noqa: ANN001, ANN202
        from tandem.rl.update.loss import micro_batch_loss

        return micro_batch_loss(self.model, mb, self.inp, self.spec, self.norm, self.width)[0]

    def step(self) -> float:
        t0 = time.perf_counter()
        for mb in self.mbs:
            self._loss(mb).backward()
        self.opt.step()
        dt = time.perf_counter() - t0
        m, opt = self.model, self.opt
        self.kept = (
            _bytes(m.parameters())
            + _bytes(p.grad for p in m.parameters() if p.grad is not None)
            + _bytes(v for st in opt.state.values() for v in st.values() if v.dim() > 0)
        )
        opt.zero_grad(set_to_none=True)
        return dt

    def report(self, times: list[float]) -> dict[str, float]:
        saved = _saved_bytes(self.model, lambda: self._loss(self.mbs[0]))
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return {
            "step_s": statistics.median(times),
            "kept_mb": self.kept / 1e6,
            "saved_mb": saved / 1e6,
            "trained_m": trained / 1e6,
        }


class _Refill:
    """One model's generation copy (`build()` after an optimizer-like change; returns
    its seconds)."""

    def __init__(self, args: ModelArgs, rank: int) -> None:
        from tandem.parallel.generation_layout import GenerationCopy, GenerationLayout

        self.model, spec = _model(args, rank)
        self.copy = GenerationCopy(
            self.model, args, GenerationLayout(), torch.device("cpu"), lora=spec
        )
        self.moved = 0.0
        self.check: list[float] = []  # of each build, the seconds of the adapters' checksum

    def build(self) -> float:
        with torch.no_grad():  # new values to move: every weight, or the adapters alone
            for p in self.model.parameters():
                if p.requires_grad:
                    p.add_(1e-6)
        t0 = time.perf_counter()
        gen, m = self.copy.build()
        dt = time.perf_counter() - t0
        del gen
        gc.collect()
        self.moved = m["reshard/gb"] * 1e9
        self.check.append(m.get("lora/check_seconds", 0.0))
        return dt


def measure(args: ModelArgs, rank: int, repeat: int, samples) -> dict[str, dict[str, float]]:
    """Full weights and LoRA, their steps and builds alternated (a busy machine slows both alike);
    the first of each is a warm-up (and the copies' first build, which moves everything)."""
    updates = {"full": _Update(args, 0, samples), "lora": _Update(args, rank, samples)}
    refills = {"full": _Refill(args, 0), "lora": _Refill(args, rank)}
    steps: dict[str, list[float]] = {k: [] for k in updates}
    builds: dict[str, list[float]] = {k: [] for k in refills}
    for i in range(repeat + 1):
        for k in updates:
            dt, bt = updates[k].step(), refills[k].build()
            if i:
                steps[k].append(dt)
                builds[k].append(bt)
    return {
        k: {
            **updates[k].report(steps[k]),
            "refill_s": statistics.median(builds[k]),
            "check_s": statistics.median(refills[k].check[1:]),
            "refill_mb": refills[k].moved / 1e6,
        }
        for k in updates
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--sizes", default="quickstart,100m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (2 on a shared 2-core box spin-waited: 10x slower)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="the quickstart size, 2 repeats, 4 samples"
    )
    opts = ap.parse_args()
    if opts.smoke:
        opts.sizes, opts.repeat, opts.samples = "quickstart", 2, 4
    from bench.header import print_header

    print_header("bench.lora")
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {opts.samples} "
        f"samples of {opts.prompt} + {opts.completion} tokens; LoRA rank {opts.rank} on q, k, v, "
        "o, gate, up, down"
    )
    head = (
        f"{'model':<11}{'weights':<8}{'trained M':>10}{'step s':>9}{'kept MB':>10}"
        f"{'saved MB':>10}{'refill s':>10}{'check s':>9}{'refill MB':>11}"
    )
    print(head)
    ratios = []
    for size in opts.sizes.split(","):
        args = _args(size)
        samples = _samples(min(args.vocab_size, 1000), opts.samples, opts.prompt, opts.completion)
        rows = measure(args, opts.rank, opts.repeat, samples)
        for name, r in rows.items():
            print(
                f"{size:<11}{name:<8}{r['trained_m']:>10.3f}{r['step_s']:>9.4f}"
                f"{r['kept_mb']:>10.2f}{r['saved_mb']:>10.2f}{r['refill_s']:>10.5f}"
                f"{r['check_s']:>9.5f}{r['refill_mb']:>11.3f}"
            )
        f, lo = rows["full"], rows["lora"]
        ratios.append(
            f"{size}: step time {lo['step_s'] / f['step_s']:.2f}x, kept bytes "
            f"{lo['kept_mb'] / f['kept_mb']:.2f}x, saved activations "
            f"{lo['saved_mb'] / f['saved_mb']:.2f}x, refill time "
            f"{lo['refill_s'] / f['refill_s']:.3f}x, refill bytes "
            f"{lo['refill_mb'] / f['refill_mb']:.3f}x"
        )
    print("ratio LoRA / full (same process, same batch):")
    for line in ratios:
        print("  " + line)


if __name__ == "__main__":
    main()
