"""Data as other trainers lay it out trains as it is: verl's RL parquet, TRL's prompt-only and
conversational datasets, OpenRLHF's prompt/label jsonl (docs/data.md has the command line of
each); fields by dotted path; a prompt that is text or messages; data_source routing.

Each layout's fixture holds the quickstart's addition problems, written the way that trainer's
users have them, and trains two steps of the quickstart from the shipped policy with the
documented flags. A verl file's rewards equal those of the same rows flattened by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tandem.models.tokenizer import build_char_tokenizer
from tandem.rl.config.schema import ConfigError, load_config
from tandem.rl.core.fields import get_field
from tandem.rl.core.metrics import read_rows
from tandem.rl.data.loading import DataError, load_rows
from tandem.rl.data.prompts import encode_prompts, prompt_messages
from tandem.rl.data.tasks import make_task_rows
from tandem.rl.rewards.routing import by_source, route

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.toml")
STEPS = 2


def _problems(split: str, n: int) -> list[tuple[str, str]]:
    rows = make_task_rows("addition_small", n, 0 if split == "train" else 1, split, max_value=19)
    return [(r["prompt"], r["answer"]) for r in rows]


def _user(q: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": q}]


# each layout: (how a row is written, the train.py flags its docs give)
LAYOUTS = {
    "verl": (
        lambda i, q, a: {
            "data_source": "openai/gsm8k",
            "prompt": _user(q),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": a},
            "extra_info": {"split": "train", "index": i},
        },
        ["--data.answer_field=reward_model.ground_truth", "--reward.functions=by_source"],
    ),
    "flattened": (lambda i, q, a: {"prompt": q, "answer": a}, ["--reward.functions=math"]),
    "trl_prompt_only": (
        lambda i, q, a: {"prompt": q, "solution": a},
        ["--data.answer_field=solution"],
    ),
    "trl_conversational": (
        lambda i, q, a: {"prompt": _user(q), "solution": a},
        ["--data.answer_field=solution"],
    ),
    "openrlhf": (
        lambda i, q, a: {"input": q, "label": a},
        ["--data.prompt_field=input", "--data.answer_field=label"],
    ),
}
PARQUET = {"verl"}


def _write(folder: Path, name: str, split: str, n: int) -> str:
    make, _ = LAYOUTS[name]
    rows = [make(i, q, a) for i, (q, a) in enumerate(_problems(split, n))]
    if name in PARQUET:
        path = folder / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _train(dump: Path, data: str, evals: str, flags: list[str]) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "train.py",
        "--config",
        QUICKSTART,
        f"--data.path={data}",
        f"--data.eval_path={evals}",
        f"--job.dump_folder={dump}",
        f"--training.steps={STEPS}",
        "--rl.prompts_per_step=8",
        "--rl.num_samples=4",
        "--rl.eval_prompts=8",
        "--rl.eval_samples=1",
        "--reward.num_workers=0",
        "--checkpoint.enable=false",
        "--metrics.loggers=[]",
        "--data.on_bad_row=error",
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = {}
    for name, (_, flags) in LAYOUTS.items():
        folder = tmp_path_factory.mktemp(name)
        r = _train(
            folder / "dump",
            _write(folder, name, "train", 64),
            _write(folder, name, "test", 8),
            flags,
        )
        assert r.returncode == 0, (name, r.stdout[-2000:], r.stderr[-3000:])
        out[name] = read_rows(str(folder / "dump" / "metrics.jsonl"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_layout_trains_two_steps_with_its_documented_flags(runs, name):
    rows = runs[name]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["reward/total"] > 0 for r in rows)  # the policy adds: some answers score
    assert all(r["update/tokens"] > 0 for r in rows)


@pytest.mark.slow
def test_a_verl_file_scores_like_its_rows_flattened_by_hand(runs):
    verl, flat = runs["verl"], runs["flattened"]
    assert [r["reward/total"] for r in verl] == [r["reward/total"] for r in flat]
    assert [r["reward/by_source/mean"] for r in verl] == [r["reward/math/mean"] for r in flat]
    assert all(r["reward/by_source/errors"] == 0 for r in verl)
    # the same prompts, tokens, samples
    assert [r["loss"] for r in verl] == [r["loss"] for r in flat]


def test_fields_by_dotted_path():
    row = {
        "reward_model": {"ground_truth": "7", "style": "rule"},
        "extra_info": {"index": 3},
        "a.b": "literal",
        "a": {"b": "nested"},
        "turns": [{"content": "hi"}],
    }
    assert get_field(row, "reward_model.ground_truth") == "7"
    assert get_field(row, "extra_info.index") == 3
    assert get_field(row, "a.b") == "literal"  # a key that holds the dots wins
    assert get_field(row, "turns.0.content") == "hi"
    assert get_field(row, "reward_model.missing") is None and get_field(row, "turns.5") is None


def test_a_nested_field_read_from_parquet_and_jsonl_alike(tmp_path):
    rows = [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    (tmp_path / "a.jsonl").write_text(json.dumps(rows[0]) + "\n")
    tok = build_char_tokenizer(str(tmp_path / "tok"))
    for path in (tmp_path / "a.parquet", tmp_path / "a.jsonl"):
        prompts, skipped = encode_prompts(
            load_rows(str(path)),
            tok,
            source=str(path),
            prompt_field="prompt",
            messages_field="messages",
            answer_field="reward_model.ground_truth",
            max_prompt_tokens=64,
        )
        assert (prompts[0].row["answer"], skipped) == ("2", {})
    with pytest.raises(
        DataError,
        match=r":1: missing field 'reward_model.truth' "
        r"\(data.answer_field names it\)",
    ):
        encode_prompts(
            load_rows(str(tmp_path / "a.jsonl")),
            tok,
            source="a",
            prompt_field="prompt",
            messages_field="messages",
            answer_field="reward_model.truth",
            max_prompt_tokens=64,
            on_bad_row="error",
        )


def test_a_prompt_is_text_or_messages_and_a_wrong_type_names_the_setting():
    assert prompt_messages({"prompt": "2+2="}, "prompt", "messages") == _user("2+2=")
    assert prompt_messages({"prompt": _user("2+2=")}, "prompt", "messages") == _user("2+2=")
    system = [{"role": "system", "content": "Add."}, *_user("2+2=")]
    assert prompt_messages({"prompt": system}, "prompt", "messages") == system
    with pytest.raises(ValueError) as e:
        prompt_messages({"prompt": {"text": "2+2="}}, "prompt", "messages")
    assert str(e.value) == (
        "field 'prompt' must be text or a list of {role, content} "
        "messages, got dict (data.prompt_field / data.messages_field name "
        "the fields)"
    )
    with pytest.raises(
        ValueError,
        match=r"field 'prompt': each message needs 'role' and 'content' "
        r"\(data.messages_field names the messages field\)",
    ):
        prompt_messages({"prompt": [{"text": "2+2="}]}, "prompt", "messages")


def test_a_wrong_typed_prompt_stops_train_with_one_line_naming_messages_field(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(
        json.dumps({"prompt": "1+1=", "answer": "2"})
        + "\n"
        + json.dumps({"prompt": 7, "answer": "7"})
        + "\n"
    )
    r = _train(tmp_path / "dump", str(data), str(data), [])
    assert r.returncode == 3, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"error: {data}:2: field 'prompt' must be text or a list of {{role, content}} "
        "messages, got int (data.prompt_field / data.messages_field name the fields) (set "
        "data.on_bad_row=skip to skip such rows)"
    ]


def test_data_source_routes_through_the_reward_registry():
    assert route("openai/gsm8k") == "math" and route("exact_match") == "exact_match"
    assert route("my/source", {"my/source": "exact_match"}) == "exact_match"
    assert route("unknown/source") is None and route(None) is None
    row = {"data_source": "openai/gsm8k", "answer": "18"}
    assert by_source("The answer is \\boxed{18}.", row) == 1.0
    assert by_source("18!", {**row, "data_source": "mine"}, routes={"mine": "exact_match"}) == 0.0
    assert (
        by_source(
            "18",
            {"src": {"name": "mine"}, "answer": "18"},
            field="src.name",
            routes={"mine": "exact_match"},
        )
        == 1.0
    )
    with pytest.raises(
        ValueError,
        match=r"data_source='unknown/source' names no reward function: add it to "
        r"\[reward.kwargs.by_source\] routes",
    ):
        by_source("18", {**row, "data_source": "unknown/source"})


def test_reward_kwargs_are_checked_against_the_function(tmp_path):
    def config(table: str) -> str:
        path = tmp_path / "c.toml"
        path.write_text(Path(QUICKSTART).read_text() + table)
        return str(path)

    base = ["reward.functions=by_source"]
    cfg = load_config(config('[reward.kwargs.by_source]\nroutes = {"a/b" = "math"}\n'), base)
    assert cfg.reward.kwargs == {"by_source": {"routes": {"a/b": "math"}}}
    with pytest.raises(ConfigError, match=r"reward.kwargs.math: 'math' is not in reward.functions"):
        load_config(config("[reward.kwargs.math]\nstrict = true\n"), base)
    with pytest.raises(
        ConfigError, match=r"reward.kwargs.by_source: reward function 'by_source': bad config"
    ):
        load_config(config("[reward.kwargs.by_source]\nrootes = 1\n"), base)
    # each setting's type and the routes' targets are checked at start (rc 0 with every
    # reward an error before)
    for table, why in (
        ('routes = "math"', r"routes must be Mapping\[str, str\] \| None, got 'math'"),
        ("field = 5", "field must be str, got 5"),
        ('routes = {"a/b" = 1}', r"routes must be Mapping\[str, str\]"),
        ('routes = {"a/b" = "maths"}', r"routes: 'a/b' = 'maths' names no reward function"),
        ('routes = {"a/b" = "by_source"}', "names no reward function"),
    ):
        with pytest.raises(ConfigError, match=r"reward.kwargs.by_source: .*bad config.*" + why):
            load_config(config(f"[reward.kwargs.by_source]\n{table}\n"), base)
