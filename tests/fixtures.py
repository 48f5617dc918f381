"""Shared test helpers (not tests): tiny transformers configs and HF folders on disk.

`write_hf_model` saves a random tiny transformers model with ``save_pretrained``
plus a character tokenizer, so tests get a real HF folder without downloads.
Every parameter is randomised — norms and biases included — so a wrongly mapped
or ignored norm/bias changes logits and fails the comparison.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.models.tokenizer import QWEN_CHAT_TEMPLATE, build_char_tokenizer

__all__ = [
    "FAMILIES",
    "one_thread",
    "train_run",
    "LLAMA3_STYLE_TEMPLATE",
    "QWEN_CHAT_TEMPLATE",
    "tiny_hf_config",
    "tiny_vlm_config",
    "write_hf_model",
    "write_hf_vlm",
]

FAMILIES = ("llama3", "qwen2", "qwen3", "qwen3-tied")
TINY_VOCAB = 384  # > build_char_tokenizer's ~360 ids

# A second, structurally different template (bos_token, namespace, raise_exception,
# loop controls, tojson with indent) to exercise more of the jinja environment.
LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- set ns = namespace(system='') %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set ns.system = messages[0]['content'] | trim %}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>system\\n' + ns.system }}\n"
    "{%- if tools is not none %}\n"
    "    {{- '\\nTools:\\n' }}\n"
    "    {%- for t in tools %}{{- t | tojson(indent=4) }}\n\n{% endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] == 'system' %}{% continue %}{% endif %}\n"
    "    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}\n"
    "        {{- raise_exception('unknown role ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + eos_token "
    "+ '\\n' }}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}\n"
)


def tiny_hf_config(family: str, **overrides: Any):
    """A tiny transformers config: "llama3" (llama3 rope scaling), "qwen2" (qkv bias),
    "qwen3" (qk-norm, head_dim != hidden/heads) or "qwen3-tied" (tied embeddings)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=[355, 353],
        tie_word_embeddings=False,
    )
    if family == "llama3":
        # original context 64 puts the 8 frequencies of head_dim 16 in all three llama3 regimes.
        kwargs = dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = LlamaConfig
    elif family == "qwen2":
        kwargs, cls = dict(rope_theta=1e6), Qwen2Config
    elif family in ("qwen3", "qwen3-tied"):
        kwargs = dict(rope_theta=1e6, head_dim=32, tie_word_embeddings=family == "qwen3-tied")
        cls = Qwen3Config
    else:
        raise KeyError(f"unknown family {family!r}; have {FAMILIES}")
    return cls(**{**common, **kwargs, **overrides})


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter: weights N(0, 0.05), biases N(0, 0.1), norm weights 1 + N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        else:
            p.copy_(0.05 * noise)


def write_hf_model(path: str | Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random tiny transformers model (safetensors) + char tokenizer into ``path``."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    tok = build_char_tokenizer(path)
    assert tok.vocab_size <= config.vocab_size
    return path


def tiny_vlm_config(tie: bool = False, **vision: Any):
    """A tiny transformers Qwen2.5-VL config whose token ids are `build_vl_char_tokenizer`'s: a
    Qwen2 LM (head_dim 16, M-RoPE sections 2/3/3) and a 3-block tower (block 1 full attention,
    the others in windows of 2 x 2 merged patches)."""
    from transformers import Qwen2_5_VLConfig

    from tandem.models.vl_template import VL_SPECIAL_TOKENS

    first = 360  # build_vl_char_tokenizer: the vision tokens follow the character tokenizer's ids
    ids = dict(
        zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
            range(first, first + len(VL_SPECIAL_TOKENS)),
        )
    )
    text = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=[355, 353],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
    )
    tower = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
        **vision,
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=tower, tie_word_embeddings=tie, **ids)


def write_hf_vlm(
    path: str | Path, seed: int = 0, tie: bool = False, max_pixels: int = 28 * 28 * 24
) -> Path:
    """A random tiny Qwen2.5-VL folder (transformers' save_pretrained), the vision character
    tokenizer and a preprocessor_config.json (images of at most ``max_pixels``)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tandem.models.image_processor import ImageProcessor
    from tandem.models.vl_template import IMAGE_PAD, build_vl_char_tokenizer

    path = Path(path)
    config = tiny_vlm_config(tie)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    randomize_(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    tok = build_vl_char_tokenizer(path)
    assert tok.token_to_id(IMAGE_PAD) == config.image_token_id and tok.vocab_size <= TINY_VOCAB
    ImageProcessor(max_pixels=max_pixels).save(path)
    return path


def hf_vlm_reference(path: str | Path):
    """The transformers Qwen2.5-VL model stored in ``path`` (fp32, eager attention), eval mode."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_reference(path: str | Path):
    """The transformers model stored in ``path`` (fp32, eager attention) in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture
def trainer_unaffected() -> Iterator[None]:
    """The parent (this pytest process) keeps its cwd, environment and rlimits and can still
    start processes: sandboxed runs must leave the trainer as it was."""

    def environ() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}

    cwd, env = os.getcwd(), environ()
    limits = {
        r: resource.getrlimit(r)
        for r in (
            resource.RLIMIT_CPU,
            resource.RLIMIT_AS,
            resource.RLIMIT_NPROC,
            resource.RLIMIT_FSIZE,
        )
    }
    yield
    assert os.getcwd() == cwd
    assert environ() == env
    assert {r: resource.getrlimit(r) for r in limits} == limits
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).stdout == b"1\n"


def launch_worker(
    worker: str | Path, nproc: int, out: str | Path, *args: str, timeout: float = 400
) -> Any:
    """Run a torchrun worker script on ``nproc`` CPU ranks (gloo) and load what it saved to ``out``
    (torch.save); a failing launch raises with the end of its output."""
    root = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(worker),
        "--out",
        str(out),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return torch.load(out, weights_only=False)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Two shared cores: one intra-op thread per process is several times faster than two."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def train_run(
    config: str | Path, dump: str | Path, nproc: int, *extra: str, timeout: float = 900
) -> tuple[list[dict], str]:
    """``train.py --config CONFIG`` under torchrun on ``nproc`` CPU ranks (gloo): the rows of its
    metrics.jsonl (none when a resumed run had no step left) and its output; a failing run raises
    with the end of its output."""
    import json

    root = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(root / "train.py"),
        "--config",
        str(config),
        f"--job.dump_folder={dump}",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    path = Path(dump) / "metrics.jsonl"
    rows = [json.loads(line) for line in open(path)] if path.exists() else []
    return rows, r.stdout + r.stderr


def held_out_end(out: str, start: str) -> float:
    """The end of the line "eval accuracy: start START -> end END" that a run's output holds
    (failing unless it starts at ``start``, the starting policy's figure)."""
    line = f"eval accuracy: start {start} -> end"
    assert line in out, out[-2000:]
    return float(out.split(line)[1].split()[0])


def quickstart_cmd(
    dump: str | Path,
    steps: int,
    nproc: int = 2,
    restarts: int = 4,
    config: str = "quickstart.toml",
) -> list[str]:
    """configs/``config`` shrunk for the asynchronous-mode tests (16 prompts a step, 8 eval
    prompts, rollouts dumped), under torchrun with ``restarts`` (``nproc`` 0: one process)."""
    root = Path(__file__).resolve().parents[1]
    launch = [sys.executable]
    if nproc:
        launch += [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={restarts}",
        ]
    return [
        *launch,
        str(root / "train.py"),
        "--config",
        str(root / "configs" / config),
        f"--job.dump_folder={dump}",
        f"--training.steps={steps}",
        "--rl.prompts_per_step=16",
        "--rl.eval_prompts=8",
        "--training.eval_interval=0",
        "--metrics.loggers=[]",
        "--reward.num_workers=0",
        "--checkpoint.export_hf_at_end=false",
        "--advanced.dump_rollouts=true",
    ]


def rollout_dumps(dump: str | Path, ranks: tuple[int, ...] = (0, 1)) -> list[dict]:
    """Every sample a run dumped (``advanced.dump_rollouts``) on ``ranks``, each with its rank."""
    import json

    out = []
    for rank in ranks:
        with open(os.path.join(dump, "rollouts", f"rank-{rank}.jsonl")) as f:
            out += [dict(json.loads(line), rank=rank) for line in f]
    return out


def assert_same_as_synchronous(
    sync: tuple[Path, list[dict]],
    other: tuple[Path, list[dict]],
    samples: int,
    keys: tuple[str, ...],
) -> None:
    """Two runs' (dump folder, metrics rows) sampled the same tokens with the same log-probs,
    every token of the version its step trains (``samples`` in all), and logged the same
    ``keys`` bit for bit, with nothing stale."""
    key = lambda r: (r["step"], r["rank"], r["prompt"])  # noqa: E731
    a, b = sorted(rollout_dumps(sync[0]), key=key), sorted(rollout_dumps(other[0]), key=key)
    assert len(a) == len(b) == samples
    for x, y in zip(a, b):
        assert (x["step"], x["rank"], x["prompt"], x["completion_ids"]) == (
            y["step"],
            y["rank"],
            y["prompt"],
            y["completion_ids"],
        )
        assert x["gen_logprobs"] == y["gen_logprobs"]
        assert x["versions"] == y["versions"] == [y["step"] - 1] * len(y["versions"])
    for k in keys:
        assert [r[k] for r in sync[1]] == [r[k] for r in other[1]], k
    assert all(r["async/staleness_max"] == 0 for r in other[1])


def hf_weights(dump: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF folder a run exported (``dump/hf/*.safetensors``)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(dump, "hf").glob("*.safetensors")):
        out.update(load_file(f))
    assert out, dump
    return out


def sigterm_at(p: subprocess.Popen, prefix: str, timeout: float = 600) -> str:
    """Read a run's output (``stdout`` piped as text, stderr folded in) and send it SIGTERM at
    the first line starting with ``prefix`` (a step's console line); its whole output once it
    exits (``p.returncode`` then set)."""
    import signal

    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith(prefix):
            p.send_signal(signal.SIGTERM)
    p.wait(timeout=timeout)
    return "".join(lines)


def sigint_default() -> None:
    """``preexec_fn`` for a child that a test interrupts: SIGINT back to its default, so Python
    turns it into KeyboardInterrupt even when the suite itself was started in the background by
    a non-interactive shell (which starts its jobs with SIGINT ignored, and Python then keeps
    ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def flat_checkpoint(path: str | Path) -> dict:
    """A DCP checkpoint folder as one nested dict (written beside it as ``<path>.pt``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), f"{path}.pt")
    return torch.load(f"{path}.pt", weights_only=False)


def assert_same_tree(a: Any, b: Any, key: str = "") -> None:
    """Nested dicts, lists and tensors equal, tensors bit for bit (``key``: where, on failure)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), key
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), key
        for k in a:
            assert_same_tree(a[k], b[k], f"{key}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), key
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{key}[{i}]")
    else:
        assert a == b, (key, a, b)
