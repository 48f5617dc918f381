"""The sections of the run config about how a job runs, whatever it trains: checkpoints,
fault handling, metrics, the target cluster of ``--plan`` and the ``[advanced]`` dials (the
root `Config` in tandem/rl/config/schema.py holds one of each)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Literal

from tandem.rl.core.configlib import ConfigError, require


def _known_flavors() -> list[str] | None:
    """Names in tandem.models.flavors.FLAVORS, or None while that module cannot be imported."""
    try:
        from tandem.models.flavors import FLAVORS
    except ImportError:
        return None
    return sorted(FLAVORS)


def check_flavor(key: str, name: str) -> None:
    """ConfigError naming ``key`` unless ``name`` is a known flavor (the nearest one as a hint)."""
    flavors = _known_flavors()
    if flavors is not None and name not in flavors:
        near = difflib.get_close_matches(name, flavors, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(
            f"{key}: unknown flavor {name!r}; {hint}(choose from: {', '.join(flavors)})"
        )


@dataclass
class CheckpointConfig:
    """DCP checkpoints under job.dump_folder, resume, and the final HF export."""

    enable: bool = True  # write checkpoints (every interval steps and at the end); false: none, so
    # nothing to resume
    interval: int = 50  # steps between saves (the last step always saves)
    folder: str = "checkpoints"  # relative to job.dump_folder
    keep_last: int = 2  # committed checkpoints kept; older ones are deleted after each save
    async_save: bool = False  # write in a background thread while training goes on; committed when
    # every rank is done
    model_only: bool = False  # weights + trainer state only, no optimizer state (resuming restarts
    # the optimizer)
    resume: bool = True  # resume from the newest checkpoint in folder whose files match its
    # SHA256SUMS, if any
    overwrite: bool = False  # allow starting at step 0 over an earlier run's checkpoints (resume =
    # false, or none verifies): they are deleted first; false: such a start exits 8
    export_hf_at_end: bool = True  # write an HF-format folder after the last step

    def validate(self) -> None:
        require(self.interval > 0, f"checkpoint.interval: must be > 0, got {self.interval}")
        require(self.keep_last >= 1, f"checkpoint.keep_last: must be >= 1, got {self.keep_last}")
        require(bool(self.folder.strip()), "checkpoint.folder: must not be empty")


@dataclass
class FaultConfig:
    """Hang watchdog, NaN/Inf policy and preemption (see docs/fault-tolerance.md)."""

    hang_timeout_s: float = 900.0  # no step progress for this long: dump every rank's stacks, exit
    # 6; 0 = off
    on_nonfinite: Literal["skip", "stop", "rollback"] = "stop"  # NaN/Inf loss or grad: skip the
    # step (counted), stop (exit 7), or rollback: reload the last checkpoint, skip the step's
    # prompts (ledger.jsonl, rollback.jsonl) and go on
    spike_zscore: float = 0.0  # a gradient norm this many standard deviations above the mean of
    # the last 50 steps' (at least 5) rolls back as on_nonfinite = "rollback" does; 0 = off
    max_rollbacks: int = 3  # on_nonfinite = "rollback": more rollbacks than this in one run
    # stop it (exit 7)
    flight_recorder: bool = True  # NCCL flight recorder into dump_folder/flight_recorder (CUDA
    # only)
    straggler_ratio: float = 1.5  # a rank whose own time (phase time minus collective wait) is
    # this many times the median rank's is slow; named in one line with its host; 0 = off
    straggler_steps: int = 3  # ... when the same rank is slow this many steps in a row
    preflight: bool = False  # at start-up, time a matmul and an all-reduce on every rank and
    # name the ranks over 1.5x the median matmul with their hosts (tandem-diagnose --preflight;
    # dump_folder/preflight.json); the run goes on
    replica_check_steps: int = 100  # every this many steps, compare an exact checksum of the
    # weights across HSDP replicas (parallel.dp_replicate > 1; nothing to compare otherwise);
    # a mismatch names the step, tensor and rank and exits 11; 0 = off

    def validate(self) -> None:
        require(
            self.hang_timeout_s >= 0,
            f"fault.hang_timeout_s: must be >= 0, got {self.hang_timeout_s}",
        )
        require(
            self.straggler_ratio == 0 or self.straggler_ratio > 1,
            f"fault.straggler_ratio: must be > 1 (or 0 = off), got {self.straggler_ratio}",
        )
        require(
            self.spike_zscore >= 0,
            f"fault.spike_zscore: must be >= 0 (0 = off), got {self.spike_zscore}",
        )
        require(
            self.max_rollbacks >= 0,
            f"fault.max_rollbacks: must be >= 0, got {self.max_rollbacks}",
        )
        require(
            self.replica_check_steps >= 0,
            f"fault.replica_check_steps: must be >= 0 (0 = off), got {self.replica_check_steps}",
        )
        require(
            self.straggler_steps >= 1,
            f"fault.straggler_steps: must be >= 1, got {self.straggler_steps}",
        )


@dataclass
class MetricsConfig:
    """Where and how often step metrics are written."""

    log_interval: int = 1  # steps between metric rows
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(  # besides metrics.jsonl:
        # tensorboard (job.dump_folder/tb/), wandb, mlflow (pip install tandem-rl[wandb] /
        # [mlflow]); [] for none
        default_factory=lambda: ["tensorboard"]
    )
    jsonl: bool = True  # job.dump_folder/metrics.jsonl
    samples_per_step: int = 4  # records per step kept in job.dump_folder/samples.jsonl by
    # tandem.rl.core.samples.SampleLog (read by tandem-report); 0 = off

    def validate(self) -> None:
        require(
            self.log_interval >= 1, f"metrics.log_interval: must be >= 1, got {self.log_interval}"
        )
        require(
            self.samples_per_step >= 0,
            f"metrics.samples_per_step: must be >= 0 (0 = off), got {self.samples_per_step}",
        )
        require(
            len(set(self.loggers)) == len(self.loggers),
            f"metrics.loggers: {self.loggers} names one twice",
        )
        from tandem.rl.core.loggers import missing_package

        for name in self.loggers:
            require((problem := missing_package(name)) is None, f"metrics.loggers: {problem}")


@dataclass
class PlanConfig:
    """The target cluster of ``train.py --config X --plan`` (per-rank memory of each phase; see
    tandem/rl/plan/planner.py)."""

    nodes: int = 0  # 0: one node
    devices_per_node: int = 0  # 0: the config's own layout (parallel.dp_shard = -1: this machine's
    # GPUs)
    device_memory_gb: float = 0.0  # 0: plan.device's, else this machine's GPU, else 80
    device: str | None = None  # a row of the device table (tandem/rl/plan/devices.py: h100, h200,
    # a100-80gb, mi300x; or plan.devices_file's): its memory, and its bandwidth for a decode floor
    devices_file: str | None = None  # TOML rows [NAME] memory_gb = .., bandwidth_gbs = .. added
    # to the device table (docs/devices.md)
    flavor: str | None = None  # the architecture of model.path for planning before it is downloaded
    # (a tandem/models/flavors.py name); read only when model.path has no config.json here

    def validate(self) -> None:
        for key, most in (("nodes", 100_000), ("devices_per_node", 1024)):
            # bounds: the search's size
            value = getattr(self, key)
            require(
                0 <= value <= most,
                f"plan.{key}: must be in [0, {most}] (0 = from the config), got {value}",
            )
        require(
            0 <= self.device_memory_gb <= 1e6,
            "plan.device_memory_gb: must be in [0, 1e6] (0 = this machine's GPU or 80), "
            f"got {self.device_memory_gb}",
        )
        if self.flavor is not None:
            check_flavor("plan.flavor", self.flavor)


@dataclass
class AdvancedConfig:
    """Performance and debugging settings the program picks itself; set one to measure or debug."""

    kernels: Literal["auto", "torch", "triton"] = "auto"  # every kernel of both phases (paged
    # attention, sampling noise, log-probs, grouped GEMM, rl.exact matmuls): auto = Triton on CUDA,
    # PyTorch elsewhere; triton off CUDA runs under TRITON_INTERPRET=1 only
    reshard_bucket_mb: int = 256  # moving the policy into the generation layout: at most this
    # many MB of send + receive buffers per rank at a time
    logprob_chunk_tokens: int = 1024  # completion tokens per vocabulary-projection chunk of the
    # update's log-probs (peak about 2 x chunk x vocab x 4 B on the CPU; on CUDA the Triton
    # backward's chunk x vocab in the compute dtype)
    share_prompts: bool | None = None  # rl: each prompt packed once per micro-batch, its
    # completions as branches (same gradients, fewer tokens); none = on unless parallel.pp > 1 (true
    # there is an error)
    pp_microbatches: int = 0  # micro-batches per pipeline schedule; 0 = the pp degree
    compile_decode: Literal["auto"] | bool = "auto"  # the generator's pure decode steps on the
    # CPU (PyTorch attention, fp32 pool) through one torch.compile'd step; auto = where its
    # measured saving (once per machine and model shape, cached on disk) repays the compile
    # over training.steps x rollout.max_tokens decode steps; never under rl.exact or for MoE
    dump_rollouts: bool = False  # rl: every rank appends each step's samples (prompt, completion
    # ids, generator log-probs) to job.dump_folder/rollouts/rank-N.jsonl

    def validate(self) -> None:
        for key in ("reshard_bucket_mb", "logprob_chunk_tokens"):
            value = getattr(self, key)
            require(value >= 1, f"advanced.{key}: must be >= 1, got {value}")
        require(
            self.pp_microbatches >= 0,
            f"advanced.pp_microbatches: must be >= 0 (0 = the pp degree), "
            f"got {self.pp_microbatches}",
        )
