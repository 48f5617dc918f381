"""torchrun worker for tests/rollout/test_generation_layout.py.

``torchrun --standalone --nproc-per-node N tests/rollout/generation_worker.py --out F
--layouts a,b`` builds, for each named training layout, the policy
(tandem/rl/update/policy.py) from a seeded init, then for each generation degree g moves it into the
generation layout (tandem/parallel/generation_layout.py GenerationCopy) and generates: greedy
completions of fixed prompts (the group pools its ranks' prompts), then sampled ones whose
generator log-probs are compared with the policy's recomputation in the training
layout. Around the move it measures this rank's live tensor bytes (every tensor
reachable from Python, storages counted once) inside every reshard collective,
and again after the copy and its KV pool are dropped (the run's first build, which also
makes the reshard plan and the group's first object collectives, is done before the baseline).
Rank 0 writes ``{layout: {g: record}}`` plus the tokens of a plain single-process generator on
the same weights (``"reference"``) to ``F`` (torch.save).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tandem.models.args import ModelArgs  # noqa: E402
from tandem.models.transformer import Transformer  # noqa: E402
from tandem.parallel.distributed import init_distributed  # noqa: E402
from tandem.parallel.generation_layout import (  # noqa: E402
    GenerationCopy,  # noqa: E402
    make_layout,
    shard_bytes,
)
from tandem.parallel.mesh import Degrees, build_mesh, dp_rank  # noqa: E402
from tandem.rl.config.rl_schema import RolloutConfig  # noqa: E402
from tandem.rl.core.modeling import BuildSpec, full_initial_state  # noqa: E402
from tandem.rl.data.prompts import Prompt  # noqa: E402
from tandem.rl.generator.engine import GenerationSettings, Generator  # noqa: E402
from tandem.rl.generator.sequence import SamplingParams  # noqa: E402
from tandem.rl.rollout.sampling import sample_completions  # noqa: E402
from tandem.rl.update.loss import completion_tensors  # noqa: E402
from tandem.rl.update.policy import build_policy  # noqa: E402

ARGS = {
    # vocabulary 1001: uneven over 2 ranks (the padded shard); ~4.2 MB of fp32 weights
    "qwen3": ModelArgs(
        model_type="qwen3",
        vocab_size=1001,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=1e6,
    ),
    "qwen3-tied": ModelArgs(
        model_type="qwen3",
        vocab_size=1001,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    ),
}
ARGS["qwen3-moe"] = ModelArgs(
    model_type="qwen3_moe",
    vocab_size=1001,
    hidden_size=128,
    intermediate_size=384,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    norm_topk_prob=True,
)
LAYOUTS = {  # name -> (model, training degrees, [(generation tp, vocab_parallel)])
    "fsdp2": ("qwen3", Degrees(dp_shard=2), [(1, True), (2, True)]),
    "tp2": ("qwen3", Degrees(tp=2), [(1, True), (2, True), (2, False)]),
    "pp2": ("qwen3", Degrees(pp=2), [(1, True), (2, True)]),
    "tp2_tied": ("qwen3-tied", Degrees(tp=2), [(2, True)]),
    "fsdp2_tp2": ("qwen3", Degrees(dp_shard=2, tp=2), [(1, True), (2, True)]),
    # experts sharded (EP = 2)
    "fsdp2_ep2_moe": ("qwen3-moe", Degrees(dp_shard=2), [(1, True), (2, True)]),
}
BUCKET = 256 << 10
SEED = 7
PROMPTS = [[(7 * i + 3 * j) % 997 + 1 for j in range(3 + i % 5)] for i in range(8)]


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable from Python (each storage once; meta and
    wrapper tensors hold none of their own)."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance on a dead weakref.proxy raises ReferenceError
        if (
            not issubclass(type(obj), torch.Tensor)
            or isinstance(obj, DTensor)
            or obj.device.type == "meta"
        ):
            continue
        try:
            st = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        key = (st.device.type, st.data_ptr())
        if key not in seen and st.data_ptr():
            seen.add(key)
            total += st.nbytes()
    return total


class _Tok:
    eos_token_ids: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def _rollout_cfg(temperature: float) -> RolloutConfig:
    return RolloutConfig(
        temperature=temperature,
        max_tokens=10,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        prefix_sharing=True,
        cuda_graphs=False,
    )


def _prompts(dp_rank: int, dp: int) -> list[Prompt]:
    """A data-parallel replica's prompts (its TP and PP ranks hold the same samples)."""
    return [Prompt(index=i, token_ids=p, row={"id": i}) for i, p in enumerate(PROMPTS)][dp_rank::dp]


def _replica_samples(mine: list, ids: set[int]) -> list:
    """Every sample of this data-parallel replica's prompts, in one order on all its ranks."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, [(s.row["id"], j, s) for j, s in enumerate(mine)])
    return [
        s
        for i, _, s in sorted((x for part in parts for x in part), key=lambda x: x[:2])
        if i in ids
    ]


def run_layout(name: str) -> dict:
    family, degrees, gens = LAYOUTS[name]
    args, dev = ARGS[family], torch.device("cpu")
    mesh = build_mesh(degrees, dev)
    policy = build_policy(
        args,
        mesh,
        dev,
        pp_schedule="1F1B",
        pp_microbatches=0,
        seq_len=32,
        micro_batch_tokens=64,
        chunk_tokens=64,
        path=None,
        seed=SEED,
        spec=BuildSpec(ep=2 if "ep2" in name else 1),
        is_main=dist.get_rank() == 0,
    )
    policy.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for g, vocab_parallel in gens:
        layout = make_layout(g, vocab_parallel)
        copy = GenerationCopy(policy.state_module, args, layout, dev, bucket_bytes=BUCKET)
        replica = _prompts(dp_rank(mesh), degrees.dp)
        # tp, pp: the inner mesh axes
        mp, mp_rank = degrees.tp * degrees.pp, rank % (degrees.tp * degrees.pp)
        # as the recipe does: split over the model-parallel ranks, then gathered
        mine = replica[mp_rank::mp]
        # a run's first step: makes the reshard plan and the group's first object collectives (once
        # a run)
        warm = copy.build(inference=False)[0]
        sample_completions(
            warm, _Tok(), mine, 1, _rollout_cfg(0.0), seed=SEED, max_prompt_tokens=8, layout=layout
        )
        del warm
        gc.collect()
        before = live_tensor_bytes()  # what every later step's move starts from
        peaks: list[int] = []
        gen_model, metrics = copy.build(
            inference=False, probe=lambda p=peaks: p.append(live_tensor_bytes())
        )
        greedy, _ = sample_completions(
            gen_model,
            _Tok(),
            mine,
            1,
            _rollout_cfg(0.0),
            seed=SEED,
            max_prompt_tokens=8,
            layout=layout,
        )
        sampled, _ = sample_completions(
            gen_model,
            _Tok(),
            mine,
            2,
            _rollout_cfg(1.0),
            seed=SEED + layout.leader,
            max_prompt_tokens=8,
            layout=layout,
        )
        sampled = _replica_samples(sampled, {p.index for p in replica})
        del gen_model
        gc.collect()
        after = live_tensor_bytes()
        # what the rollout hands to the update stays: an MoE sample's recorded routing [C, L, k]
        # int16
        kept = sum(
            s.routing.untyped_storage().nbytes() for s in greedy + sampled if s.routing is not None
        )
        mask, gen_logp, width = completion_tensors(sampled, dev)
        update_logp = policy.logprobs(sampled, width)
        gap = ((update_logp - gen_logp).abs() * mask).max().item()
        rec = {
            "greedy": {s.row["id"]: s.completion_ids for s in greedy},
            "gap": gap,
            "over": max(peaks, default=before) - before,
            "shard": shard_bytes(args, layout, torch.float32),
            "after_minus_before": after - before,
            "samples_bytes": kept,
            "sent": metrics["reshard/sent_gb"] * 1e9,
            "collectives": metrics["reshard/collectives"],
            "seconds": metrics["reshard/seconds"],
            "buffer_peak": metrics["reshard/buffer_peak_gb"] * 1e9,
        }
        # the next degree's "before" must not hold them
        del greedy, sampled, mask, gen_logp, update_logp
        recs: list = [None] * world
        dist.all_gather_object(recs, rec)
        out[(g, vocab_parallel)] = recs
    return out


def reference(family: str) -> dict[int, list[int]]:
    """Greedy tokens of a plain generator on the whole model (the same seeded weights)."""
    args = ARGS[family]
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(full_initial_state(args, None, SEED), assign=True)
    model.tie_weights()
    model.rope.to_empty(device="cpu")
    model.reset_rope()
    model.eval()
    gen = Generator(
        model, GenerationSettings(block_size=4, num_blocks=64, max_model_len=32, kernels="torch")
    )
    comps = gen.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10))
    return {i: c[0].token_ids for i, c in enumerate(comps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    init_distributed(force_cpu=True)
    results: dict = {"layouts": {}, "reference": {}}
    for name in a.layouts.split(","):
        try:
            results["layouts"][name] = run_layout(name)
        except Exception:  # noqa: BLE001 - the test reports it
            results["layouts"][name] = {"error": traceback.format_exc()}
            raise
    if dist.get_rank() == 0:
        for family in {LAYOUTS[n][0] for n in a.layouts.split(",")}:
            results["reference"][family] = reference(family)
        torch.save(results, a.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
