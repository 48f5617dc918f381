"""Config sections of the rollout-then-update recipes: [rl], [rollout], [reward].

Algorithm pieces are registry names (tandem/rl/algorithms); validation checks them
against the registries, so a typo names the nearest registered piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from tandem.rl.algorithms.policy_loss import PolicyLossConfig
from tandem.rl.core.configlib import SECRET, ConfigError, is_loopback, require


def check_addresses(key: str, addresses: list[str]) -> None:
    """ConfigError naming ``key`` unless every entry is ``host:port`` (a port in [1, 65535])."""
    for a in addresses:
        host, _, port = a.rpartition(":")
        require(
            bool(host) and port.isdigit() and 1 <= int(port) <= 65535,
            f"{key}: {a!r} is not host:port",
        )
    import os

    require(
        not addresses or bool(os.environ.get("TANDEM_ENVD_TOKEN")),
        f"{key}: set TANDEM_ENVD_TOKEN to the token the tandem-envd services were started with",
    )


def _check_name(key: str, registry_path: str, name: str) -> None:
    import importlib

    module, attr = registry_path.rsplit(".", 1)
    registry = getattr(importlib.import_module(module), attr)
    if name not in registry:
        raise ConfigError(f"{key}: {registry.unknown_message(name)}")


@dataclass
class RLConfig(PolicyLossConfig):
    """What one RL step does: group size, advantage, loss, KL, filters, update schedule.

    The policy loss's clip and importance-sampling keys are `PolicyLossConfig`'s
    (tandem/rl/algorithms/policy_loss.py), defined and checked there; the losses take this
    section as their config."""

    num_samples: int = 8  # completions per prompt (the GRPO group)
    prompts_per_step: int = 16  # prompts per step, global over data-parallel ranks
    advantage: str = "grpo"  # tandem/rl/algorithms/advantages.py: grpo, dr_grpo, rloo,
    # reinforce_pp, gae
    norm_by_std: bool = True  # grpo: divide by the group std
    gamma: float = 1.0  # discount of later token rewards (reinforce_pp, gae), in [0, 1]
    lam: float = 1.0  # gae: GAE's lambda, in [0, 1]
    policy_loss: str = "ppo_clip"  # tandem/rl/algorithms/policy_loss.py: ppo_clip, gspo, reinforce
    aggregation: str = "token_mean"  # tandem/rl/algorithms/aggregation.py
    loss_constant: float | None = None  # seq_mean_token_sum_norm (Dr. GRPO); default
    # rollout.max_tokens
    kl_coef: float = 0.0  # 0 = no reference model
    kl_estimator: str = "k3"  # k1, k2, k3
    kl_mode: Literal["loss", "reward"] = "loss"  # loss: kl_coef x the estimator added to the loss;
    # reward: subtracted from each token's reward before the advantages
    entropy_coef: float = 0.0  # entropy bonus: the loss minus entropy_coef x each token's entropy;
    # 0 = off
    tis_cap: float | None = 2.0  # C: the importance weight's cap (tis truncates at it, mis drops
    # tokens above it, decoupled truncates at it; none: no cap, decoupled only)
    offpolicy_correction: str = "tis"  # how the behaviour policy (the generator's log-probs) is
    # corrected for: none, tis, mis, decoupled, m2po (tandem/rl/algorithms/offpolicy.py)
    offpolicy_level: Literal["token", "sequence"] = "token"  # tis, mis: one importance ratio
    # per token, or the product over each sequence's tokens
    proximal: Literal["recompute", "loglinear"] = "recompute"  # decoupled, m2po: the proximal
    # policy's log-probs recomputed before the update, or interpolated by versions (no forward)
    m2_threshold: float = 0.04  # m2po: tokens with the largest (prox - behav)^2 are dropped
    # until the mean of the rest is below this
    exact: bool = False  # batch-invariant kernels in rollout and update
    # (tandem/kernels/batch_invariant.py): sampled tokens' log-probs equal the update's
    # recomputation bit for bit; CPU, parallel.tp = pp = 1 so far
    quantize_update: bool = False  # with rollout.weight_dtype: the update's forward multiplies
    # by the same low-bit weights the generator holds (fake-quant, straight-through gradient), so
    # rl.exact keeps the train/generation gap at 0 (docs/low-precision.md)
    max_mismatch_kl: float | None = None  # stop the run (exit 12) when the mean of gap/k3 (the
    # k3 KL between the generator's and the update's log-probs of the sampled tokens) over the
    # last rl.mismatch_window steps exceeds this; none: never
    mismatch_window: int = 20  # rl.max_mismatch_kl: steps per window mean
    epochs: int = 1  # passes over each rollout batch
    minibatches: int = 1  # optimizer steps per epoch
    micro_batch_tokens: int = 4096  # tokens per packed micro-batch (per rank)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    max_refill_rounds: int = 3  # dynamic_sampling: a step drops at most this many times
    # rl.prompts_per_step groups (the first to fail, in prompt-stream order) and trains the later
    # ones; the synchronous schedule refills in rounds until the step's groups are kept
    overlong_filter: bool = False  # mask out truncated completions
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N tokens; 0 = off
    overlong_penalty: float = 1.0  # the overlong_buffer penalty's size: 0 at max_tokens -
    # overlong_buffer tokens, -overlong_penalty at max_tokens
    offload_optimizer: bool = False  # move optimizer state to CPU during rollout
    eval_prompts: int = 64  # held-out prompts per evaluation
    eval_samples: int = 4  # completions per held-out prompt, sampled like the rollout; 0 = one
    # greedy completion

    def validate(self) -> None:
        for key in (
            "num_samples",
            "prompts_per_step",
            "mismatch_window",
            "epochs",
            "minibatches",
            "micro_batch_tokens",
            "eval_prompts",
        ):
            require(getattr(self, key) >= 1, f"rl.{key}: must be >= 1, got {getattr(self, key)}")
        require(
            self.eval_samples >= 0,
            f"rl.eval_samples: must be >= 0 (0 = one greedy completion), got {self.eval_samples}",
        )
        require(self.kl_coef >= 0, f"rl.kl_coef: must be >= 0, got {self.kl_coef}")
        require(
            self.max_mismatch_kl is None or self.max_mismatch_kl >= 0,
            f"rl.max_mismatch_kl: must be >= 0, got {self.max_mismatch_kl}",
        )
        require(
            self.tis_cap is None or self.tis_cap > 0, f"rl.tis_cap: must be > 0, got {self.tis_cap}"
        )
        require(self.m2_threshold > 0, f"rl.m2_threshold: must be > 0, got {self.m2_threshold}")
        _check_name(
            "rl.offpolicy_correction",
            "tandem.rl.algorithms.OFFPOLICY_CORRECTIONS",
            self.offpolicy_correction,
        )
        self._check_correction_keys()
        _check_name("rl.advantage", "tandem.rl.algorithms.ADVANTAGES", self.advantage)
        _check_name("rl.policy_loss", "tandem.rl.algorithms.POLICY_LOSSES", self.policy_loss)
        _check_name("rl.aggregation", "tandem.rl.algorithms.AGGREGATIONS", self.aggregation)
        _check_name("rl.kl_estimator", "tandem.rl.algorithms.KL_ESTIMATORS", self.kl_estimator)
        from tandem.rl.algorithms import ADVANTAGES

        require(
            self.num_samples >= 2 or not ADVANTAGES.cap(self.advantage, "group_relative", False),
            f"rl.num_samples: {self.num_samples} completion per prompt under rl.advantage = "
            f"{self.advantage!r}, which compares the completions of a prompt: every advantage "
            "would be 0 and nothing learned; set rl.num_samples >= 2 or a per-sample advantage "
            "(reinforce_pp, gae)",
        )
        super().validate()
        self._check_clip_keys()

    def _check_clip_keys(self) -> None:
        """A clip setting the chosen policy loss does not read is an error, not a silent no-op."""
        from tandem.rl.algorithms import POLICY_LOSSES

        uses = POLICY_LOSSES.cap(self.policy_loss, "uses", ())
        default = PolicyLossConfig()
        for key in (f.name for f in fields(PolicyLossConfig) if f.name != "tis_cap"):  # all read it
            if key not in uses and getattr(self, key) != getattr(default, key):
                reads = ", ".join(f"rl.{k}" for k in uses) or "no clip setting"
                raise ConfigError(
                    f"rl.{key}: not used by rl.policy_loss = {self.policy_loss!r} "
                    f"(it reads {reads})"
                )

    def _check_correction_keys(self) -> None:
        """A correction setting the chosen correction does not read is an error, and tis / mis
        need their cap."""
        from tandem.rl.algorithms import OFFPOLICY_CORRECTIONS

        name = self.offpolicy_correction
        uses = OFFPOLICY_CORRECTIONS.cap(name, "uses", ())
        default = RLConfig()
        for key in ("tis_cap", "offpolicy_level", "proximal", "m2_threshold"):
            if key not in uses and getattr(self, key) != getattr(default, key):
                reads = ", ".join(f"rl.{k}" for k in uses) or "no other setting"
                raise ConfigError(
                    f"rl.{key}: not used by rl.offpolicy_correction = {name!r} (it reads {reads})"
                )
        require(
            self.tis_cap is not None or not OFFPOLICY_CORRECTIONS.cap(name, "needs_cap", False),
            f"rl.tis_cap: none, but rl.offpolicy_correction = {name!r} needs a cap "
            "(set rl.offpolicy_correction = 'none' for no correction)",
        )

    def correction_config(self):  # -> tandem.rl.algorithms.CorrectionConfig (imported lazily)
        from tandem.rl.algorithms import CorrectionConfig

        return CorrectionConfig(
            cap=self.tis_cap,
            level=self.offpolicy_level,
            proximal=self.proximal,
            m2_threshold=self.m2_threshold,
        )


@dataclass
class RolloutConfig:
    """Sampling settings and the in-house generator's sizes."""

    temperature: float = 1.0  # sampling temperature; 0 = greedy
    top_p: float = 1.0  # nucleus: sample among the fewest tokens holding this probability; 1 = off
    top_k: int = 0  # sample among the k most likely tokens; 0 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0 = off
    max_tokens: int = 256  # new tokens per completion
    stop: list[str] = field(default_factory=list)  # stop strings (EOS ids always stop)
    block_size: int = 16  # KV block size (tokens)
    kv_cache_gb: float = 1.0  # KV pool budget per generator, carved at rollout start: as many
    # blocks as fit, at most what max_num_seqs full-length sequences need; off CUDA in fp32, decode
    # steps also keep contiguous K/V rows of at most the pool's size
    max_num_seqs: int = 256  # sequences one generator runs at once (its KV pool is sized for at
    # most this many)
    max_num_batched_tokens: int = 4096  # chunked-prefill token budget per step
    prefix_sharing: bool = True  # the n samples of a prompt share its KV blocks
    cuda_graphs: bool = True  # replay captured CUDA graphs for decode steps (CUDA with the Triton
    # attention kernels; eager elsewhere)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # generation copy's dtype; auto:
    # training.mixed_precision_param on CUDA, the parameters' dtype elsewhere
    tp: int = 0  # the generation layout's tensor-parallel degree (groups of tp consecutive ranks
    # run one generator over sharded weights; independent of parallel.*); 0: auto, the smallest
    # degree within a node whose shard plus kv_cache_gb fits beside the training state (1 off CUDA)
    vocab_parallel: bool = True  # with tp > 1: the embedding and LM head are split by vocabulary
    # rows over the group (false: whole on every rank)
    cpu_onednn: bool = False  # fp32 CPU rollout copy fused, on oneDNN (faster on some CPUs only)
    weight_dtype: Literal["bf16", "fp8_block", "mxfp8", "w4a16"] = "bf16"  # the generation
    # copy's dense projections: bf16, kept in rollout.dtype (no quantization); fp8_block (e4m3,
    # 128 x 128 blocks), mxfp8 (e4m3, 32-input blocks), w4a16 (e2m1, 16-input blocks, 4 bits),
    # requantized at every refill (docs/low-precision.md)

    mode: Literal["sync", "colocated_async", "split"] = "sync"  # sync: each step samples its
    # prompts to the end, then trains; colocated_async: generation stops once a step's groups are
    # complete, the other sequences are suspended through the update and resumed; split:
    # rollout.gen_ranks ranks generate while the others train (docs/async.md)
    gen_ranks: int = 0  # split mode: the first gen_ranks ranks generate, the rest train (0 with
    # the other modes)
    max_staleness: int = 0  # S: a sample trains at most S policy versions after its first
    # token was sampled (0: synchronous); a prompt group starts only if it can train within S
    suspended_kv: Literal["keep", "offload", "recompute"] = "keep"  # colocated_async: a
    # suspended sequence's KV stays in device memory through the update (keep), goes to host
    # memory and back (offload), or is freed and recomputed with the new weights (recompute)
    # FP8 KV pool (docs/low-precision.md)
    kv_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = "auto"  # KV pool entries: auto, the
    # generation dtype; fp8_*: one byte each, so kv_cache_gb holds about twice the sequences
    # of bf16 (four times fp32's)
    kv_scales: Literal["calibrated", "per_token"] = "calibrated"  # fp8 kv_dtype: one power-of-two
    # scale per (layer, KV head) from the trainer's forward after each update (calibrated),
    # or one per token and KV head from the entry itself as it is written (per_token)
    kv_scale_decay: float = 0.9  # calibrated scales: the amax high-water mark is
    # max(decay x the previous one, the new calibration's amax)
    kv_calibration_tokens: int = 4096  # calibrated scales: tokens per rank of the step's
    # samples (prompt + completion) that the calibration forward reads after each update
    kv_quantize_update: bool = True  # fp8 kv_dtype: the update's (and the reference's)
    # attention rounds K and V as the pool does, with the rollout's scales, so its log-probs
    # match the rollout's

    def validate(self) -> None:
        require(self.temperature >= 0, f"rollout.temperature: must be >= 0, got {self.temperature}")
        require(0 < self.top_p <= 1, f"rollout.top_p: must be in (0, 1], got {self.top_p}")
        require(self.top_k >= 0, f"rollout.top_k: must be >= 0, got {self.top_k}")
        require(0 <= self.min_p < 1, f"rollout.min_p: must be in [0, 1), got {self.min_p}")
        require(self.max_tokens >= 1, f"rollout.max_tokens: must be >= 1, got {self.max_tokens}")
        require(self.block_size >= 1, f"rollout.block_size: must be >= 1, got {self.block_size}")
        require(self.kv_cache_gb > 0, f"rollout.kv_cache_gb: must be > 0, got {self.kv_cache_gb}")
        require(
            self.max_num_seqs >= 1, f"rollout.max_num_seqs: must be >= 1, got {self.max_num_seqs}"
        )
        require(
            self.max_num_batched_tokens >= 1,
            f"rollout.max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}",
        )
        require(all(self.stop), f"rollout.stop: stop strings must not be empty, got {self.stop}")
        require(self.tp >= 0, f"rollout.tp: must be >= 0 (0 = auto), got {self.tp}")
        require(
            self.max_staleness >= 0,
            f"rollout.max_staleness: must be >= 0, got {self.max_staleness}",
        )
        require(
            self.max_staleness == 0 or self.mode != "sync",
            f"rollout.max_staleness: {self.max_staleness} needs rollout.mode = "
            "'colocated_async' or 'split' (a synchronous step trains every sample at the "
            "version that sampled it)",
        )
        require(self.gen_ranks >= 0, f"rollout.gen_ranks: must be >= 0, got {self.gen_ranks}")
        require(
            (self.gen_ranks > 0) == (self.mode == "split"),
            f"rollout.gen_ranks: {self.gen_ranks} with rollout.mode = {self.mode!r} (split "
            "mode needs gen_ranks >= 1; the other modes generate on every rank: 0)",
        )
        require(
            0 <= self.kv_scale_decay <= 1,
            f"rollout.kv_scale_decay: must be in [0, 1], got {self.kv_scale_decay}",
        )
        require(
            self.kv_calibration_tokens >= 1,
            f"rollout.kv_calibration_tokens: must be >= 1, got {self.kv_calibration_tokens}",
        )

    def check_kv_budget(self, args: Any, dtype: str) -> None:
        """ConfigError unless the KV pool holds at least one block of the model ``args``
        (ModelArgs) in ``dtype``."""
        import torch

        from tandem.rl.generator.kv_cache import KVCache

        fmt = self.kv_quant_format()
        per_block = KVCache.bytes_per_block(args, self.block_size, getattr(torch, dtype), fmt)
        what = dtype if self.kv_dtype == "auto" else self.kv_dtype
        require(
            self.kv_cache_gb * 1e9 >= per_block,
            f"rollout.kv_cache_gb: {self.kv_cache_gb} GB holds no KV block of this model "
            f"(one block of {self.block_size} tokens takes {per_block / 1e9:.3g} GB "
            f"in {what}); raise it",
        )

    def kv_quant_format(self) -> Any:
        """The pool's FP8 format for sizing (tandem/rl/generator/kv_cache.py KVQuant, without
        scales), or None."""
        if self.kv_dtype == "auto":
            return None
        from tandem.kernels.kv_quant import storage_dtype
        from tandem.rl.generator.kv_cache import KVQuant

        per_token = self.kv_scales == "per_token"
        return KVQuant(storage_dtype(self.kv_dtype), per_token=per_token)


@dataclass
class RewardConfig:
    """Reward functions (tandem/rl/rewards registry), their weights, and the CPU worker pool."""

    functions: list[str] = field(default_factory=lambda: ["math"])  # names in the tandem/rl/rewards
    # registry, summed with reward.weights
    modules: list[str] = field(default_factory=list)  # your modules that @register_reward more
    # functions
    weights: list[float] = field(default_factory=list)  # default: 1.0 each
    kwargs: dict[str, Any] = field(default_factory=dict)  # per function, its keyword settings (a
    # TOML table each), e.g. [reward.kwargs.by_source] routes = {"my/source" = "math"}
    num_workers: int = 2  # 0 = score in the trainer process
    workers: list[str] = field(default_factory=list)  # tandem-envd services ("host:port") that
    # score instead of local processes (token: $TANDEM_ENVD_TOKEN); [] = local
    timeout_s: float = 10.0  # per call; a timeout scores 0 and is counted
    memory_mb: int = 2048  # per reward worker (soft RLIMIT_DATA); a call past it scores 0 as an
    # error; 0 = no cap
    reward_model: str | None = None  # a reward_model recipe's output folder, scored on the rollout
    # ranks
    reward_model_weight: float = 1.0  # its weight in the total, beside the functions

    def validate(self) -> None:
        require(
            not self.weights or len(self.weights) == len(self.functions),
            f"reward.weights: {len(self.weights)} weights for {len(self.functions)} functions",
        )
        require(self.num_workers >= 0, f"reward.num_workers: must be >= 0, got {self.num_workers}")
        check_addresses("reward.workers", self.workers)
        require(self.timeout_s > 0, f"reward.timeout_s: must be > 0, got {self.timeout_s}")
        require(
            self.memory_mb >= 0,
            f"reward.memory_mb: must be >= 0 (0 = no cap), got {self.memory_mb}",
        )
        import importlib

        import tandem.rl.rewards  # noqa: F401  (registers the built-in reward functions)

        for mod in self.modules:
            try:
                importlib.import_module(mod)
            except ImportError as e:
                raise ConfigError(f"reward.modules: cannot import {mod!r}: {e}") from None

        for name in self.functions:
            _check_name("reward.functions", "tandem.rl.rewards.registry.REWARDS", name)
        from tandem.rl.rewards.registry import get_reward

        for name, kw in self.kwargs.items():
            require(
                name in self.functions,
                f"reward.kwargs.{name}: {name!r} is not in reward.functions {self.functions}",
            )
            require(
                isinstance(kw, dict),
                f"reward.kwargs.{name}: expected a table of settings, got {kw!r}",
            )
            try:
                get_reward(name, **kw)
            except TypeError as e:
                raise ConfigError(f"reward.kwargs.{name}: {e}") from None


@dataclass
class CriticConfig:
    """PPO's value model (used when rl.advantage = "gae"): same architecture and mesh as
    the policy."""

    path: str | None = None  # HF folder (policy or reward model); default: the policy's starting
    # weights
    lr: float = 1e-5  # the critic's own AdamW learning rate (betas, eps, weight decay from
    # [optimizer])
    value_clip: float | None = 0.2  # clip the new value within this of the old; none = unclipped
    # loss
    coef: float = 1.0  # scale of the value loss (the critic has its own optimizer)
    warmup_steps: int = 0  # RL steps at the start where only the critic learns

    def validate(self) -> None:
        require(self.lr > 0, f"critic.lr: must be > 0, got {self.lr}")
        require(
            self.value_clip is None or self.value_clip > 0,
            f"critic.value_clip: must be > 0, got {self.value_clip}",
        )
        require(self.coef > 0, f"critic.coef: must be > 0, got {self.coef}")
        require(
            self.warmup_steps >= 0, f"critic.warmup_steps: must be >= 0, got {self.warmup_steps}"
        )


@dataclass
class DistillConfig:
    """On-policy distillation: teachers score the student's samples; the sampled reverse KL is
    the signal.

    One teacher is OPD; several are multi-teacher OPD, each prompt routed to the
    teacher named by its ``route_field`` value (``names[i]`` names ``teachers[i]``).
    A teacher may have another tokenizer: it renders the prompt with its own chat
    template, re-encodes the completion, and the reverse KL is taken over the
    chunks both tokenizations share (docs/guide.md).
    """

    teachers: list[str] = field(default_factory=list)  # HF folders (any tokenizer); empty = off
    names: list[str] = field(default_factory=list)  # route values, one per teacher; default: folder
    # names
    route_field: str | None = None  # data field naming each prompt's teacher (needed with several)
    coef: float = 1.0  # weight of the distillation advantage
    reward_weight: float = 0.0  # weight of the reward advantage (rl.advantage) added to it; 0 =
    # pure OPD

    def validate(self) -> None:
        if not self.teachers:
            return
        require(
            not self.names or len(self.names) == len(self.teachers),
            f"distill.names: {len(self.names)} names for {len(self.teachers)} teachers",
        )
        require(
            len(self.teachers) == 1 or self.route_field is not None,
            f"distill.route_field: {len(self.teachers)} teachers need a data field that routes "
            "each prompt",
        )
        require(
            len(set(self.teacher_names())) == len(self.teachers),
            "distill.names: teacher names must be distinct",
        )

    def teacher_names(self) -> list[str]:
        import os

        return list(self.names) or [os.path.basename(os.path.normpath(t)) for t in self.teachers]


@dataclass
class EnvConfig:
    """Multi-turn (agentic) rollouts: each sample is an episode against a registered environment.

    The policy's turns are sampled; the environment's replies (tool results,
    test output) join the context with no loss; the episode's final reward is
    added to the score (next to any ``reward.functions``). See tandem/rl/rollout/agentic.py.
    """

    name: str | None = None  # tandem/rl/envs: "tool" (python + calculator, scored answer) or "code"
    # (hidden unit tests); none = single turn
    kind: Literal["local", "http"] = "local"  # http: a harness plays episodes (docs/serving.md)
    host: str = "127.0.0.1"  # http: address to bind (not loopback: needs a key)
    port: int = 8000  # http: the endpoint's port
    api_key: str | None = field(default=None, metadata=SECRET)  # http: bearer key; none:
    # $TANDEM_API_KEY, else no key (a secret: never written to config.toml or a logger)
    episode_timeout_s: float = 300.0  # http: open this long after its claim: dropped
    claim_timeout_s: float = 0.0  # http: unclaimed this long: dropped; 0 = wait
    max_request_mb: float = 4.0  # http: larger request bodies get 413
    kwargs: dict[str, Any] = field(default_factory=dict)  # the environment's settings (TOML table),
    # e.g. tools, reward
    max_turns: int = 4  # assistant turns per episode
    max_total_tokens: int = 1024  # prompt + completion (all turns) per episode
    max_turn_tokens: int | None = None  # sampled tokens per turn; none = up to rollout.max_tokens
    # in all
    num_workers: int = 2  # CPU worker processes stepping environments while the generator decodes
    # (on each generation group's first rank only)
    step_timeout_s: float = 60.0  # one environment step; past it the step is an error observation
    workers: list[str] = field(default_factory=list)  # tandem-envd services ("host:port") that
    # step the environments instead of local processes (token: $TANDEM_ENVD_TOKEN); [] = local

    def validate(self) -> None:
        if self.kind == "http":
            self._check_server()
        if self.name is None:
            return
        _check_name("env.name", "tandem.rl.envs.ENVIRONMENTS", self.name)
        from tandem.rl.envs import make_env

        try:  # bad settings fail now, not at the first rollout
            make_env(self.name, self.kwargs)
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"env.kwargs: {e}") from None
        for key in ("max_turns", "max_total_tokens"):
            require(getattr(self, key) >= 1, f"env.{key}: must be >= 1, got {getattr(self, key)}")
        require(
            self.max_turn_tokens is None or self.max_turn_tokens >= 1,
            "env.max_turn_tokens: must be >= 1",
        )
        require(self.num_workers >= 0, f"env.num_workers: must be >= 0, got {self.num_workers}")
        check_addresses("env.workers", self.workers)
        require(
            self.step_timeout_s > 0, f"env.step_timeout_s: must be > 0, got {self.step_timeout_s}"
        )

    def _check_server(self) -> None:
        require(
            self.name is None,
            f"env.name: {self.name!r} plays episodes in-process; with "
            'env.kind = "http" a harness plays them (unset env.name)',
        )
        require(
            self.episode_timeout_s > 0,
            f"env.episode_timeout_s: must be > 0, got {self.episode_timeout_s}",
        )
        require(
            self.claim_timeout_s >= 0,
            f"env.claim_timeout_s: must be >= 0 (0 = wait), got {self.claim_timeout_s}",
        )
        require(
            self.max_total_tokens >= 2,
            f"env.max_total_tokens: must be >= 2, got {self.max_total_tokens}",
        )
        require(0 <= self.port < 65536, f"env.port: must be in [0, 65536), got {self.port}")
        require(
            self.max_request_mb > 0, f"env.max_request_mb: must be > 0, got {self.max_request_mb}"
        )
        require(
            bool(self.bearer_key()) or is_loopback(self.host),
            f"env.host: {self.host!r} is not a loopback address; serving there needs a "
            "bearer key (set env.api_key or TANDEM_API_KEY)",
        )

    def bearer_key(self) -> str | None:
        """``kind = "http"``: the key requests must send (``api_key``, else $TANDEM_API_KEY)."""
        import os

        return self.api_key or os.environ.get("TANDEM_API_KEY") or None
