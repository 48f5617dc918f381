"""Context parallelism on CPU: per-rank memory and step time of one long sequence at cp = 1, 2, 4.

    python -m bench.context_parallel                              # 8k, 16k, 32k tokens; cp 1, 2, 4
    python -m bench.context_parallel --tokens 8192 --cp 1,2 --styles ulysses
    python -m bench.context_parallel --smoke                      # 1024 tokens, cp 1, 2

For each sequence length and each (cp, style) the update step of tandem/rl/update/policy.py
(`FlatPolicy.accumulate`: forward, backward, FSDP2's reduce-scatter over the cp ranks) runs on
one sample of that many tokens (64 of prompt, the rest completion), a micro-batch of its own,
under ``torchrun --nproc-per-node cp`` (gloo, one thread per rank), in a fresh launch per row.
The model is the ``debug-qwen3`` flavor (2 layers, hidden 64, 4 heads). Per rank, the
worst over the ranks:

* ``saved MB``: what the step's forward saves for backward (the activations: distinct storages
  of autograd's saved tensors, parameters left out);
* ``peak MB``: the most bytes of tensor storage alive at once during one step among the tensors
  the step created (every ATen call's outputs, through a dispatch mode that drops a storage when
  it is freed): activations, temporaries, gradients, communication buffers; allocator slack and
  what existed before the step (the parameter shards) left out;
* ``step s``: the median of ``--repeats`` timed steps after a warm-up step.

``ratio`` columns divide the cp = 1 row's numbers of the same length by the row's. Rows whose
launch fails (out of memory, a timeout) print the reason. The machine may be shared: compare
ratios within one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _peak_live():  # noqa: ANN202 - a TorchDispatchMode
    """A dispatch mode recording the peak bytes of the storages created under it and still alive."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class PeakLive(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, tuple[StorageWeakRef, int]] = {}
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    if st.data_ptr() and st.data_ptr() not in self.live:
                        self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
            return out

    return PeakLive()


def _update_step(tokens: int, style: str):  # noqa: ANN202 - (policy, one-step closure)
    """This rank's policy (FSDP2 over the cp ranks) and a closure taking one timed update step
    (forward, backward) on one sample of ``tokens`` tokens."""
    import torch
    import torch.distributed as dist

    from tandem.models.flavors import get_flavor
    from tandem.parallel.mesh import Degrees, build_mesh
    from tandem.rl.algorithms import AGGREGATIONS, POLICY_LOSSES, PolicyLossConfig, make_norm
    from tandem.rl.core.modeling import BuildSpec
    from tandem.rl.rollout.types import RolloutSample
    from tandem.rl.update.loss import LossInputs, LossSpec, completion_tensors
    from tandem.rl.update.policy import FlatPolicy

    cpu, cp = torch.device("cpu"), dist.get_world_size()
    model = get_flavor("debug-qwen3").replace(max_position_embeddings=tokens)
    mesh = build_mesh(Degrees(cp=cp), cpu)
    policy = FlatPolicy(model, mesh, cpu, path=None, seed=0, spec=BuildSpec(),
                        is_main=dist.get_rank() == 0, micro_batch_tokens=tokens // cp,
                        chunk_tokens=1024, cp_style=style)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    n = tokens - 64 + 1  # the row: 64 prompt tokens and n - 1 completion inputs
    prompt = torch.randint(1, 500, (64,), generator=g).tolist()
    sample = RolloutSample(group=0, prompt_ids=prompt,
                           completion_ids=torch.randint(1, 500, (n,), generator=g).tolist(),
                           loss_mask=[True] * n, gen_logprobs=[-6.0] * n, finish_reason="length",
                           text="", row={})  # fmt: skip
    mask, gen, width = completion_tensors([sample], cpu)
    adv = torch.randn(mask.shape, generator=g) * mask
    inp = LossInputs(mask=mask, old_logp=None, advantages=adv, gen_logp=gen, ref_logp=None,
                     seen_logp=torch.zeros_like(mask))  # fmt: skip
    spec = LossSpec(policy_loss=POLICY_LOSSES.get("ppo_clip"), policy_cfg=PolicyLossConfig(),
                    aggregation=AGGREGATIONS.get("token_mean"), kl_estimator=None, kl_coef=0.0,
                    entropy_coef=0.0)  # fmt: skip
    norm = make_norm(mask)
    policy.train()

    def step() -> float:
        for p in policy.parameters():
            p.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        policy.accumulate([sample], [0], inp, spec, norm, width)
        dist.barrier()
        return time.perf_counter() - t0

    return policy, sample, step


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from tandem.parallel.distributed import init_distributed
    from tandem.rl.update.loss import token_logprobs
    from tests.parallel.cp_worker import saved_bytes

    torch.set_num_threads(1)
    init_distributed(force_cpu=True)
    policy, sample, step = _update_step(args.tokens, args.style)
    step()  # warm-up
    (mb,) = policy.micro_batches([sample], [0])
    saved = saved_bytes(lambda: token_logprobs(policy.model, mb, with_entropy=True,
                                               chunk_tokens=1024, cp=policy.split))  # fmt: skip
    mode = _peak_live()
    with mode:
        step()
    peak = mode.peak
    times = [step() for _ in range(args.repeats)]  # timed without the mode's bookkeeping
    out = torch.tensor([saved, peak, statistics.median(times), mb.tokens.numel()],
                       dtype=torch.float64)  # fmt: skip
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        keys = ("saved", "peak", "step_s", "row")
        Path(args.out).write_text(json.dumps(dict(zip(keys, out.tolist()))))
    dist.destroy_process_group()


def _launch(tokens: int, cp: int, style: str, repeats: int, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={cp}",
            str(Path(__file__).resolve()),
            "--worker",
            "--tokens",
            str(tokens),
            "--style",
            style,
            "--repeats",
            str(repeats),
            "--out",
            str(out),
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        try:
            r = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s"}
        if r.returncode != 0 or not out.exists():
            tail = (r.stderr or r.stdout).strip().splitlines()
            return {"error": f"exit {r.returncode}: {tail[-1] if tail else ''}"[:120]}
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tokens", default="8192,16384,32768", help="sequence lengths, comma-separated"
    )
    ap.add_argument("--cp", default="1,2,4", help="cp degrees, comma-separated")
    ap.add_argument("--styles", default="ulysses,ring")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per launch")
    ap.add_argument("--smoke", action="store_true", help="1024 tokens, cp 1 and 2, one repeat")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--style", default="ulysses", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.tokens = int(args.tokens)
        return _worker(args)
    if args.smoke:
        args.tokens, args.cp, args.repeats = "1024", "1,2", 1
    from bench.header import print_header

    print_header("bench.context_parallel")
    print(
        f"{'tokens':>7} {'cp':>3} {'style':>8} {'saved MB':>9} {'peak MB':>9} {'step s':>8} "
        f"{'saved ratio':>12} {'peak ratio':>11} {'time ratio':>11}",
        flush=True,
    )
    for tokens in (int(t) for t in args.tokens.split(",")):
        ref = None
        for cp in (int(c) for c in args.cp.split(",")):
            for style in args.styles.split(",") if cp > 1 else ["-"]:
                r = _launch(tokens, cp, style if cp > 1 else "ulysses", args.repeats, args.timeout)
                if "error" in r:
                    print(f"{tokens:>7} {cp:>3} {style:>8}  {r['error']}", flush=True)
                    continue
                ref = r if cp == 1 else ref
                ratios = (
                    ("", "", "")
                    if ref is None
                    else (
                        f"{ref['saved'] / r['saved']:.2f}x",
                        f"{ref['peak'] / r['peak']:.2f}x",
                        f"{ref['step_s'] / r['step_s']:.2f}x",
                    )
                )
                mb = (r["saved"] / 2**20, r["peak"] / 2**20)
                print(
                    f"{tokens:>7} {cp:>3} {style:>8} {mb[0]:>9.1f} {mb[1]:>9.1f} "
                    f"{r['step_s']:>8.2f} {ratios[0]:>12} {ratios[1]:>11} {ratios[2]:>11}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
