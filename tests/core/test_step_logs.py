"""The per-step logs a run reads back (metrics.jsonl, ledger.jsonl, samples.jsonl) go through
one reader: a torn last line (a crash during an append) is dropped with one warning, anything
else a crash cannot leave is one StepLogError (exit 8) naming the file and line. The
end-to-end resume after a torn line is in test_checkpoint_integrity.py."""

import json
import os
import subprocess
import sys

import pytest

from tandem.rl.core.errors import EXIT_CHECKPOINT
from tandem.rl.core.metrics import StepLogError, position_repeats, step_gaps, truncate_jsonl
from tandem.rl.core.samples import read_samples

ROWS = [{"step": 1, "ids": ["a"], "positions": [0]}, {"step": 2, "ids": ["b"], "positions": [1]}]


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines[:-1]) + lines[-1])


def test_a_torn_last_line_is_dropped_with_one_warning(tmp_path, capsys):
    log = tmp_path / "ledger.jsonl"
    row3 = json.dumps({"step": 3, "ids": ["c"]})
    _write(log, [json.dumps(r) for r in ROWS] + [row3[: len(row3) // 2]])
    assert step_gaps(str(log), 2) is None and position_repeats(str(log)) is None
    assert capsys.readouterr().err == ""  # reading alone does not warn
    truncate_jsonl(str(log), 5)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{log}:3: the last line is cut short" in err[0]
    assert [json.loads(x) for x in log.read_text().splitlines()] == ROWS
    truncate_jsonl(str(log), 1)
    assert [json.loads(x) for x in log.read_text().splitlines()] == ROWS[:1]


def test_samples_reader_skips_a_torn_last_line(tmp_path):
    _write(tmp_path / "samples.jsonl", ['{"step": 1, "samples": []}', '{"step": 2, "sam'])
    assert read_samples(str(tmp_path)) == [{"step": 1, "samples": []}]


BAD = {
    "bad_json_not_last": (['{"step": 1}', "{oops", '{"step": 2}'], ":2: not a JSON line"),
    "a_list_row": (['{"step": 1}', "[1, 2]"], ":2: a list, not a JSON object"),
    "step_a_string": (['{"step": "1"}'], ":1: step is '1', not an integer"),
    "positions_not_ints": (['{"step": 1, "positions": "abc"}'], ":1: positions is not a list"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_any_other_bad_line_is_one_error_naming_the_line(tmp_path, case):
    lines, expected = BAD[case]
    log = tmp_path / "ledger.jsonl"
    log.write_text("\n".join(lines) + "\n")
    for call in (lambda: truncate_jsonl(str(log), 5), lambda: step_gaps(str(log), 2)):
        with pytest.raises(StepLogError, match=f"{log}{expected}".replace("[", r"\[")) as e:
            call()
        assert "\n" not in str(e.value) and e.value.exit_status == EXIT_CHECKPOINT


def test_a_folder_or_fifo_in_place_of_a_log_is_one_error_and_never_blocks(tmp_path):
    (tmp_path / "ledger.jsonl").mkdir()
    with pytest.raises(StepLogError, match="ledger.jsonl is a folder"):
        truncate_jsonl(str(tmp_path / "ledger.jsonl"), 0)
    os.mkfifo(tmp_path / "metrics.jsonl")
    with pytest.raises(StepLogError, match="metrics.jsonl is not a regular file"):
        step_gaps(str(tmp_path / "metrics.jsonl"), 2)


def test_train_exits_8_with_one_line_when_the_ledger_is_a_folder(tmp_path):
    """Caught at the first read (resume), before anything is built on it."""
    dump = tmp_path / "run"
    (dump / "ledger.jsonl").mkdir(parents=True)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "train.py"),
            "--model.flavor=debug-qwen3",
            "--model.tokenizer=builtin:char",
            "--data.path=synthetic:addition_small",
            "--data.synthetic_rows=16",
            "--training.steps=1",
            "--metrics.loggers=[]",
            f"--job.dump_folder={dump}",
        ],
        cwd=root,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == EXIT_CHECKPOINT, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"error: {dump / 'ledger.jsonl'} is a folder; the run writes this per-step log itself: "
        "move it away, or choose another job.dump_folder"
    ]
