"""Model folders, tandem-generate's flags and Ctrl-C: the documented exit status and one line, no
traceback.

Damaged copies of assets/quickstart-policy go to train.py (SFT) and to
`tandem-generate`; both must exit 4 with one line naming the file. Flag
values the generator would fail on later exit 2 before the model loads; a
prompt that does not fit the model's context exits 3 naming its line (or is
cut by --truncate-prompts). SIGINT ends train.py with 130 and one line.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tandem.generate import main as generate
from tandem.rl.core.checkpoint import Checkpointer
from tests.fixtures import sigint_default

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# context 2048, char tokenizer, intermediate 128
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def _truncate(d):
    f = os.path.join(d, "model.safetensors")
    os.truncate(f, os.path.getsize(f) // 2)


def _config(d, **changes):
    c = json.load(open(os.path.join(d, "config.json")))
    c.update(changes)
    json.dump(c, open(os.path.join(d, "config.json"), "w"))


DAMAGE = {  # name -> (damage, the one line's text after "error: <key>: ")
    "safetensors_truncated": (
        _truncate,
        "{d}/model.safetensors: not a readable safetensors file (Error while "
        "deserializing header: incomplete metadata, file not "
        "fully covered)",
    ),
    "safetensors_garbage": (
        lambda d: open(os.path.join(d, "model.safetensors"), "wb").write(
            b"\x00" * 64 + b"x" * 4000
        ),
        "{d}/model.safetensors: not a readable safetensors file (Error while "
        "deserializing header: invalid JSON in header: EOF while parsing a "
        "value at line 1 column 0)",
    ),
    "tokenizer_garbage": (
        lambda d: open(os.path.join(d, "tokenizer.json"), "w").write("{garbage"),
        "{d}/tokenizer.json: not a readable tokenizer.json (key must be a string "
        "at line 1 column 2)",
    ),
    "config_shapes": (
        lambda d: _config(d, intermediate_size=256),
        "{d}/model.safetensors: model.layers.0.mlp.down_proj.weight has shape "
        "[64, 128], but config.json makes it [64, 256]",
    ),
    "config_garbage": (
        lambda d: open(os.path.join(d, "config.json"), "w").write("not json"),
        "{d}/config.json: not valid JSON (Expecting value: line 1 column 1 (char 0))",
    ),
}


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "1+1="}) + "\n" + json.dumps({"prompt": "12" * 1100}) + "\n")
    return p


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_model_folder_exits_4_in_train_and_generate(tmp_path, prompts, capsys, damage):
    d = str(tmp_path / "model")
    shutil.copytree(POLICY, d)
    hurt, text = DAMAGE[damage]
    hurt(d)
    text = text.format(d=d)
    out = tmp_path / "out.jsonl"
    assert generate(["--model", d, "--input", str(prompts), "--output", str(out)]) == 4
    assert capsys.readouterr().err == f"error: --model {d}: {text}\n"
    assert not out.exists() and os.listdir(tmp_path) == ["model", "p.jsonl"]
    cmd = [
        sys.executable,
        "train.py",
        f"--model.path={d}",
        "--data.path=synthetic:addition_small",
        "--data.synthetic_rows=16",
        "--data.max_length=64",
        "--training.steps=1",
        "--training.batch_size=2",
        "--metrics.loggers=[]",
        f"--job.dump_folder={tmp_path / 'run'}",
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    # the tokenizer's key names the folder too
    folder = f"{d}: " if damage.startswith("tokenizer") else ""
    assert (r.returncode, r.stderr) == (4, f"error: model.path: {folder}{text}\n")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-0.5"], "--temperature: must be >= 0 (0 = greedy), got -0.5"),
        (["--temperature", "nan"], "--temperature: must be a finite number, got nan"),
        (["--top-p", "0"], "--top-p: must be in (0, 1] (1 = off), got 0.0"),
        (["--top-p", "1.5"], "--top-p: must be in (0, 1] (1 = off), got 1.5"),
        (["--top-k", "-1"], "--top-k: must be >= 0 (0 = off), got -1"),
        (["--min-p", "-0.1"], "--min-p: must be in [0, 1] (0 = off), got -0.1"),
        (["--min-p", "2"], "--min-p: must be in [0, 1] (0 = off), got 2.0"),
        (["--block-size", "0"], "--block-size: must be >= 1, got 0"),
        (["--max-num-seqs", "0"], "--max-num-seqs: must be >= 1, got 0"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens: must be >= 1, got 0"),
        (["--kv-cache-gb", "0"], "--kv-cache-gb: must be > 0, got 0.0"),
        (["--seed", "-1"], "--seed: must be in [0, 2**32), got -1"),
        (["--stop", ""], "--stop: stop strings must not be empty, got ['']"),
        (["--n", "0"], "--n: must be >= 1, got 0"),
        (["--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
    ],
)
def test_bad_generate_flag_exits_2_with_one_line(tmp_path, prompts, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        generate(
            [
                "--model",
                POLICY,
                "--input",
                str(prompts),
                "--output",
                str(tmp_path / "o.jsonl"),
                *flags,
            ]
        )
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: {message} (tandem-generate --help lists the flags)\n"
    assert not (tmp_path / "o.jsonl").exists()


def test_generate_output_path_problems_exit_2(tmp_path, prompts, capsys):
    (tmp_path / "afile").write_text("x")
    for out, message in [
        (tmp_path, f"--output: {tmp_path} is a folder; give a file path"),
        (tmp_path / "afile" / "o.jsonl", f"--output: {tmp_path / 'afile'} is a file, not a folder"),
    ]:
        with pytest.raises(SystemExit) as e:
            generate(["--model", POLICY, "--input", str(prompts), "--output", str(out)])
        assert e.value.code == 2
        assert (
            capsys.readouterr().err
            == f"error: {message} (tandem-generate --help lists the flags)\n"
        )


def test_generate_checks_the_kv_budget_and_the_context_against_the_model(tmp_path, prompts, capsys):
    out = tmp_path / "o.jsonl"
    base = ["--model", POLICY, "--input", str(prompts), "--output", str(out)]
    assert generate([*base, "--kv-cache-gb", "1e-9"]) == 2
    assert capsys.readouterr().err == (
        "error: --kv-cache-gb: 1e-09 GB holds no KV block of this "
        "model (one block of 16 tokens takes 8.19e-06 GB "
        "in float32)\n"
    )
    assert generate([*base, "--max-tokens", "2048"]) == 2
    assert capsys.readouterr().err == (
        "error: --max-tokens: 2048 leaves no room for a prompt in "
        "the model's context of 2048 tokens "
        "(max_position_embeddings in config.json)\n"
    )
    # line 2 is 2200 tokens: with 8 new tokens it does not fit 2048
    assert generate([*base, "--max-tokens", "8"]) == 3
    assert capsys.readouterr().err == (
        f"error: {prompts}:2: prompt of 2200 tokens + --max-tokens "
        "8 exceeds the model's context of 2048 tokens; shorten it, "
        "lower --max-tokens or pass --truncate-prompts\n"
    )
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["p.jsonl"]
    assert generate([*base, "--max-tokens", "8", "--truncate-prompts", "--temperature", "0"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["prompt_tokens"] for r in rows] == [4, 2040]
    assert all(1 <= len(r["token_ids"]) <= 8 for r in rows)


def test_sigint_during_generation_exits_130_and_writes_nothing(tmp_path):
    prompts = tmp_path / "many.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(32)))
    out = tmp_path / "out" / "o.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "tandem.generate",
        "--model",
        POLICY,
        "--input",
        str(prompts),
        "--output",
        str(out),
        "--n",
        "8",
        "--max-tokens",
        "1500",
        "--ignore-eos",
    ]  # 384k tokens: minutes on a CPU
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,
    )
    first = p.stderr.readline()  # the model is loaded: generating (a busy machine: any time)
    assert first == "generating 32 prompts x 8 samples\n", first
    time.sleep(1)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert (p.returncode, err) == (130, "error: interrupted (SIGINT); no output written\n")
    assert not (tmp_path / "out").exists()


def test_sigint_exits_130_with_one_line_and_keeps_the_checkpoints(tmp_path):
    dump = tmp_path / "run"
    cmd = [
        sys.executable,
        "train.py",
        "--model.flavor=debug-qwen3",
        "--model.tokenizer=builtin:char",
        "--data.path=synthetic:addition_small",
        "--data.synthetic_rows=64",
        "--data.max_length=64",
        "--training.steps=100000",
        "--training.batch_size=4",
        "--checkpoint.interval=2",
        "--metrics.loggers=[]",
        f"--job.dump_folder={dump}",
    ]
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,
    )
    for line in p.stdout:
        if line.startswith("step 5/"):  # step-2 and step-4 are committed
            break
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert (p.returncode, err) == (
        130,
        "error: interrupted (SIGINT); the checkpoints committed so far are kept\n",
    )
    ck = Checkpointer(str(dump / "checkpoints"))
    assert ck.verify(2) is None and ck.verify(4) is None
