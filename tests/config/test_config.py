"""Tests for tandem/rl/config/schema.py and tandem/rl/core/configlib.py: TOML + CLI overrides,
one-line errors, round trips."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from tandem.rl.config.schema import (
    EXIT_CONFIG_ERROR,
    AdvancedConfig,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    JobConfig,
    LRScheduleConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
    config_from_dict,
    config_to_dict,
    format_config,
    load_config,
    parse_args,
)
from tandem.rl.core.configlib import (
    apply_override,
    apply_table,
    format_toml,
    parse_cli,
    read_toml,
    validate_fields,
)
from tandem.rl.recipes import unused_settings

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "configs"
REPO_CONFIGS = sorted(CONFIG_DIR.glob("*.toml"))
HF = ["model.path=/models/some-hf-folder"]  # a valid model choice that needs no import


def write(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error_of(fn, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def roundtrip(cfg: Config, tmp_path: Path) -> Config:
    return load_config(write(tmp_path, format_config(cfg), "dumped.toml"))


# ------------------------------------------------------------ round trips


@pytest.fixture
def any_pair(monkeypatch):
    """Every key changed at once turns on pairs the table refuses (cp with tp, ...): a round trip
    is about values, what composes is tests/config/test_composes.py's."""
    import tandem.rl.config.schema as schema

    monkeypatch.setattr(schema, "check_composes", lambda facts: None)


def every_field_changed() -> Config:
    """A Config where every foundation key differs from its default (valid key by key; the
    table of what composes refuses some of its pairs: see `any_pair`)."""
    return Config(
        job=JobConfig(name='my "run" é\\x', dump_folder="/tmp/out dir", seed=7),
        model=ModelConfig(flavor=None, path="/hf/qwen", tokenizer="/hf/tok", train_vision=True),
        data=DataConfig(
            path="data/x.parquet",
            format="parquet",
            max_length=512,
            pack=False,
            shuffle=False,
            on_bad_row="error",
            messages_field="conv",
            prompt_field="q",
            completion_field="a",
            eval_fraction=0.25,
            answer_field="gt",
            eval_path="data/heldout.jsonl",
            synthetic_rows=10,
        ),
        optimizer=OptimizerConfig(
            lr=3e-4, betas=[0.8, 0.99], eps=1e-6, weight_decay=0.1, max_grad_norm=0.0
        ),
        lr_schedule=LRScheduleConfig(warmup_steps=5, decay="linear", min_lr_ratio=0.0),
        training=TrainingConfig(
            recipe="rl",
            steps=20,
            batch_size=16,
            micro_batch_size=4,
            mixed_precision_param="float32",
            mixed_precision_reduce="bfloat16",
            eval_interval=3,
        ),
        parallel=ParallelConfig(
            dp_replicate=2,
            dp_shard=4,
            tp=2,
            pp=2,
            pp_schedule="GPipe",
            activation_checkpoint="selective",
            compile=True,
            cpu_offload=True,
            ep=4,
            cp=2,
            cp_style="ring",
        ),
        checkpoint=CheckpointConfig(
            enable=False,
            interval=7,
            folder="ckpt",
            keep_last=5,
            resume=False,
            export_hf_at_end=False,
            async_save=True,
            model_only=True,
            overwrite=True,
        ),
        metrics=MetricsConfig(log_interval=10, loggers=[], jsonl=False, samples_per_step=2),
        advanced=AdvancedConfig(
            kernels="torch",
            reshard_bucket_mb=64,
            logprob_chunk_tokens=256,
            share_prompts=False,
            pp_microbatches=8,
            dump_rollouts=True,
            compile_decode=False,
        ),
    )


FOUNDATION = (
    "job",
    "model",
    "data",
    "optimizer",
    "lr_schedule",
    "training",
    "parallel",
    "checkpoint",
    "metrics",
    "advanced",
)


@pytest.mark.parametrize("section", FOUNDATION)
def test_every_section_roundtrips(section: str, tmp_path: Path, any_pair) -> None:
    changed = every_field_changed()
    changed.validate()
    defaults = getattr(Config(), section)
    ours = getattr(changed, section)
    unchanged = [
        f.name
        for f in dataclasses.fields(ours)
        if getattr(ours, f.name) == getattr(defaults, f.name)
    ]
    # model.flavor excludes model.path (flavor: see the next tests)
    assert unchanged == {"model": ["flavor"]}.get(section, [])
    back = roundtrip(changed, tmp_path)
    assert getattr(back, section) == ours
    assert getattr(back, section) != defaults


def test_whole_config_roundtrips_and_dict_matches(tmp_path: Path, any_pair) -> None:
    cfg = every_field_changed()
    back = roundtrip(cfg, tmp_path)
    assert back == cfg
    d = config_to_dict(back)
    assert list(d) == [f.name for f in dataclasses.fields(Config)]
    assert d["optimizer"]["betas"] == [0.8, 0.99]
    assert d["model"]["flavor"] is None and d["model"]["path"] == "/hf/qwen"
    assert d["job"]["name"] == 'my "run" é\\x'
    d["optimizer"]["betas"].append(1.0)  # a copy, not the live list
    assert back.optimizer.betas == [0.8, 0.99]
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_default_config_roundtrips_with_flavor(tmp_path: Path) -> None:
    cfg = load_config(None, ["model.flavor=debug-qwen3", "model.tokenizer=builtin:char"])
    text = format_config(cfg)
    assert "\nsteps = 100\n" in text and 'path = "none"' in text
    assert roundtrip(cfg, tmp_path) == cfg


# ------------------------------------------------------------ TOML loading


def test_toml_then_overrides_then_validate(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [model]
        path = "/hf/m"
        [training]
        steps = 30
        batch_size = 4
        [optimizer]
        lr = 1          # an int is accepted for a float key
        betas = [0.5, 0.6]
    """,
    )
    cfg = load_config(path, ["--training.steps=40"])
    assert cfg.training.steps == 40 and cfg.training.batch_size == 4
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.betas == [0.5, 0.6]
    assert cfg.data.max_length == 2048  # untouched default
    # --training.steps=N shortens any recipe, even below its warmup
    assert load_config(path, ["training.steps=2", "lr_schedule.warmup_steps=3"]).training.steps == 2


def test_toml_unknown_key_section_and_type_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[training]\nstpes = 3\n")
    msg = error_of(load_config, path, HF)
    assert "'training.stpes'" in msg and "did you mean 'training.steps'?" in msg and path in msg
    path = write(tmp_path, "[trainig]\nsteps = 3\n")
    msg = error_of(load_config, path, HF)
    assert "unknown section 'trainig'" in msg and "'training'" in msg
    path = write(tmp_path, '[training]\nsteps = "abc"\n')
    assert (
        error_of(load_config, path, HF)
        == f"training.steps: expected int, got str 'abc' (in {path})"
    )
    path = write(tmp_path, "[data]\npack = 1\n")  # no int -> bool coercion
    assert "data.pack: expected bool, got int 1" in error_of(load_config, path, HF)
    path = write(tmp_path, "training = 3\n")
    assert "training: expected a table [training]" in error_of(load_config, path, HF)
    path = write(tmp_path, '[lr_schedule]\ndecay = "exp"\n')
    msg = error_of(load_config, path, HF)
    assert "lr_schedule.decay" in msg and "'cosine', 'linear', 'constant'" in msg


def test_toml_optional_none_string(tmp_path: Path) -> None:
    path = write(tmp_path, '[model]\npath = "/hf/m"\ntokenizer = "none"\n[data]\npath = "null"\n')
    cfg = load_config(path)
    assert cfg.model.tokenizer is None and cfg.data.path is None and cfg.model.path == "/hf/m"


def test_missing_file_and_syntax_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    assert error_of(load_config, missing) == f"config file not found: {missing}"
    assert "is a folder" in error_of(load_config, str(tmp_path))
    bad = write(tmp_path, "[training]\nsteps = 3\nbatch_size = = 4\n", "bad.toml")
    msg = error_of(load_config, bad)
    assert msg.startswith(f"invalid TOML in {bad}:") and "line 3" in msg


# ------------------------------------------------------------ overrides


def test_overrides_of_each_type() -> None:
    cfg = load_config(
        None,
        HF
        + [
            "training.steps=12",  # int
            "optimizer.lr=2.5e-4",  # float
            "data.pack=no",  # bool word
            "parallel.compile",  # bare bool flag
            "checkpoint.resume=0",  # bool digit
            "optimizer.betas=0.7, 0.8",  # comma list
            "model.tokenizer=builtin:char",  # str
            "data.path=none",  # optional -> None
            "data.on_bad_row=error",  # enum
            "parallel.dp_shard=-1",
        ],
    )
    assert cfg.training.steps == 12
    assert cfg.optimizer.lr == 2.5e-4
    assert (
        cfg.data.pack is False and cfg.checkpoint.resume is False and cfg.parallel.compile is True
    )
    assert cfg.optimizer.betas == [0.7, 0.8]
    assert cfg.model.tokenizer == "builtin:char" and cfg.data.path is None
    assert cfg.data.on_bad_row == "error"
    cfg = load_config(
        None,
        HF
        + [
            "optimizer.betas=[0.1, 0.2]",
            "data.path=d.jsonl",
            "data.path=NULL",
            "job.name='none'",
            "training.steps=1_000",
        ],
    )
    assert cfg.optimizer.betas == [0.1, 0.2] and cfg.data.path is None  # last override wins
    assert cfg.job.name == "none" and cfg.training.steps == 1000  # quotes keep a literal "none"


def test_override_errors_are_one_line_with_hints() -> None:
    assert error_of(load_config, None, HF + ["training.stpes=3"]) == (
        "unknown key 'training.stpes'; did you mean 'training.steps'?"
    )
    assert "did you mean 'optimizer.lr'?" in error_of(load_config, None, HF + ["training.lr=1"])
    assert "unknown section 'trainig'; did you mean 'training'?" == error_of(
        load_config, None, ["trainig.steps=1"]
    )
    assert "valid here:" in error_of(load_config, None, ["metrics.zzzzzz=1"])
    assert (
        error_of(load_config, None, HF + ["training.steps=abc"])
        == "training.steps: expected int, got 'abc'"
    )
    assert "expected int, got '1.5'" in error_of(load_config, None, HF + ["training.steps=1.5"])
    assert "expected float" in error_of(load_config, None, HF + ["optimizer.lr=fast"])
    assert "expected bool" in error_of(load_config, None, HF + ["data.pack=maybe"])
    assert "optimizer.betas[1]: expected float, got 'x'" in error_of(
        load_config, None, HF + ["optimizer.betas=1,x"]
    )
    assert error_of(load_config, None, HF + ["data.on_bad_row=drop"]) == (
        "data.on_bad_row: 'drop' is not one of 'skip', 'error'"
    )
    assert "missing value" in error_of(load_config, None, HF + ["job.seed"])
    assert "is a section" in error_of(load_config, None, HF + ["training=3"])
    assert "not a section" in error_of(load_config, None, HF + ["training.steps.x=1"])


# ------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["optimizer.lr=0"], "optimizer.lr: must be > 0"),
        (["optimizer.betas=0.9"], "optimizer.betas: expected 2 values"),
        (["optimizer.betas=0.9,1.0"], "optimizer.betas: each must be in [0, 1)"),
        (["optimizer.max_grad_norm=-1"], "optimizer.max_grad_norm"),
        (["training.steps=0"], "training.steps: must be > 0"),
        (["training.micro_batch_size=16"], "training.micro_batch_size: 16 is larger"),
        (["data.eval_fraction=1.0"], "data.eval_fraction"),
        (["lr_schedule.min_lr_ratio=2"], "lr_schedule.min_lr_ratio"),
        (["parallel.dp_shard=0"], "parallel.dp_shard: must be >= 1 or -1"),
        (["parallel.tp=0"], "parallel.tp: must be >= 1"),
        (["checkpoint.keep_last=0"], "checkpoint.keep_last"),
        (["metrics.log_interval=0"], "metrics.log_interval"),
        (["model.flavor=tiny-qwen3"], "set only one of model.flavor"),
    ],
)
def test_section_validation(overrides: list[str], needle: str) -> None:
    assert needle in error_of(load_config, None, HF + overrides)


def test_model_choice_validation() -> None:
    assert "set model.flavor" in error_of(load_config, None, [])
    assert "model.tokenizer: required" in error_of(load_config, None, ["model.flavor=tiny-qwen3"])
    msg = error_of(load_config, None, ["model.flavor=tiny-qwen", "model.tokenizer=builtin:char"])
    assert (
        "unknown flavor 'tiny-qwen'" in msg
        and "did you mean 'tiny-qwen3'?" in msg
        and "tiny-llama3" in msg
    )


def test_validate_checks_types_of_python_built_configs() -> None:
    cfg = Config(model=ModelConfig(path="/hf"))
    cfg.training.steps = "10"  # type: ignore[assignment]
    assert error_of(cfg.validate) == "training.steps: expected int, got str '10'"
    cfg.training.steps, cfg.optimizer.betas = 10, (0.9, 0.99)  # type: ignore[assignment]
    cfg.validate()
    assert cfg.optimizer.betas == [0.9, 0.99]  # normalised to a list


def test_parallel_resolve() -> None:
    one = {"pp": 1, "dp_replicate": 1, "tp": 1, "cp": 1}
    assert ParallelConfig().resolve(8) == {**one, "dp_shard": 8}
    two = {**one, "dp_replicate": 2, "dp_shard": 2, "tp": 2}
    assert ParallelConfig(dp_replicate=2, tp=2).resolve(8) == two
    assert ParallelConfig(dp_shard=2, tp=2, pp=2).resolve(8)["dp_shard"] == 2
    assert ParallelConfig(cp=4).resolve(8)["dp_shard"] == 2
    msg = error_of(ParallelConfig(cp=3).resolve, 8)
    assert "world size 8" in msg and "cp=3" in msg
    msg = error_of(ParallelConfig(tp=3).resolve, 8)
    assert "world size 8" in msg and "tp=3" in msg
    msg = error_of(ParallelConfig(dp_shard=3, tp=2).resolve, 8)
    assert "dp_shard=3" in msg and "tp=2" in msg and "= 6 does not equal the world size 8" in msg


# ------------------------------------------------------------ command line


def test_parse_args_forms(tmp_path: Path) -> None:
    path = write(tmp_path, '[model]\npath = "/hf/m"\n[training]\nsteps = 9\n')
    cfg, args = parse_args(
        [
            "--config",
            path,
            "--training.steps",
            "11",
            "--parallel.dp_shard",
            "-1",
            "--parallel.compile",
            "--data.shuffle=false",
        ]
    )
    assert args.config == path and not args.print_config
    assert args.overrides == [
        "training.steps=11",
        "parallel.dp_shard=-1",
        "parallel.compile",
        "data.shuffle=false",
    ]
    assert cfg.training.steps == 11 and cfg.parallel.compile is True and cfg.data.shuffle is False
    cfg, args = parse_args([f"--config={path}"])
    assert cfg.training.steps == 9 and args.overrides == []


def test_parse_args_errors() -> None:
    assert "did you mean '--config'?" in error_of(parse_args, ["--conifg", "x.toml"])
    assert "unexpected argument 'stray'" in error_of(parse_args, ["stray"])
    assert "--config needs a file path" in error_of(parse_args, ["--config"])
    assert "--config given twice" in error_of(parse_cli, ["--config", "a", "--config", "b"])


def test_print_config_roundtrips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--model.path=/hf/m", "--training.steps=3", "--print-config"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    back = load_config(write(tmp_path, text))
    assert back.training.steps == 3 and back == load_config(
        None, ["model.path=/hf/m", "training.steps=3"]
    )


def test_help_lists_sections(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    assert "sections: job, model, data, optimizer, lr_schedule" in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["training.stpes=3"], "training.stpes"),
        (["--config", "/no/such/file.toml"], "/no/such/file.toml"),
    ],
)
def test_main_guard_exit_status_in_subprocess(overrides: list[str], needle: str) -> None:
    script = (
        "import sys\n"
        "from tandem.rl.config.schema import main_guard, parse_args\n"
        "main_guard(parse_args)(sys.argv[1:])\n"
        "print('unreachable')\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", script, *overrides],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )
    assert proc.returncode == EXIT_CONFIG_ERROR == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_config_error_is_one_line() -> None:
    assert str(ConfigError("a\n  b\nc")) == "a b c"


# ----------------------------------------------------------- the generic mechanism on a deeper tree


@dataclass
class Sampling:
    temperature: float = 1.0
    stop: list[str] = field(default_factory=list)
    top_k: int | None = 50


@dataclass
class Rollout:
    sampling: Sampling = field(default_factory=Sampling)
    mode: Literal["sync", "async"] = "sync"
    extra: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)


@dataclass
class Root:
    rollout: Rollout = field(default_factory=Rollout)


def test_nested_sections_and_dict_fields(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [rollout]
        mode = "async"
        extra = { a = 1, b = { c = [1, 2], "d e" = "x" } }
        weights = { math = 1, code = 0.5 }
        [rollout.sampling]
        temperature = 0.7
        stop = ["</s>", "a,b"]
        top_k = "none"
    """,
    )
    root = Root()
    apply_table(root, read_toml(path))
    assert root.rollout.extra == {"a": 1, "b": {"c": [1, 2], "d e": "x"}}
    assert root.rollout.weights == {"math": 1.0, "code": 0.5}
    assert root.rollout.sampling == Sampling(temperature=0.7, stop=["</s>", "a,b"], top_k=None)
    back = Root()
    apply_table(back, read_toml(write(tmp_path, format_toml(root), "dumped.toml")))
    assert back == root
    apply_override(root, "rollout.sampling.top_k", "7")
    apply_override(root, "rollout.sampling.stop", "x,y")
    assert root.rollout.sampling.top_k == 7 and root.rollout.sampling.stop == ["x", "y"]
    assert "set it in the TOML config file" in error_of(
        apply_override, root, "rollout.extra", "{a=1}"
    )
    assert "did you mean 'rollout.sampling.temperature'?" in error_of(
        apply_override, root, "rollout.sampling.temprature", "1"
    )
    assert "rollout.weights.code: expected float" in error_of(
        apply_table, Root(), {"rollout": {"weights": {"code": "high"}}}
    )
    validate_fields(root)


def test_glob_of_repo_configs_ran() -> None:
    assert CONFIG_DIR.is_dir(), f"expected a configs/ folder at {CONFIG_DIR}"
    assert all(p.suffix == ".toml" and p.parent == CONFIG_DIR for p in REPO_CONFIGS)


@pytest.mark.parametrize(
    "path",
    REPO_CONFIGS
    or [pytest.param(None, marks=pytest.mark.skip(reason="no configs/*.toml in the repo yet"))],
    ids=lambda p: p.name if p else "none",
)
def test_repo_config_loads_and_validates(path: Path, tmp_path: Path) -> None:
    cfg = load_config(str(path))
    assert roundtrip(cfg, tmp_path) == cfg
    # The public interface every recipe honours.
    cfg = load_config(str(path), ["--training.steps=3", f"--job.dump_folder={tmp_path}"])
    assert cfg.training.steps == 3 and cfg.job.dump_folder == str(tmp_path)


# ------------------------------------------------------------ moved keys, unread keys

QUICKSTART = str(CONFIG_DIR / "quickstart.toml")
SFT = str(CONFIG_DIR / "quickstart_sft.toml")


@pytest.mark.parametrize(
    "key,new",
    [
        ("rl.eval_interval", "training.eval_interval"),
        ("preference.eval_interval", "training.eval_interval"),
        ("model.dtype", "training.mixed_precision_param"),
        ("job.log_level", "never read"),
        ("optimizer.name", "AdamW"),
        ("rollout.num_blocks", "rollout.kv_cache_gb"),
        ("rollout.kernels", "advanced.kernels"),
        ("rollout.reshard_bucket_mb", "advanced.reshard_bucket_mb"),
        ("rl.logprob_chunk_tokens", "advanced.logprob_chunk_tokens"),
        ("rl.share_prompts", "advanced.share_prompts"),
        ("parallel.pp_microbatches", "advanced.pp_microbatches"),
        ("preference.gamma", "preference.margin"),
    ],
)
def test_moved_and_removed_keys_say_what_to_do(key, new):
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, [f"--{key}=1"])
    assert str(e.value).startswith(f"{key}: ") and new in str(e.value)


def test_keys_the_recipe_does_not_read_are_named():
    cfg = load_config(SFT, ["--rl.kl_coef=0.1", "--preference.beta=0.5", "--training.steps=3"])
    assert unused_settings(cfg) == ["rl.kl_coef", "preference.beta"]
    assert unused_settings(load_config(QUICKSTART)) == []
