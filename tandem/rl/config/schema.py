"""Tandem's run config: the root `Config`, its foundation sections, and how to load it.

A run is configured by one TOML file plus ``--section.key=value`` overrides::

    train.py --config configs/sft.toml --training.steps=10 --job.dump_folder=/tmp/run

Each section is a plain dataclass validated where it is defined (``validate``
raises `ConfigError` for cross-field checks); leaf code takes its own section,
never the root. Adding a section is one dataclass plus one field on `Config`.
Unknown sections and keys are errors that name the key and the nearest valid
one; see tandem/rl/core/configlib.py for the mechanism and the supported field types.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from tandem.rl.algorithms.preference import PreferenceConfig
from tandem.rl.config.composes import Facts, check_composes
from tandem.rl.core.configlib import (
    EXIT_CONFIG_ERROR,
    CliArgs,
    ConfigError,
    apply_override,
    apply_table,
    format_toml,
    main_guard,
    parse_cli,
    read_toml,
    require,
    split_override,
    to_dict,
    validate_fields,
)

__all__ = [
    "EXIT_CONFIG_ERROR",
    "AdvancedConfig",
    "CheckpointConfig",
    "CliArgs",
    "Config",
    "ConfigError",
    "DataConfig",
    "JobConfig",
    "LRScheduleConfig",
    "LoraConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PlanConfig",
    "PreferenceTrainConfig",
    "TrainingConfig",
    "config_from_dict",
    "config_to_dict",
    "format_config",
    "load_config",
    "main_guard",
    "parse_args",
]

from tandem.rl.config.k8s_schema import K8sConfig  # noqa: E402  (tandem-k8s render only)
from tandem.rl.config.rl_schema import (  # noqa: E402  (sections of rl recipes)
    CriticConfig,
    DistillConfig,
    EnvConfig,
    RewardConfig,
    RLConfig,
    RolloutConfig,
)
from tandem.rl.config.run_schema import (  # noqa: E402  (how a job runs, every recipe)
    AdvancedConfig,
    CheckpointConfig,
    FaultConfig,
    MetricsConfig,
    PlanConfig,
    check_flavor,
)
from tandem.rl.core.lora import LoraConfig  # noqa: E402  (the [lora] section, every recipe)

Dtype = Literal["float32", "bfloat16"]


@dataclass
class JobConfig:
    """Run identity: name, output folder, seed."""

    name: str = "tandem"  # the run's label: the start-up line, config.toml in the dump folder,
    # reports
    dump_folder: str = "outputs/run"  # metrics.jsonl, tb/, checkpoints/, HF exports
    seed: int = 0  # in [0, 2**32)

    def validate(self) -> None:
        require(bool(self.name.strip()), "job.name: must not be empty")
        require(bool(self.dump_folder.strip()), "job.dump_folder: must not be empty")
        require(0 <= self.seed < 2**32, f"job.seed: must be in [0, 2**32), got {self.seed}")
        check_writable_folder("job.dump_folder", self.dump_folder)


def check_writable_folder(key: str, path: str) -> None:
    """ConfigError unless ``path`` is a folder this process can write in, or can be made
    one (its nearest existing ancestor is a writable folder). Leaves nothing behind: the
    ancestor is tried with a folder made and removed at once, since permission bits do not
    tell (root may write anywhere, yet /proc and read-only mounts refuse new entries)."""
    here = os.path.abspath(path)
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        what = "is a file" if here == os.path.abspath(path) else f"is under {here}, a file"
        raise ConfigError(f"{key}: {path} {what}, not a folder")
    if not os.access(here, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key}: {path}: cannot write in {here} (no write permission, or a "
            "read-only file system)"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tandem-write-check-", dir=here))
    except OSError as e:
        raise ConfigError(
            f"{key}: {path}: cannot make a folder in {here} ({e.strerror or e})"
        ) from None


@dataclass
class ModelConfig:
    """Which weights to train: a from-scratch flavor or an HF folder (exactly one), and the
    tokenizer."""

    flavor: str | None = None  # a from-scratch size from tandem/models/flavors.py
    path: str | None = None  # an HF-format folder (config.json + safetensors)
    tokenizer: str | None = None  # a tokenizer folder, "builtin:char", or "builtin:vl-char" (with
    # the image tokens, for a from-scratch vision-language flavor); default: model.path
    train_vision: bool = False  # vision-language models: train the vision tower too (false: frozen,
    # only the LM trains)

    def validate(self) -> None:
        if self.flavor is not None and self.path is not None:
            raise ConfigError(
                "model: set only one of model.flavor (from scratch) and model.path (an HF folder)"
            )
        if self.flavor is None and self.path is None:
            raise ConfigError(
                "model: set model.flavor (a from-scratch size) or model.path (an HF folder)"
            )
        if self.flavor is None:
            return
        check_flavor("model.flavor", self.flavor)
        require(
            self.tokenizer is not None,
            "model.tokenizer: required with model.flavor (a tokenizer folder or 'builtin:char')",
        )


@dataclass
class DataConfig:
    """The training data file and how rows become token sequences."""

    path: str | None = None  # a .jsonl / .json / .jsonl.gz / .parquet file, or a folder of them
    # (its files in name order; not subfolders)
    format: Literal["auto", "jsonl", "parquet"] = "auto"  # auto: by file extension
    max_length: int = 2048  # tokens per sequence (and per packed row)
    pack: bool = True  # pack several sequences into one row of max_length
    shuffle: bool = True  # a new seeded permutation of the rows every epoch; false: file order
    on_bad_row: Literal["skip", "error"] = "skip"  # a row with a missing or wrong-typed field: skip
    # (counted and reported) or error (exit 3 naming file:line)
    messages_field: str = "messages"  # chat rows (sft: assistant turns trained; a "tools" list of
    # schemas is rendered by the template)
    prompt_field: str = "prompt"  # a row's prompt as plain text, read when it has no messages_field
    completion_field: str = "completion"  # sft: the text trained after a prompt_field prompt (rows
    # without messages)
    answer_field: str = "answer"  # ground truth for rule-based rewards (rl recipe)
    eval_fraction: float = 0.0  # share of rows held out for evaluation
    eval_path: str | None = None  # held-out prompts (rl recipe); synthetic:<task> uses its test
    # split
    synthetic_rows: int = 2000  # rows generated for a synthetic:<task> path

    def validate(self) -> None:
        require(self.max_length > 0, f"data.max_length: must be > 0, got {self.max_length}")
        require(
            0.0 <= self.eval_fraction < 1.0,
            f"data.eval_fraction: must be in [0, 1), got {self.eval_fraction}",
        )
        for key in ("messages_field", "prompt_field", "completion_field"):
            require(bool(getattr(self, key)), f"data.{key}: must not be empty")


@dataclass
class OptimizerConfig:
    """The optimizer and gradient clipping."""

    lr: float = 1e-5  # peak learning rate (AdamW)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's [beta1, beta2]
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    max_grad_norm: float = 1.0  # 0 disables clipping

    def validate(self) -> None:
        require(self.lr > 0, f"optimizer.lr: must be > 0, got {self.lr}")
        require(
            len(self.betas) == 2,
            f"optimizer.betas: expected 2 values [beta1, beta2], got {len(self.betas)}",
        )
        require(
            all(0.0 <= b < 1.0 for b in self.betas),
            f"optimizer.betas: each must be in [0, 1), got {self.betas}",
        )
        require(self.eps > 0, f"optimizer.eps: must be > 0, got {self.eps}")
        require(
            self.weight_decay >= 0, f"optimizer.weight_decay: must be >= 0, got {self.weight_decay}"
        )
        require(
            self.max_grad_norm >= 0,
            f"optimizer.max_grad_norm: must be >= 0 (0 disables), got {self.max_grad_norm}",
        )


@dataclass
class LRScheduleConfig:
    """Learning-rate warm-up and decay over training.steps."""

    warmup_steps: int = 0  # linear warm-up from 0 to optimizer.lr
    decay: Literal["cosine", "linear", "constant"] = "cosine"  # after the warm-up, from
    # optimizer.lr down to min_lr_ratio x lr at the last step; constant: no decay
    min_lr_ratio: float = 0.1  # final lr = min_lr_ratio * optimizer.lr

    def validate(self) -> None:
        require(
            self.warmup_steps >= 0,
            f"lr_schedule.warmup_steps: must be >= 0, got {self.warmup_steps}",
        )
        require(
            0.0 <= self.min_lr_ratio <= 1.0,
            f"lr_schedule.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}",
        )


@dataclass
class TrainingConfig:
    """Step count, batch sizes and FSDP2 mixed precision."""

    recipe: Literal["sft", "rl", "dpo", "reward_model"] = "sft"  # which trainer loop runs
    # (tandem/rl/recipes/__init__.py)
    steps: int = 100  # optimizer steps
    batch_size: int = 8  # sequences (or packed rows) per optimizer step, global over data-parallel
    # ranks
    micro_batch_size: int = 1  # per rank per forward/backward
    mixed_precision_param: Dtype = "bfloat16"  # FSDP2 compute dtype (GPU only; CPU stays float32)
    mixed_precision_reduce: Dtype = "float32"  # FSDP2 gradient reduce dtype (GPU only)
    eval_interval: int = 0  # steps between held-out evaluations (besides the start and the end); 0
    # = start and end only

    def validate(self) -> None:
        require(self.steps > 0, f"training.steps: must be > 0, got {self.steps}")
        require(
            self.eval_interval >= 0,
            f"training.eval_interval: must be >= 0, got {self.eval_interval}",
        )
        require(self.batch_size > 0, f"training.batch_size: must be > 0, got {self.batch_size}")
        require(
            self.micro_batch_size > 0,
            f"training.micro_batch_size: must be > 0, got {self.micro_batch_size}",
        )
        require(
            self.micro_batch_size <= self.batch_size,
            f"training.micro_batch_size: {self.micro_batch_size} is larger than "
            f"training.batch_size {self.batch_size}",
        )


@dataclass
class ParallelConfig:
    """Mesh degrees and per-model parallel options (checkpointing, compile, offload)."""

    dp_replicate: int = 1  # HSDP replicas
    dp_shard: int = -1  # FSDP2 shards; -1 = the rest of the world
    tp: int = 1  # tensor parallel (sequence parallel norms, vocab-parallel head); must divide the
    # heads
    pp: int = 1  # pipeline stages (layers split evenly; rl recipe only)
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "GPipe"] = "1F1B"  # Interleaved1F1B: 2 stages
    # per rank
    activation_checkpoint: Literal["none", "full", "selective"] = "none"  # per block; selective:
    # matmul/attention outputs kept, elementwise recomputed
    compile: bool = False  # torch.compile per block
    cpu_offload: bool = False  # FSDP2 CPU offload of parameters and gradients
    ep: int = 1  # expert parallelism (MoE models): experts sharded over groups of ep consecutive
    # FSDP2 ranks (ep divides dp_shard; ep < dp_shard: the groups are replicas, e.g. one per node),
    # tokens sent to them; 1 = off (FSDP2 gathers experts like any weight)
    cp: int = 1  # context parallelism: each packed row split over cp ranks (rl: each holding
    # rl.micro_batch_tokens of it; sft, dpo, reward_model: each a 1/cp share of every row);
    # with FSDP2 / HSDP, not yet tp, pp, ep or MoE (docs/long-context.md)
    cp_style: Literal["ulysses", "ring"] = "ulysses"  # ulysses: q/k/v all-to-all over heads (cp
    # divides the query heads); ring: zig-zag chunks, K/V passed around

    def validate(self) -> None:
        for key in ("dp_replicate", "tp", "pp", "ep", "cp"):
            value = getattr(self, key)
            require(value >= 1, f"parallel.{key}: must be >= 1, got {value}")
        require(
            self.dp_shard == -1 or self.dp_shard >= 1,
            f"parallel.dp_shard: must be >= 1 or -1 (the rest of the world), got {self.dp_shard}",
        )

    def resolve(self, world_size: int) -> dict[str, int]:
        """Mesh degrees {pp, dp_replicate, dp_shard, tp, cp} whose product is ``world_size``."""
        self.validate()
        fixed = self.dp_replicate * self.tp * self.pp * self.cp
        named = f"dp_replicate={self.dp_replicate} * tp={self.tp} * pp={self.pp}"
        named += f" * cp={self.cp}" if self.cp > 1 else ""
        if self.dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"parallel: world size {world_size} is not divisible by "
                    f"{named} = {fixed} (dp_shard=-1 takes the rest)"
                )
            dp_shard = world_size // fixed
        else:
            dp_shard = self.dp_shard
            if fixed * dp_shard != world_size:
                raise ConfigError(
                    f"parallel: {named} * dp_shard={dp_shard} = {fixed * dp_shard} "
                    f"does not equal the world size {world_size} (set "
                    "parallel.dp_shard=-1 to fill the rest)"
                )
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": dp_shard,
            "tp": self.tp,
            "cp": self.cp,
        }


@dataclass
class PreferenceTrainConfig(PreferenceConfig):
    """The [preference] section: pairwise recipes (dpo: DPO/IPO/SimPO; reward_model: Bradley-Terry).

    ``beta`` / ``label_smoothing`` / ``margin`` are the loss's own `PreferenceConfig`
    (tandem/rl/algorithms/preference.py), defined and checked there; the loss takes this
    section as its config. ``reference``: "precompute" scores every pair once with the initial
    policy before training (no second model in memory), "online" keeps a frozen sharded copy
    and scores each micro-batch, "none" is for reference-free losses (simpo).
    """

    loss: str = "dpo"  # a name in tandem.rl.algorithms.preference.PREFERENCE_LOSSES (dpo recipe)
    reference: Literal["precompute", "online", "none"] = "precompute"  # the dpo recipe's reference
    # log-probs: precompute (scored once before training), online (a frozen copy scores each
    # micro-batch), none (reference-free losses: simpo)
    chosen_field: str = "chosen"  # data field of the preferred reply (text or assistant messages)
    rejected_field: str = "rejected"  # data field of the dispreferred reply

    def validate(self) -> None:
        from tandem.rl.algorithms.preference import PREFERENCE_LOSSES

        require(
            self.loss in PREFERENCE_LOSSES,
            f"preference.loss: {PREFERENCE_LOSSES.unknown_message(self.loss)}",
        )
        super().validate()
        for key in ("chosen_field", "rejected_field"):
            require(bool(getattr(self, key)), f"preference.{key}: must not be empty")


@dataclass
class Config:
    """The whole run. Each field is a section; its name is the TOML table name."""

    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    preference: PreferenceTrainConfig = field(default_factory=PreferenceTrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    advanced: AdvancedConfig = field(default_factory=AdvancedConfig)
    k8s: K8sConfig = field(default_factory=K8sConfig)

    # Keys that moved or went away: setting one is an error that says what to do instead.
    MOVED = {
        "rl.eval_interval": "renamed: set training.eval_interval (every recipe's "
        "evaluation cadence)",
        "preference.eval_interval": "renamed: set training.eval_interval (every recipe's "
        "evaluation cadence)",
        "metrics.tensorboard": "moved: list the loggers in metrics.loggers (tensorboard, wandb, "
        "mlflow; [] for none)",
        "job.log_level": "removed: it was never read; the console prints one line per logged step",
        "optimizer.name": "removed: the optimizer is AdamW; it was never read",
        "model.dtype": "removed: it was never read; the GPU compute dtype is "
        "training.mixed_precision_param",
        "rl.sample_log_interval": "removed: metrics.samples_per_step samples of every step go to "
        "samples.jsonl and tensorboard",
        "rollout.num_blocks": "removed: the KV pool's blocks come from rollout.kv_cache_gb",
        "rollout.kernels": "moved: set advanced.kernels (it picks the kernels of both phases; the "
        "TANDEM_KERNELS variable is gone too)",
        "rollout.reshard_bucket_mb": "moved: set advanced.reshard_bucket_mb",
        "rl.logprob_chunk_tokens": "moved: set advanced.logprob_chunk_tokens",
        "rl.share_prompts": "moved: set advanced.share_prompts",
        "parallel.pp_microbatches": "moved: set advanced.pp_microbatches",
        "preference.gamma": "renamed: set preference.margin (SimPO's target reward margin; "
        "rl.gamma is GAE's discount)",
    }

    def validate(self) -> None:
        """Type-check every key and run every section's ``validate``.

        A warmup longer than the run is allowed on purpose: ``--training.steps=N``
        must shorten any recipe (the lr then never reaches its peak).
        """
        validate_fields(self)
        r = self.reward
        scored = r.functions or r.reward_model is not None or self.env.name is not None
        require(
            bool(scored) or self.env.kind == "http",
            "reward.functions: list at least one reward function (or set reward.reward_model, "
            'env.name or env.kind = "http")',
        )
        require(
            not (self.rl.quantize_update and self.rollout.weight_dtype == "bf16"),
            "rl.quantize_update: needs a low-bit generation copy (rollout.weight_dtype = "
            "'fp8_block', 'mxfp8' or 'w4a16'): there is nothing to round like",
        )
        args = _model_args_if_known(self.model)
        check_composes(Facts(self, args=args))
        if self.training.recipe == "rl" and args is not None:
            self.rollout.check_kv_budget(args, self._generation_dtype())

    def _generation_dtype(self) -> str:
        """rollout.dtype as tandem/rl/rollout/sampling.py resolves it (auto: the compute dtype on
        CUDA)."""
        if self.rollout.dtype != "auto":
            return self.rollout.dtype
        from tandem import device as seam

        # CPU: fp32 weights
        mixed = seam.capabilities(seam.accelerator_type()).mixed_precision
        return self.training.mixed_precision_param if mixed else "float32"


def _model_args_if_known(model: ModelConfig) -> Any:
    """The ModelArgs of model.flavor, or of model.path's config.json when it reads; else None
    (a folder that does not read fails later, when the model is built, with exit 4)."""
    from tandem.models.flavors import FLAVORS

    if model.flavor is not None:
        return FLAVORS[model.flavor]
    try:
        from tandem.models.hf import load_args

        return load_args(model.path)
    except Exception:  # noqa: BLE001  (reported with exit 4 where the model is loaded)
        return None


def _apply_overrides(cfg: Config, overrides: Sequence[str]) -> None:
    for item in overrides:
        key, value = split_override(item)
        apply_override(cfg, key, value)


def config_from_dict(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """A validated Config from nested dicts (as TOML would give), then overrides."""
    cfg = Config()
    apply_table(cfg, data)
    _apply_overrides(cfg, overrides)
    cfg.validate()
    return cfg


def load_config(path: str | None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the TOML file at ``path`` (if any), then ``overrides``, then validate.

    Each override is ``"section.key=value"`` (a leading ``--`` is allowed); a bare
    ``"section.key"`` sets a bool key to true.
    """
    cfg = Config()
    if path is not None:
        data = read_toml(path)
        try:
            apply_table(cfg, data)
        except ConfigError as err:
            raise ConfigError(f"{err} (in {path})") from None
    _apply_overrides(cfg, overrides)
    cfg.validate()
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as nested plain dicts (e.g. to log it); None values stay None."""
    return to_dict(cfg)


def format_config(cfg: Config) -> str:
    """The config as TOML text that `load_config` reads back to an equal Config."""
    return format_toml(cfg, header="Tandem config (load with --config FILE)")


USAGE = """usage: train.py [--config FILE.toml] [--print-config] [--plan] [--section.key=VALUE ...]

  --config FILE      TOML config; later --section.key=VALUE overrides win
  --print-config     print the resolved config as TOML and exit
  --plan             print each rank's memory per phase on the target cluster
                     (--plan.nodes=N --plan.devices_per_node=G --plan.device_memory_gb=M),
                     whether it fits and the smallest layout that does, and exit
                     (status 9 when it does not fit); no GPU, weights or launcher needed
  --section.key=V    override one key (also: --section.key V; a bare bool flag sets true)

sections: {sections}
"""


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, CliArgs]:
    """Parse a command line into a validated Config and the parsed options.

    ``--print-config`` and ``--help`` print to stdout and exit 0 (after a
    successful load, for ``--print-config``). Raises ConfigError for bad input.
    """
    args = parse_cli(sys.argv[1:] if argv is None else list(argv))
    if args.help:
        print(USAGE.format(sections=", ".join(f.name for f in fields(Config))), end="")
        raise SystemExit(0)
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(format_config(cfg), end="")
        raise SystemExit(0)
    return cfg, args
