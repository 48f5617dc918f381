"""tandem.rl.core.samples: the bounded per-step sample log that tandem-report's sample
browser reads."""

import json
import os

import pytest

from tandem.rl.config.schema import ConfigError, load_config
from tandem.rl.core.samples import SampleLog, read_samples


def _rec(i, **over):
    r = {
        "prompt": f"What is {i}+1?",
        "completion": f"{i + 1}!",
        "reward": i / 10,
        "rewards": {"exact_match": i / 10},
        "advantage": 0.5 - i,
        "finish_reason": "stop",
    }
    r.update(over)
    return r


def test_keeps_the_first_per_step_records_and_extra_keys(tmp_path):
    log = SampleLog(str(tmp_path), per_step=2, enabled=True)
    assert log.log(1, [_rec(0, prompt_id="p0"), _rec(1), _rec(2)]) == 2
    assert log.log(2, [_rec(3)]) == 1
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert [s["completion"] for s in lines[0]["samples"]] == ["1!", "2!"]
    assert lines[0]["samples"][0]["prompt_id"] == "p0"
    assert lines[0]["samples"][1] == {
        "prompt": "What is 1+1?",
        "completion": "2!",
        "reward": 0.1,
        "rewards": {"exact_match": 0.1},
        "advantage": -0.5,
        "finish_reason": "stop",
    }
    assert read_samples(str(tmp_path)) == lines


def test_truncate_drops_steps_after_a_checkpoint(tmp_path):
    log = SampleLog(str(tmp_path), per_step=1, enabled=True)
    for step in range(1, 6):
        log.log(step, [_rec(step)])
    log.truncate(3)
    assert [x["step"] for x in read_samples(str(tmp_path))] == [1, 2, 3]
    log.log(4, [_rec(40)])  # the resumed run appends after step 3
    assert [x["samples"][0]["completion"] for x in read_samples(str(tmp_path))] == [
        "2!",
        "3!",
        "4!",
        "41!",
    ]


def test_disabled_and_zero_write_nothing(tmp_path):
    SampleLog(str(tmp_path), per_step=4, enabled=False).log(1, [_rec(0)])
    SampleLog(str(tmp_path), per_step=0, enabled=True).log(1, [_rec(0)])
    assert not (tmp_path / "samples.jsonl").exists()
    assert read_samples(str(tmp_path)) == []


def test_non_finite_numbers_are_null_and_missing_keys_named(tmp_path):
    log = SampleLog(str(tmp_path), per_step=4, enabled=True)
    log.log(1, [_rec(0, reward=float("nan"), advantage=None)])
    s = read_samples(str(tmp_path))[0]["samples"][0]
    assert s["reward"] is None and s["advantage"] is None
    bad = _rec(0)
    del bad["advantage"]
    with pytest.raises(ValueError, match="missing advantage"):
        log.log(2, [bad])


def test_text_sink_gets_markdown(tmp_path):
    got = []
    log = SampleLog(str(tmp_path), per_step=4, enabled=True, text_sink=lambda *a: got.append(a))
    log.log(7, [_rec(2)])
    tag, text, step = got[0]
    assert (tag, step) == ("samples", 7)
    assert "reward 0.2 (exact_match 0.2), advantage -1.5, stop" in text and "    3!" in text


def test_a_cut_last_line_is_skipped(tmp_path):
    (tmp_path / "samples.jsonl").write_text(
        json.dumps({"step": 1, "samples": []}) + "\n" + '{"step": 2, "sam'
    )
    assert read_samples(str(tmp_path)) == [{"step": 1, "samples": []}]


def test_config_key(monkeypatch):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert load_config("configs/quickstart.toml").metrics.samples_per_step == 4
    with pytest.raises(ConfigError, match="metrics.samples_per_step: must be >= 0"):
        load_config("configs/quickstart.toml", ["metrics.samples_per_step=-1"])
