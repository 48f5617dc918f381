"""Checks every newly added model family runs against its tiny random HF folder (helpers, not
tests): the folder itself, export bit for bit, the generator's greedy tokens against
transformers' ``generate``, and two steps of the RL quickstart on the folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tandem.models import load_model, read_hf_state_dict, save_hf
from tandem.models.tokenizer import build_char_tokenizer
from tests.fixtures import hf_reference, randomize_

ROOT = Path(__file__).resolve().parents[2]


def tokens(b: int, s: int, seed: int = 0) -> torch.Tensor:
    """``[b, s]`` random ids among the character tokenizer's."""
    return torch.randint(0, 360, (b, s), generator=torch.Generator().manual_seed(seed))


def assert_export_bit_exact(folder: Path, out: Path, tol: float) -> dict:
    """The folder loaded and saved to ``out``: the same tensor names, dtypes and bits; the
    export's logits by transformers within ``tol`` of ours; its config reads back to the same
    `ModelArgs` (eos ids aside). Returns the export's config.json."""
    model = load_model(folder)
    save_hf(model.state_dict(), model.args, out)
    original, exported = read_hf_state_dict(folder), read_hf_state_dict(out)
    assert sorted(original) == sorted(exported)
    for name, t in original.items():
        assert t.dtype == exported[name].dtype and torch.equal(t, exported[name]), name
    x = tokens(1, 16, seed=8)
    with torch.no_grad():
        assert (hf_reference(out)(x).logits - model(x)).abs().max() <= tol
    again = load_model(out).args
    assert again == model.args.replace(eos_token_id=again.eos_token_id)
    return json.loads((out / "config.json").read_text())


def write_random_folder(path: Path, config, seed: int) -> Path:
    """``save_pretrained`` of a transformers model of ``config`` with every parameter and
    float buffer (a router's correction bias) random, plus the character tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if b.is_floating_point() and "inv_freq" not in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    build_char_tokenizer(path)
    return path


def assert_greedy_equals_generate(folder: Path, prompts: list[list[int]], tokens: int = 10):
    """The generator (blocks of 4, a 16-token step budget: chunked prefill; two samples
    sharing each prompt's blocks) gives transformers' greedy tokens for every prompt."""
    from tandem.rl.generator.engine import GenerationSettings, Generator
    from tandem.rl.generator.sequence import SamplingParams

    ref, ours = hf_reference(folder), load_model(folder).eval()
    settings = GenerationSettings(
        block_size=4, num_blocks=128, max_num_batched_tokens=16, max_model_len=96
    )
    out = Generator(ours, settings).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), n=2
    )
    for p, group in zip(prompts, out, strict=True):
        want = ref.generate(
            torch.tensor([p]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
        )[0, len(p) :].tolist()
        assert [c.token_ids for c in group] == [want, want], p


def quickstart_two_steps(folder: Path, tmp_path: Path, *extra: str):
    """Two GRPO steps of configs/quickstart.toml on ``folder`` (1 rank, CPU; ``extra``
    overrides), rewarded by completion length so that advantages are not all zero. Returns
    the metrics rows and the folder's and the exported HF tensors."""
    text = (ROOT / "configs" / "quickstart.toml").read_text()
    assert 'functions = ["exact_match"]' in text
    config = tmp_path / "quickstart.toml"
    config.write_text(
        text.replace('functions = ["exact_match"]', 'functions = ["length_penalty"]')
        + "\n[reward.kwargs.length_penalty]\nsoft_chars = 2\nhard_chars = 12\n"
    )
    dump = tmp_path / "run"
    cmd = [
        sys.executable, "train.py", "--config", str(config), f"--model.path={folder}",
        "--training.steps=2", "--rl.prompts_per_step=4", "--rl.num_samples=4",
        "--rl.eval_prompts=4", "--training.eval_interval=0", f"--job.dump_folder={dump}",
        "--metrics.loggers=[]", "--checkpoint.enable=false", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return rows, read_hf_state_dict(folder), read_hf_state_dict(dump / "hf")


@torch.no_grad()
def assert_packed_rows_equal_alone(folder: Path, tol: float) -> None:
    """Two documents in one row (`DocumentAttention`), and a prompt shared by two branches
    (`DocumentAttention` with branch ids, and `SegmentAttention`), each within ``tol`` of
    transformers on the sequence alone."""
    from tandem.models import DocumentAttention, SegmentAttention

    ref, ours = hf_reference(folder), load_model(folder)
    a, b = tokens(1, 9, seed=1)[0], tokens(1, 13, seed=2)[0]
    row = torch.cat([a, b])[None]
    pos = torch.cat([torch.arange(9), torch.arange(13)])[None]
    got = ours(row, positions=pos, attn=DocumentAttention(torch.tensor([[0] * 9 + [1] * 13])))[0]
    assert (got[:9] - ref(a[None]).logits[0]).abs().max() <= tol
    assert (got[9:] - ref(b[None]).logits[0]).abs().max() <= tol
    # prompt p (6 tokens) + branch c1 (5) + branch c2 (7), laid out p c1 c2
    p, c1, c2 = tokens(1, 6, seed=3)[0], tokens(1, 5, seed=4)[0], tokens(1, 7, seed=5)[0]
    row = torch.cat([p, c1, c2])[None]
    pos = torch.cat([torch.arange(6), 6 + torch.arange(5), 6 + torch.arange(7)])[None]
    branch = torch.tensor([[0] * 6 + [1] * 5 + [2] * 7])
    want1 = ref(torch.cat([p, c1])[None]).logits[0]
    want2 = ref(torch.cat([p, c2])[None]).logits[0]
    # segments [p c1 pad pad] and [p c2] of width 13; c2's outputs come from segment 1
    gather = torch.tensor([list(range(11)) + [10, 10], list(range(6)) + list(range(11, 18))])
    scatter = torch.tensor(list(range(11)) + [13 + 6 + i for i in range(7)])
    for attn in (
        DocumentAttention(torch.zeros_like(branch), branch),
        SegmentAttention(gather, scatter),
    ):
        got = ours(row, positions=pos, attn=attn)[0]
        assert (got[:11] - want1).abs().max() <= tol, type(attn).__name__
        assert (got[11:] - want2[6:]).abs().max() <= tol, type(attn).__name__


def assert_gradients_match(folder: Path, tol: float) -> dict[str, torch.Tensor]:
    """The same loss through transformers' model and ours: every parameter has a gradient
    within ``tol`` of transformers' under the HF names (which must be the same set). Returns
    our gradients by HF name."""
    from tandem.models import tandem_to_hf
    from tests.fixtures import TINY_VOCAB

    ref, ours = hf_reference(folder), load_model(folder)
    x, y = tokens(2, 12, seed=6), tokens(2, 12, seed=7)

    def loss(logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, TINY_VOCAB), y.reshape(-1))

    loss(ref(x).logits).backward()
    loss(ours(x)).backward()
    grads = tandem_to_hf({n: p.grad for n, p in ours.named_parameters()}, ours.args)
    hf = dict(ref.named_parameters())
    assert sorted(grads) == sorted(hf)
    for name, g in grads.items():
        assert hf[name].grad is not None, name
        assert (g - hf[name].grad).abs().max() <= tol, name
    return grads


def exact_quickstart_unchanged(folder: Path, tmp_path: Path) -> list[str]:
    """`quickstart_two_steps` with ``rl.exact``: two rows, each with ``gap/abs_max`` 0 and
    ``moe/routing_mismatch`` 0, the export holding the folder's tensor names. Returns the names
    of the tensors that the two steps left unchanged."""
    rows, before, after = quickstart_two_steps(folder, tmp_path, "--rl.exact=true")
    assert len(rows) == 2
    for row in rows:
        assert row["gap/abs_max"] == 0.0 and row["moe/routing_mismatch"] == 0.0
    assert sorted(before) == sorted(after)
    return [n for n, t in before.items() if torch.equal(t, after[n].to(t.dtype))]
