"""`tandem-generate`: against transformers on an HF folder, seeds, torchrun split, bad input."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tandem.generate import main
from tests.fixtures import QWEN_CHAT_TEMPLATE, hf_reference, write_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    write_hf_model(path, "qwen3", seed=3)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN_CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("in") / "prompts.jsonl"
    rows = [
        {"id": "a", "prompt": "12+7="},
        {"prompt": "hello there, general"},
        {"id": "c", "messages": [{"role": "user", "content": "sort 3 1 2"}]},
        {"prompt": "x"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return path


def _read(path):
    return [json.loads(line) for line in open(path)]


def _run(folder, prompts, out, *flags):
    return main(
        [
            "--model",
            str(folder),
            "--input",
            str(prompts),
            "--output",
            str(out),
            "--kv-cache-gb",
            "0.01",
            *flags,
        ]
    )


def test_greedy_equals_transformers_and_logprobs_match(folder, prompts, tmp_path):
    out = tmp_path / "out.jsonl"
    assert (
        _run(folder, prompts, out, "--temperature", "0", "--max-tokens", "12", "--ignore-eos") == 0
    )
    rows = _read(out)
    assert [r["index"] for r in rows] == [0, 1, 2, 3] and [r["id"] for r in rows] == [
        "a",
        None,
        "c",
        None,
    ]
    from tandem.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(folder)
    ref = hf_reference(folder)
    src = [row for row in open(prompts) if row.strip()]
    for r, line in zip(rows, src):
        row = json.loads(line)
        text = (
            tok.apply_chat_template(row["messages"], add_generation_prompt=True)
            if "messages" in row
            else row["prompt"]
        )
        ids = tok.encode(text)
        assert (
            r["prompt_tokens"] == len(ids)
            and len(r["token_ids"]) == 12
            and r["finish_reason"] == "length"
        )
        seq = list(ids)
        with torch.no_grad():
            for _ in range(12):  # naive greedy loop: full recompute per token
                seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
            logp = torch.log_softmax(ref(torch.tensor([seq])).logits[0].float(), -1)
        assert r["token_ids"] == seq[len(ids) :]
        want = logp[torch.arange(len(ids) - 1, len(seq) - 1), torch.tensor(seq[len(ids) :])]
        torch.testing.assert_close(torch.tensor(r["logprobs"]), want, atol=1e-4, rtol=0)
        assert r["sampling_logprobs"] == [0.0] * 12  # greedy: a point mass
        assert r["text"] == tok.decode(r["token_ids"], skip_special_tokens=True)


def _same(a, b):
    """Equal tokens and text; log-probs equal up to float noise (another batch composition)."""
    strip = ("logprobs", "sampling_logprobs")
    assert [{k: v for k, v in r.items() if k not in strip} for r in a] == [
        {k: v for k, v in r.items() if k not in strip} for r in b
    ]
    for k in strip:
        torch.testing.assert_close(
            torch.tensor(sum((r[k] for r in a), [])),
            torch.tensor(sum((r[k] for r in b), [])),
            atol=1e-5,
            rtol=0,
        )


def test_sampling_is_seeded_and_independent_of_ranks(folder, prompts, tmp_path):
    flags = ("--n", "3", "--max-tokens", "8", "--seed", "5", "--top-p", "0.9")
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    assert _run(folder, prompts, a, *flags) == 0 and _run(folder, prompts, b, *flags) == 0
    rows = _read(a)
    assert len(rows) == 12 and [(r["index"], r["sample"]) for r in rows[:4]] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
    ]
    assert rows == _read(b)
    assert len({tuple(r["token_ids"]) for r in rows[:3]}) > 1  # samples of one prompt differ
    assert _run(folder, prompts, c, *flags[:-4], "--seed", "6", *flags[-2:]) == 0
    assert _read(c) != rows
    # two ranks under torchrun split the prompts; the file is the same as one process wrote
    d = tmp_path / "d.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "tandem.generate",
        "--model",
        str(folder),
        "--input",
        str(prompts),
        "--output",
        str(d),
        "--kv-cache-gb",
        "0.01",
        "--num-samples",
        *flags[1:],
    ]
    r = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    _same(_read(d), rows)
    assert "4 prompts x 3 samples = 12 rows" in r.stderr


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", ":2: invalid JSON"),
        ("[1, 2]", ":2: expected a JSON object"),
        ('{"question": "hi"}', ":2: has neither 'prompt' nor 'messages'"),
        ('{"prompt": 3}', ":2: 'prompt' must be a non-empty string"),
        ('{"messages": [{"role": "user"}]}', ":2: 'messages' must be a non-empty list"),
    ],
)
def test_malformed_line_exits_3_naming_it(folder, tmp_path, capsys, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n' + line + "\n")
    out = tmp_path / "out.jsonl"
    assert _run(folder, bad, out) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad}{message}" in err[0], err
    assert not out.exists() and not list(tmp_path.glob("out.jsonl*"))


def test_missing_model_exits_4(prompts, tmp_path, capsys):
    assert _run(tmp_path / "nope", prompts, tmp_path / "o.jsonl") == 4
    assert "--model" in capsys.readouterr().err


def test_bad_flag_exits_2(folder, prompts, tmp_path):
    with pytest.raises(SystemExit) as e:
        _run(folder, prompts, tmp_path / "o.jsonl", "--n", "0")
    assert e.value.code == 2


def test_dotted_field_paths_read_nested_columns(tmp_path):
    """--text-field / --messages-field take the dotted paths training's *_field settings take."""
    from tandem.generate import read_prompts

    path = tmp_path / "in.jsonl"
    rows = [
        {"id": "a", "extra": {"q": "What is 2+2?"}},
        {"id": "b", "chat": {"turns": [{"role": "user", "content": "Hi"}]}},
        {"id": "c", "extra.q": "a key with a dot wins"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_prompts(str(path), "extra.q", "chat.turns")
    assert [(r["id"], r.get("text"), r.get("messages")) for r in got] == [
        ("a", "What is 2+2?", None),
        ("b", None, [{"role": "user", "content": "Hi"}]),
        ("c", "a key with a dot wins", None),
    ]
