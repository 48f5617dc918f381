"""Model folders: the documented exit status (4) and one line naming the file, no traceback.

Damaged copies of assets/quickstart-policy go to train.py (SFT) and to
`python -m rl.generate`; both must exit 4 with one line naming the file.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from rl.generate import main as generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")  # context 2048, char tokenizer, intermediate 128
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def _truncate(d):
    f = os.path.join(d, "model.safetensors")
    os.truncate(f, os.path.getsize(f) // 2)


def _config(d, **changes):
    c = json.load(open(os.path.join(d, "config.json")))
    c.update(changes)
    json.dump(c, open(os.path.join(d, "config.json"), "w"))


DAMAGE = {  # name -> (damage, the one line's text after "error: <key>: ")
    "safetensors_truncated": (_truncate, "{d}/model.safetensors: not a readable safetensors file (Error while "
                                         "deserializing header: incomplete metadata, file not fully covered)"),
    "safetensors_garbage": (lambda d: open(os.path.join(d, "model.safetensors"), "wb").write(b"\x00" * 64 + b"x" * 4000),
                            "{d}/model.safetensors: not a readable safetensors file (Error while deserializing "
                            "header: invalid JSON in header: EOF while parsing a value at line 1 column 0)"),
    "tokenizer_garbage": (lambda d: open(os.path.join(d, "tokenizer.json"), "w").write("{garbage"),
                          "{d}/tokenizer.json: not a readable tokenizer.json (key must be a string at line 1 column 2)"),
    "config_shapes": (lambda d: _config(d, intermediate_size=256),
                      "{d}/model.safetensors: model.layers.0.mlp.down_proj.weight has shape [64, 128], but "
                      "config.json makes it [64, 256]"),
    "config_garbage": (lambda d: open(os.path.join(d, "config.json"), "w").write("not json"),
                       "{d}/config.json: not valid JSON (Expecting value: line 1 column 1 (char 0))"),
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
    cmd = [sys.executable, "train.py", f"--model.path={d}", "--data.path=synthetic:addition_small",
           "--data.synthetic_rows=16", "--data.max_length=64", "--training.steps=1", "--training.batch_size=2",
           "--metrics.tensorboard=false", f"--job.dump_folder={tmp_path / 'run'}"]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    folder = f"{d}: " if damage.startswith("tokenizer") else ""  # the tokenizer's key names the folder too
    assert (r.returncode, r.stderr) == (4, f"error: model.path: {folder}{text}\n")
