"""On-policy distillation demos and teachers of other tokenizers, end to end.

- `Teachers.score` against transformers: a character-level student's completion,
  the Llama-layout BPE teacher's chunk log-probs equal the sums of the log-probs
  transformers computes on the text its own tokenizer and chat template give; the
  same-tokenizer teacher's are the per-token log-probs of the student's own ids.
- The two CPU demos, shortened, on 2 ranks: the student's reverse KL to its teacher
  falls by more than half and its held-out accuracy rises toward the teacher's,
  with the student's tokenizer (configs/quickstart_opd.toml) and across tokenizers
  (configs/quickstart_opd_xtok.toml).
- One run routes prompts to teachers of two tokenizers (per-teacher metrics), and
  bad input stops a run at start with one line and exit 2: a teacher whose chat
  template cannot render the data's roles, a route value that names no teacher.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tandem.models.tokenizer import Tokenizer
from tandem.rl.rollout.types import RolloutSample

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUDENT = os.path.join(ROOT, "assets", "quickstart-policy")
SAME = os.path.join(ROOT, "assets", "quickstart-teacher")
XTOK = os.path.join(ROOT, "assets", "xtok-teacher")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def _hf_logprobs(folder, prompt_ids, completion_ids):
    """Log-probs of ``completion_ids`` after ``prompt_ids`` under transformers' model of
    ``folder``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)
    n = len(prompt_ids)
    return [logp[n - 1 + k, t].item() for k, t in enumerate(completion_ids)]


def test_teacher_chunk_logprobs_match_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from tandem.parallel.mesh import Degrees, build_mesh
    from tandem.rl.config.rl_schema import DistillConfig
    from tandem.rl.core.modeling import BuildSpec
    from tandem.rl.update.teachers import Teachers

    created = not dist.is_initialized()  # an in-process recipe test may have left a world of one
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        student = Tokenizer.from_dir(STUDENT)
        msgs = [{"role": "user", "content": "12+7="}]
        prompt = student.encode(student.apply_chat_template(msgs, add_generation_prompt=True))
        # "You" is one token of the BPE teacher (a word of its template) and three of the student
        completions = [
            student.encode("You") + [student.token_to_id("<|im_end|>")],
            student.encode("19!"),
        ]
        samples = [
            RolloutSample(
                0,
                prompt,
                c,
                [True] * len(c),
                [0.0] * len(c),
                "stop",
                "",
                {"prompt": "12+7=", "t": t},
            )
            for c in completions
            for t in ("same", "xtok")
        ]
        d = DistillConfig(teachers=[SAME, XTOK], names=["same", "xtok"], route_field="t")
        teachers = Teachers(
            d,
            student,
            build_mesh(Degrees(), torch.device("cpu")),
            torch.device("cpu"),
            BuildSpec(),
            seed=0,
            is_main=True,
            conversation=lambda row: [{"role": "user", "content": row["prompt"]}],
            group=None,  # the whole world, of one rank
        )
        route = teachers.route(samples)
        assert route == [0, 1, 0, 1]
        chunk_logp, chunk_ids = teachers.score(samples, route, 4, 4096, torch.device("cpu"))
    finally:
        if created:
            dist.destroy_process_group()
    # the same tokenizer: one chunk per token, the teacher's log-probs of the student's own ids
    for i in (0, 2):
        n = len(samples[i].completion_ids)
        assert chunk_ids[i, :n].tolist() == list(range(n)) and (chunk_ids[i, n:] == -1).all()
        want = _hf_logprobs(SAME, prompt, samples[i].completion_ids)
        assert torch.allclose(chunk_logp[i, :n], torch.tensor(want), atol=1e-4), (
            chunk_logp[i],
            want,
        )
    # another tokenizer: transformers' own tokenizer and chat template give the teacher's text and
    # ids
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(XTOK, "tokenizer.json"))
    hf_tok.chat_template = json.load(open(os.path.join(XTOK, "tokenizer_config.json")))[
        "chat_template"
    ]
    hf_tok.bos_token = "<|begin_of_text|>"
    t_prompt = hf_tok(
        hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    you = hf_tok("You<|eot_id|>", add_special_tokens=False)["input_ids"]
    assert hf_tok.convert_ids_to_tokens(you) == ["You", "<|eot_id|>"]
    lp = _hf_logprobs(XTOK, t_prompt, you)
    assert chunk_ids[1].tolist() == [0, 0, 0, 1]  # Y o u | end of turn
    assert torch.allclose(chunk_logp[1, :2], torch.tensor(lp), atol=1e-4), (chunk_logp[1], lp)
    assert (chunk_logp[1, 2:] == 0).all()
    bang = hf_tok("19!", add_special_tokens=False)["input_ids"]
    # no end of turn: cut by max_tokens
    assert hf_tok.convert_ids_to_tokens(bang) == ["1", "9", "!"]
    lp = _hf_logprobs(
        XTOK, t_prompt, bang + hf_tok("<|eot_id|>", add_special_tokens=False)["input_ids"]
    )
    assert chunk_ids[3].tolist() == [0, 1, 2, -1]
    assert torch.allclose(chunk_logp[3, :3], torch.tensor(lp[:3]), atol=1e-4), (chunk_logp[3], lp)


def _train(config, dump, *extra, torchrun=True):
    launch = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"] if torchrun else []
    )
    cmd = [
        sys.executable,
        *launch,
        "train.py",
        "--config",
        f"configs/{config}",
        f"--job.dump_folder={dump}",
        "--metrics.loggers=[]",
        "--checkpoint.enable=false",
        "--reward.num_workers=0",
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def _learns(tmp_path, config):
    r = _train(config, tmp_path, "--training.steps=20", "--rl.eval_prompts=48")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    kl = [row["distill/reverse_kl"] for row in rows]
    start, end = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert end < 0.5 * start, kl
    acc = (
        [
            float(line.split()[3])
            for line in r.stdout.splitlines()
            if line.startswith("eval accuracy: start")
        ][0],
        rows[-1]["eval/accuracy"],
    )
    return rows, acc, r.stdout


@pytest.mark.slow
def test_quickstart_opd_demo_learns(tmp_path):
    rows, (start, end), _ = _learns(tmp_path, "quickstart_opd.toml")
    assert start < 0.65 and end > start + 0.2, (start, end)  # the teacher: 0.983
    assert all(r["distill/aligned_frac"] == 1.0 for r in rows)


@pytest.mark.slow
def test_quickstart_opd_xtok_demo_learns(tmp_path):
    rows, (start, end), _ = _learns(tmp_path, "quickstart_opd_xtok.toml")
    assert start < 0.65 and end > start + 0.2, (start, end)
    assert min(r["distill/xtok-teacher/aligned_frac"] for r in rows) > 0.95


@pytest.mark.slow
def test_teachers_of_two_tokenizers_in_one_run(tmp_path):
    data = tmp_path / "mixed.jsonl"
    with open(data, "w") as f:
        for i in range(64):
            a, b = i % 10, (i * 7) % 10
            f.write(
                json.dumps(
                    {
                        "id": f"p{i}",
                        "prompt": f"{a}+{b}=",
                        "answer": str(a + b),
                        "teacher": "char" if i % 2 else "bpe",
                    }
                )
                + "\n"
            )
    args = (
        f"--data.path={data}",
        "--data.eval_path=",
        f"--distill.teachers={SAME},{XTOK}",
        "--distill.names=char,bpe",
        "--distill.route_field=teacher",
        "--rl.prompts_per_step=8",
    )
    r = _train("quickstart_opd.toml", tmp_path / "run", "--training.steps=1", *args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert row["distill/char/aligned_frac"] == 1.0 and row["distill/bpe/aligned_frac"] > 0.9, row
    assert row["distill/char/reverse_kl"] > 0.1 and row["distill/bpe/reverse_kl"] > 0.1, row
    # a route value with no teacher: one line naming it, exit 2, before any step (one process:
    # the exit status is train.py's own; torchrun reports any failure as 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text().replace('"teacher": "bpe"', '"teacher": "bpee"', 1))
    r = _train(
        "quickstart_opd.toml",
        tmp_path / "bad",
        "--training.steps=1",
        *args,
        f"--data.path={bad}",
        torchrun=False,
    )
    assert r.returncode == 2 and "teacher='bpee'" in r.stderr and "names no teacher" in r.stderr, (
        r.stderr[-2000:]
    )
    assert (
        len(r.stderr.strip().splitlines()) == 1
        and not (tmp_path / "bad" / "metrics.jsonl").exists()
    )


def test_a_teacher_template_that_cannot_render_the_roles_stops_the_run(tmp_path):
    data = tmp_path / "tools.jsonl"
    rows = [
        {
            "id": f"t{i}",
            "messages": [
                {"role": "user", "content": f"{i}+1="},
                {"role": "tool", "content": "calculator says hi"},
            ],
            "answer": str(i + 1),
        }
        for i in range(8)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = _train(
        "quickstart_opd_xtok.toml",
        tmp_path / "out",
        "--training.steps=1",
        f"--data.path={data}",
        "--data.eval_path=",
        torchrun=False,
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert (
        "distill.teachers[0]" in r.stderr and "cannot render roles ['user', 'tool']" in r.stderr
    ), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
