"""What composes: the one table of feature pairs that cannot run together yet, with the reason.

Every "not with X" rule of the program is a row of `REFUSALS`; nothing else raises one. A row
is debt, not design: it names the pair, why it does not run yet, and what to set instead.
`check_composes` is the one check, called at config load (`Config.validate`) with what the
config alone tells, and again by the RL recipe once the world, the device, the model and the
resolved generation layout are known (`Facts`): a feature that cannot be told yet is unknown
(None) and its rows wait for the later call. scripts/config_reference.py renders the table into
docs/config.md as a matrix, and tests/config/test_composes.py checks every row both ways (it
refuses with its line; the same config without either feature passes).

A value the program derives is resolved as a default with its reason (`derived_rollout_tp`),
never by a check that edits the config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tandem.rl.core.configlib import ConfigError


@dataclass(frozen=True)
class Facts:
    """What a feature's test reads: the config, and what is known beyond it (None: not yet)."""

    cfg: Any
    args: Any = None  # the policy's ModelArgs (None: the model folder does not read yet)
    world: int | None = None  # ranks of the program
    device: str | None = None  # the device type of this rank ("cpu", "cuda", ...)
    rollout_tp: int | None = None  # the resolved generation tp (rollout.tp = 0: auto)
    cross_tokenizer: bool | None = None  # a distillation teacher has another tokenizer

    def but(self, **known: Any) -> Facts:
        return replace(self, **known)


@dataclass(frozen=True)
class Feature:
    """A switch of the config (``key`` names it in an error line); ``on`` says whether this run
    uses it: True, False, or None while the facts cannot tell."""

    key: str
    label: str
    on: Callable[[Facts], bool | None]
    short: str = ""  # the matrix's column heading (headline features only)


def _rl(f: Facts) -> bool:
    return f.cfg.training.recipe == "rl"


def _needs_values(f: Facts) -> bool:
    from tandem.rl.algorithms import ADVANTAGES

    return _rl(f) and bool(ADVANTAGES.cap(f.cfg.rl.advantage, "needs_values", False))


def _model(test: Callable[[Any], bool]) -> Callable[[Facts], bool | None]:
    return lambda f: None if f.args is None else bool(test(f.args))


def _generation_tp(f: Facts) -> int | None:
    """The generation tp: the resolved one, else the config's (0, auto: not known yet)."""
    return f.rollout_tp if f.rollout_tp is not None else (f.cfg.rollout.tp or None)


def _exact_device(device: str) -> bool:
    from tandem.device import capabilities

    return capabilities(device).exact


def _cut_blocks(f: Facts) -> bool | None:
    """rollout.weight_dtype's blocks cut by rollout.tp's shards (None: model or tp not known)."""
    if not _rl(f) or f.cfg.rollout.weight_dtype == "bf16":
        return False
    tp = _generation_tp(f)
    if f.args is None or tp is None or not hasattr(f.args, "num_layers"):
        return None
    from tandem.kernels.weight_quant import FORMATS
    from tandem.parallel.quant_layout import cut_block

    return cut_block(f.args, tp, FORMATS[f.cfg.rollout.weight_dtype]) is not None


def _partial_generation_group(f: Facts) -> bool | None:
    tp = f.cfg.rollout.tp
    if tp == 0:
        return False  # auto resolves to the world (`derived_rollout_tp`)
    return None if f.world is None else tp != f.world


_FEATURES: dict[str, Feature] = {
    "colocated_async": Feature(
        "rollout.mode",
        "rollout.mode = 'colocated_async'",
        lambda f: _rl(f) and f.cfg.rollout.mode == "colocated_async",
        "A",
    ),
    "split": Feature(
        "rollout.mode",
        "rollout.mode = 'split'",
        lambda f: _rl(f) and f.cfg.rollout.mode == "split",
        "S",
    ),
    "lora": Feature("lora.rank", "LoRA (lora.rank > 0)", lambda f: f.cfg.lora.enabled, "L"),
    "fp8_kv": Feature(
        "rollout.kv_dtype",
        "an FP8 KV cache (rollout.kv_dtype)",
        lambda f: _rl(f) and f.cfg.rollout.kv_dtype != "auto",
        "F",
    ),
    "cp": Feature("parallel.cp", "parallel.cp > 1", lambda f: f.cfg.parallel.cp > 1, "C"),
    "vlm": Feature("model", "a vision-language model", _model(lambda a: a.vision is not None), "V"),
    "http": Feature(
        "env.kind", 'env.kind = "http"', lambda f: _rl(f) and f.cfg.env.kind == "http", "H"
    ),
    "moe": Feature(
        "model",
        "a mixture-of-experts model",
        _model(lambda a: getattr(a, "num_experts", 0) > 0),
        "M",
    ),
    "gpt_oss": Feature(
        "model",
        "a GPT-OSS model (attention sinks, sliding windows, biased experts)",
        _model(lambda a: getattr(a, "model_type", "") == "gpt_oss"),
    ),
    "mla": Feature(
        "model",
        "a DeepSeek-V3 model (multi-head latent attention)",
        _model(lambda a: getattr(a, "model_type", "") == "deepseek_v3"),
    ),
    "qwen3_5": Feature(
        "model",
        "a Qwen3.5 model (gated DeltaNet linear-attention layers)",
        _model(lambda a: getattr(a, "linear", None) is not None),
    ),
    "tp": Feature("parallel.tp", "parallel.tp > 1", lambda f: f.cfg.parallel.tp > 1, "T"),
    "pp": Feature("parallel.pp", "parallel.pp > 1", lambda f: f.cfg.parallel.pp > 1, "P"),
    "multi_turn": Feature(
        "env.name",
        "multi-turn environments (env.name)",
        lambda f: _rl(f) and bool(f.cfg.env.name),
        "E",
    ),
    "dynamic_sampling": Feature(
        "rl.dynamic_sampling",
        "rl.dynamic_sampling",
        lambda f: _rl(f) and f.cfg.rl.dynamic_sampling,
        "D",
    ),
    "critic": Feature("rl.advantage", "a critic (rl.advantage = 'gae')", _needs_values, "K"),
    "reference": Feature(
        "rl.kl_coef",
        "a KL reference (rl.kl_coef > 0)",
        lambda f: _rl(f) and f.cfg.rl.kl_coef > 0,
        "R",
    ),
    "teachers": Feature(
        "distill.teachers",
        "distillation teachers",
        lambda f: _rl(f) and bool(f.cfg.distill.teachers),
        "O",
    ),
    "exact": Feature("rl.exact", "rl.exact", lambda f: _rl(f) and f.cfg.rl.exact, "X"),
    "ep": Feature("parallel.ep", "parallel.ep > 1", lambda f: f.cfg.parallel.ep > 1),
    "weight_quant": Feature(
        "rollout.weight_dtype",
        "low-bit generation weights (rollout.weight_dtype)",
        lambda f: _rl(f) and f.cfg.rollout.weight_dtype != "bf16",
    ),
    "cut_blocks": Feature(
        "rollout.weight_dtype",
        "a weight format whose blocks the generation shards cut",
        _cut_blocks,
    ),
    "mismatch_contract": Feature(
        "rl.max_mismatch_kl",
        "rl.max_mismatch_kl",
        lambda f: _rl(f) and f.cfg.rl.max_mismatch_kl is not None,
    ),
    "quantize_update": Feature(
        "rl.quantize_update",
        "rl.quantize_update",
        lambda f: _rl(f) and f.cfg.rl.quantize_update,
    ),
    "dp_replicate": Feature(
        "parallel.dp_replicate",
        "parallel.dp_replicate > 1",
        lambda f: f.cfg.parallel.dp_replicate > 1,
    ),
    "rollout_tp": Feature(
        "rollout.tp",
        "rollout.tp > 1",
        lambda f: _rl(f) and (_generation_tp(f) or 1) > 1,
    ),
    "partial_group": Feature(
        "rollout.tp",
        "rollout.tp below the world size",
        lambda f: _rl(f) and _partial_generation_group(f),
    ),
    "ring_cp": Feature(
        "parallel.cp_style",
        "parallel.cp_style = 'ring'",
        lambda f: f.cfg.parallel.cp > 1 and f.cfg.parallel.cp_style == "ring",
    ),
    "accelerator": Feature(
        "device",
        "a device whose row in tandem/device.py lacks the exact capability",
        lambda f: None if f.device is None else not _exact_device(f.device),
    ),
    "expert_lora": Feature(
        "lora.targets",
        "LoRA on routed experts (lora.targets has 'experts')",
        lambda f: f.cfg.lora.enabled and "experts" in f.cfg.lora.targets,
    ),
    "lora_dropout": Feature(
        "lora.dropout",
        "lora.dropout > 0",
        lambda f: f.cfg.lora.enabled and f.cfg.lora.dropout > 0,
    ),
    "xtok_teachers": Feature(
        "distill.teachers",
        "a teacher with another tokenizer",
        lambda f: f.cross_tokenizer if _rl(f) else False,
    ),
    "reward_model": Feature(
        "reward.reward_model",
        "a reward model (reward.reward_model)",
        lambda f: _rl(f) and f.cfg.reward.reward_model is not None,
    ),
    "offload_optimizer": Feature(
        "rl.offload_optimizer",
        "rl.offload_optimizer",
        lambda f: _rl(f) and f.cfg.rl.offload_optimizer,
    ),
    "share_prompts": Feature(
        "advanced.share_prompts",
        "advanced.share_prompts = true",
        lambda f: f.cfg.advanced.share_prompts is True,
    ),
    "rollback": Feature(
        "fault.on_nonfinite",
        'a rollback (fault.on_nonfinite = "rollback" or fault.spike_zscore > 0)',
        lambda f: f.cfg.fault.on_nonfinite == "rollback" or f.cfg.fault.spike_zscore > 0,
    ),
    "no_checkpoints": Feature(
        "checkpoint.enable", "checkpoint.enable = false", lambda f: not f.cfg.checkpoint.enable
    ),
    "env_workers": Feature(
        "env.workers",
        "tandem-envd environment services (env.workers)",
        lambda f: _rl(f) and bool(f.cfg.env.workers),
    ),
    "rl": Feature("training.recipe", "the rl recipe", _rl),
    "not_rl": Feature(
        "training.recipe",
        "the sft, dpo or reward_model recipe",
        lambda f: not _rl(f),
    ),
    "rm_recipe": Feature(
        "training.recipe",
        "the reward_model recipe",
        lambda f: f.cfg.training.recipe == "reward_model",
    ),
}
# headline features by their matrix letter, the others by name
FEATURES: dict[str, Feature] = {f.short or name: f for name, f in _FEATURES.items()}


@dataclass(frozen=True)
class Refusal:
    """Features ``a`` and ``b`` (names in `FEATURES`) do not run together yet, because ``why``;
    ``fix`` says what to set instead."""

    a: str
    b: str
    why: str
    fix: str

    def line(self) -> str:
        fa, fb = FEATURES[self.a], FEATURES[self.b]
        return f"{fa.key}: {fa.label} does not run with {fb.label} yet ({self.why}); {self.fix}"


_STREAMING = {  # what the streaming rollout modes do not carry yet
    "V": "an in-flight sequence does not keep its images across a refill",
    "H": "the endpoint's sessions are not versioned across weight updates",
    "rollout_tp": "sequences in flight live in one rank's KV pool with the whole model",
}
_STREAMING_FIX = 'set rollout.mode = "sync" or leave the other at its default'
_TABLE: list[tuple[str, str, str, str]] = [  # (a, the b's, why, fix): a row for each b
    *((mode, other, why, _STREAMING_FIX) for mode in "AS" for other, why in _STREAMING.items()),
    (
        "S",
        "offload_optimizer",
        "the offload frees the trainers' memory for their own rollout, and split mode's "
        "trainers run none (the generators' ranks hold no optimizer)",
        'unset it or use rollout.mode = "colocated_async"',
    ),
    (
        "X",
        "accelerator",
        "the batch-invariant kernels are validated on the CPU only (the CUDA ones, "
        "tandem/kernels/triton_batch_invariant.py, pass under the Triton interpreter but have "
        "not run on a GPU: scripts/gpu_check.sh part 'exact')",
        "set rl.exact = false",
    ),
    (
        "X",
        "T P rollout_tp",
        "a sharded matmul reduces in another order than the unsharded update",
        "set rl.exact = false or the tp / pp degree to 1",
    ),
    (
        "X",
        "ring_cp",
        "the ring's online softmax sums key blocks in another order than the generator",
        "set parallel.cp_style = 'ulysses' (bitwise equal to cp = 1)",
    ),
    (
        "T",
        "K O",
        "the critic and the teachers are built with FSDP2 (+HSDP) only",
        "set parallel.tp = 1",
    ),
    (
        "P",
        "K O",
        "the critic and the teachers are built with FSDP2 (+HSDP) only",
        "set parallel.pp = 1",
    ),
    ("not_rl", "T P", "they shard with FSDP2 only", "set parallel.tp = pp = 1"),
    (
        "expert_lora",
        "T ep",
        "tandem/parallel/lora.py does not split adapters of routed experts",
        "adapt q, k, v, o (and shared experts) instead",
    ),
    (
        "lora_dropout",
        "rl",
        "the generator samples without dropout, so the update's log-probs would not be the "
        "rollout's",
        "set lora.dropout = 0",
    ),
    (
        "H",
        "partial_group",
        "one generation group serves every episode (its leader runs the endpoint)",
        "set rollout.tp = 0 (auto: the world size)",
    ),
    (
        "C",
        "T P ep M",
        "the cp axis is built beside FSDP2 / HSDP only (and an MoE router's losses are "
        "statistics of a whole micro-batch)",
        "set parallel.cp = 1",
    ),
    (
        "F",
        "P",
        "the calibration and the update's matching rounding use packed micro-batches",
        'set rollout.kv_dtype = "auto" or parallel.pp = 1',
    ),
    (
        "V",
        "T P C rollout_tp F H L K O E reward_model rm_recipe",
        "the vision tower runs with FSDP2 in the update and on one rank's generation copy, "
        "scored by rule-based rewards",
        "use a text model or unset the other",
    ),
    (
        "M",
        "P",
        "pipeline stages do not split the experts",
        "set parallel.pp = 1; use parallel.tp or parallel.ep",
    ),
    (
        "gpt_oss",
        "F C T rollout_tp ep expert_lora",
        "sinks and sliding windows run in the training, batch-invariant and paged backends "
        "only (not the FP8-rounding or cp ones), and the tp, ep and expert-adapter code does "
        "not carry the sinks or the experts' biases",
        "unset the other",
    ),
    (
        "mla",
        "T rollout_tp L",
        "the tp plans and LoRA's q/k/v targets name the wq/wk/wv projections, which latent "
        "attention replaces by low-rank ones",
        "unset the other",
    ),
    (
        "qwen3_5",
        "F C T rollout_tp P ep expert_lora",
        "the linear-attention layers find each sequence through the training, batch-invariant and "
        "paged backends only (not the FP8-rounding or calibrating wrappers), a cp shard would cut "
        "the recurrence, the tp plans do not shard the DeltaNet projections, and pipeline stages, "
        "expert parallelism and adapters on the routed experts are not checked with them",
        "unset the other",
    ),
    (
        "share_prompts",
        "P",
        "pipeline micro-batches are fixed-length rows of one sequence",
        "leave advanced.share_prompts unset",
    ),
    (
        "rollback",
        "S",
        "only the trainers check the loss and the gradients, so the generators would wait for "
        "a reload they never hear of",
        'set fault.on_nonfinite = "stop" or "skip" and fault.spike_zscore = 0',
    ),
    (
        "rollback",
        "no_checkpoints",
        "a rollback reloads the last checkpoint",
        "set checkpoint.enable = true",
    ),
    (
        "env_workers",
        "H",
        "with the endpoint a harness plays the episodes, so no environment would step there",
        "leave env.workers empty",
    ),
    (
        "cut_blocks",
        "rollout_tp",
        "a shard is quantized alone, so its blocks would not be the whole weight's that the "
        "update rounds (fp8_block's 128 x 128 need 128 rows or inputs per rank)",
        'set rollout.tp = 1, or a format with smaller blocks ("mxfp8": 32 inputs, "w4a16": 16)',
    ),
    (
        "weight_quant",
        "S",
        "the bridge's checksum reads the generators' projections in full precision",
        'set rollout.weight_dtype = "bf16"',
    ),
    (
        "mismatch_contract",
        "S",
        "split mode's steps report no train/generation gap to hold to it",
        'unset rl.max_mismatch_kl or use rollout.mode = "colocated_async"',
    ),
    (
        "quantize_update",
        "T",
        "the update rounds whole weights, not tensor-parallel DTensor shards",
        "set parallel.tp = 1 or rl.quantize_update = false",
    ),
    (
        "xtok_teachers",
        "E",
        "a teacher with another tokenizer re-tokenises single-turn completions only",
        "use teachers with the student's tokenizer",
    ),
]
REFUSALS: list[Refusal] = [
    Refusal(a, b, why, fix) for a, bs, why, fix in _TABLE for b in bs.split()
]


def check_composes(facts: Facts) -> None:
    """The first refused pair this run uses, as one ConfigError line; nothing otherwise. A row
    with a feature the facts cannot tell yet is left for a later call."""
    memo: dict[str, bool | None] = {}

    def on(name: str) -> bool | None:
        if name not in memo:
            memo[name] = FEATURES[name].on(facts)
        return memo[name]

    for row in REFUSALS:
        if on(row.a) and on(row.b):
            raise ConfigError(row.line())


def derived_rollout_tp(cfg: Any, world: int) -> tuple[int, str] | None:
    """A generation tp the run's features fix, with the reason (None: no feature fixes it).
    ``env.kind = "http"``: one generation group serves every episode, so auto is the world."""
    if cfg.training.recipe == "rl" and cfg.env.kind == "http" and cfg.rollout.tp == 0:
        return world, 'env.kind = "http" serves every episode from one generation group'
    return None


def matrix(names: str = "A S L F C V H M T P E D K R O X") -> str:
    """The refusals among the headline features as a markdown matrix (R<n>: row n of `table`;
    ``-``: two values of one key)."""
    index = {(r.a, r.b): i for i, r in enumerate(REFUSALS, 1)}
    index.update({(r.b, r.a): i for i, r in enumerate(REFUSALS, 1)})
    cols = names.split()
    out = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for a in cols:
        cells = []
        for b in cols:
            n = index.get((a, b))
            same = FEATURES[a].key == FEATURES[b].key  # one key: a choice, not a pair
            cells.append("" if a == b else "-" if same else f"R{n}" if n else "ok")
        out.append(f"| **{a}** {FEATURES[a].label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def table() -> str:
    """Every refusal as a numbered markdown list."""
    return "".join(
        f"{i}. {FEATURES[r.a].label} x {FEATURES[r.b].label}: {r.why}; {r.fix}.\n"
        for i, r in enumerate(REFUSALS, 1)
    )
