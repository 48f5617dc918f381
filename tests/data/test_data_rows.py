"""One bad row never changes the others; bad rows and bad files are named by file and line.

Rows are read as the file holds them (no schema inferred across rows) and every
consumer type-checks its fields: a wrong-typed or missing field is one bad row,
skipped and counted or an error by ``data.on_bad_row``. Whole-file problems
(not UTF-8, empty, binary, a folder without data files) are one DataError line,
exit 3 from train.py.
"""

import gzip
import json
import os
import re
import subprocess
import sys

import pytest

from tandem.models.tokenizer import build_char_tokenizer
from tandem.rl.data.loading import DataError, load_rows
from tandem.rl.data.preference import load_preference_data
from tandem.rl.data.prompts import encode_prompts
from tandem.rl.data.sft import build_sft_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _jsonl(path, rows):
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8"
    )
    return str(path)


def _prompts(rows, tok, on_bad_row="skip", source="x"):
    return encode_prompts(
        rows,
        tok,
        source=source,
        prompt_field="prompt",
        messages_field="messages",
        answer_field="answer",
        max_prompt_tokens=64,
        on_bad_row=on_bad_row,
    )


def test_a_number_as_prompt_is_one_bad_row_and_the_others_stay_as_written(tmp_path, tok):
    p = _jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "1+1=", "answer": "2"},
            {"prompt": 7, "answer": "7"},
            {"prompt": "2+2=", "answer": "4"},
        ],
    )
    rows = load_rows(p)
    assert list(rows) == [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": 7, "answer": "7"},
        {"prompt": "2+2=", "answer": "4"},
    ]
    prompts, skipped = _prompts(rows, tok, source=p)
    assert [(q.index, q.row["prompt"], q.row["answer"]) for q in prompts] == [
        (0, "1+1=", "2"),
        (2, "2+2=", "4"),
    ]
    reason = "field 'prompt' must be text or a list of {role, content} messages, got int"
    assert skipped == {reason: 1}
    with pytest.raises(DataError) as e:
        _prompts(rows, tok, "error", source=p)
    assert str(e.value) == (
        f"{p}:2: {reason} (data.prompt_field / data.messages_field name "
        "the fields) (set data.on_bad_row=skip to skip such rows)"
    )


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({"prompt": "3+3="}, "missing field 'answer'"),
        ({"prompt": "3+3=", "answer": 6}, "field 'answer' must be a string, got int"),
        (
            {"messages": [{"role": "user", "content": 33}], "answer": "6"},
            "field 'messages': a message's 'content' must be a string, got int",
        ),
        (
            {"messages": "3+3=", "answer": "6"},
            "field 'messages': messages must be a list of messages, got str",
        ),
    ],
)
def test_a_bad_rl_row_after_the_first_line_is_skipped_or_named(tmp_path, tok, bad, reason):
    p = _jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "1+1=", "answer": "2"}, "", bad, {"prompt": "2+2=", "answer": "4"}],
    )
    prompts, skipped = _prompts(load_rows(p), tok, source=p)
    assert [q.row["prompt"] for q in prompts] == ["1+1=", "2+2="] and skipped == {reason: 1}
    # the line names the setting that fixes it, where one does
    with pytest.raises(
        DataError,
        match=rf"^{p}:3: {re.escape(reason)}( \(data\.[a-z_]+ [^)]*\))? "
        r"\(set data.on_bad_row=skip",
    ):
        _prompts(load_rows(p), tok, "error", source=p)


def test_sft_rows_of_the_wrong_type_are_bad_rows_named_by_line(tmp_path, tok):
    good = {"prompt": "1+1=", "completion": "2"}
    p = _jsonl(
        tmp_path / "s.jsonl",
        [
            good,
            {"prompt": "2+2=", "completion": 4},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]},
            good,
        ],
    )
    data = build_sft_data(load_rows(p), tok, source=p, max_length=64, pack=False)
    assert data.num_examples == 2
    assert dict(data.skipped) == {
        "completion must be a string, got int": 1,
        "a message's 'content' must be a string, got int": 1,
    }
    with pytest.raises(DataError, match=rf"^{p}:2: completion must be a string, got int"):
        build_sft_data(load_rows(p), tok, source=p, max_length=64, on_bad_row="error")


def test_preference_rows_name_their_line_in_the_held_out_split_too(tmp_path, tok):
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "0"} for i in range(1, 9)]
    rows[4] = {"prompt": "5+1=", "chosen": 6, "rejected": "0"}
    p = _jsonl(tmp_path / "pairs.jsonl", rows)
    data = load_preference_data(p, tok, max_length=64, eval_fraction=0.5, seed=0)
    assert len(data.train) + len(data.eval) == 7 and data.skipped == {
        "chosen must be a string or a list of messages, got int": 1
    }
    with pytest.raises(
        DataError, match=rf"^{p}:5: chosen must be a string or a list of messages, got int"
    ):
        load_preference_data(p, tok, max_length=64, eval_fraction=0.5, seed=0, on_bad_row="error")


def test_whole_file_problems_are_one_line_naming_the_file(tmp_path):
    cases = {
        "latin1.jsonl": (
            b'{"prompt": "caf\xe9", "answer": "x"}\n',
            "latin1.jsonl:1: not UTF-8 text (byte 0xe9 at byte 16 of the line); data "
            "files must be UTF-8",
        ),
        "empty.jsonl": (b"", "empty.jsonl: empty file (no rows)"),
        "blank.jsonl": (b"\n  \n", "blank.jsonl: no rows (only blank lines)"),
        "png.jsonl": (
            b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
            "png.jsonl:1: not UTF-8 text (byte 0x89 at byte 1 of the line); data files "
            "must be UTF-8",
        ),
        "nul.jsonl": (b"\x00\x01\x02\n", "nul.jsonl:1: invalid JSON (Expecting value at column 1)"),
        "bad.parquet": (b"PAR1 not really", "bad.parquet: not a readable parquet file"),
        "bad.jsonl.gz": (b"\x1f\x8b\x08\x00garbage", "bad.jsonl.gz: cannot read: "),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError) as e:
            load_rows(str(tmp_path / name))
        assert str(e.value).startswith(f"{tmp_path / name}"[: -len(name)] + message), (
            name,
            str(e.value),
        )
        assert "\n" not in str(e.value)
    os.mkdir(tmp_path / "nothing")
    (tmp_path / "nothing" / "notes.txt").write_text("x")
    with pytest.raises(
        DataError,
        match=r"nothing: a folder with no data files \(\*.jsonl, "
        r"\*.json, \*.jsonl.gz, \*.parquet\)",
    ):
        load_rows(str(tmp_path / "nothing"))


def test_a_folder_gz_and_json_array_read_in_name_order(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    _jsonl(d / "b.jsonl", [{"prompt": "b1"}, {"prompt": "b2"}])
    with gzip.open(d / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"prompt": "a1"}) + "\n")
    (d / "c.json").write_text(json.dumps([{"prompt": "c1"}, {"prompt": "c2"}]))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["d1"], "n": [3]}), d / "d.parquet")
    (d / "README.md").write_text("not data")
    os.mkdir(d / "sub")
    _jsonl(d / "sub" / "z.jsonl", [{"prompt": "never"}])
    rows = load_rows(str(d))
    assert [r["prompt"] for r in rows] == ["a1", "b1", "b2", "c1", "c2", "d1"] and rows[-1] == {
        "prompt": "d1",
        "n": 3,
    }
    assert rows.where == [
        f"{d}/a.jsonl.gz:1",
        f"{d}/b.jsonl:1",
        f"{d}/b.jsonl:2",
        f"{d}/c.json: item 0",
        f"{d}/c.json: item 1",
        f"{d}/d.parquet: row 0",
    ]
    assert rows[1:3].where == [f"{d}/b.jsonl:1", f"{d}/b.jsonl:2"]


def _train(dump, data, *extra):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--model.flavor=debug-qwen3",
        "--model.tokenizer=builtin:char",
        f"--data.path={data}",
        "--data.max_length=64",
        "--training.steps=1",
        "--training.batch_size=2",
        "--metrics.loggers=[]",
        "--checkpoint.enable=false",
        f"--job.dump_folder={dump}",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_train_reads_a_folder_and_rejects_a_non_utf8_file_with_exit_3(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    _jsonl(
        d / "a.jsonl", [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": 4}]
    )
    _jsonl(d / "b.jsonl", [{"prompt": "3+3=", "completion": "6"}])
    r = _train(tmp_path / "run", d)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        "data: 2 examples -> 1 rows; skipped 1 {'completion must be a string, "
        "got int': 1}" in r.stdout
    )
    r = _train(tmp_path / "run2", d, "--data.on_bad_row=error")
    assert (r.returncode, r.stderr) == (
        3,
        f"error: {d}/a.jsonl:2: completion must be a "
        "string, got int (set data.on_bad_row=skip to skip "
        "such rows)\n",
    )
    (d / "c.jsonl").write_bytes(b'{"prompt": "caf\xe9", "completion": "x"}\n')
    r = _train(tmp_path / "run3", d)
    assert (r.returncode, r.stderr) == (
        3,
        f"error: {d}/c.jsonl:1: not UTF-8 text (byte 0xe9 at "
        "byte 16 of the line); data files must be UTF-8\n",
    )
