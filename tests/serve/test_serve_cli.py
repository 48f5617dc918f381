"""`tandem-serve` as a user runs it: a process serving an HF folder, queried with the openai client.

The reference is transformers on the same folder: a naive greedy loop (full recompute per
token) and its log-softmax, on tiny random Llama-3, Qwen3 and Qwen3-MoE folders
(tests/fixtures.py, tests/models/test_moe.py). Greedy chat and completions must give the
transformers tokens (token-in and text-in), their log-probs within 1e-4, and the MoE
folder its routed experts per token.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("openai")
from openai import OpenAI  # noqa: E402

from tandem.models.tokenizer import Tokenizer  # noqa: E402
from tests.fixtures import hf_reference, write_hf_model  # noqa: E402
from tests.models.test_moe import write_moe_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAMILIES = ("llama3", "qwen3", "qwen3_moe")


def _start(folder, *flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.serve",
            "--model",
            str(folder),
            "--port",
            "0",
            "--kv-cache-gb",
            "0.01",
            "--device",
            "cpu",  # the transformers reference runs on the CPU
            *flags,
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
    )
    for line in proc.stderr:
        if line.startswith("serving "):
            return proc, line.split(" at ")[1].split()[0]
    proc.wait(timeout=60)
    raise AssertionError(f"tandem-serve exited {proc.returncode} before serving")


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(family)
    folder = (
        write_moe_model(path, family, seed=4)
        if family.endswith("moe")
        else write_hf_model(path, family, seed=1)
    )
    proc, url = _start(folder)
    yield family, folder, url
    proc.terminate()
    assert proc.wait(timeout=60) == 0  # SIGTERM: a clean stop


def _greedy(ref, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
        logp = torch.log_softmax(ref(torch.tensor([seq])).logits[0].float(), -1)
    new = seq[len(ids) :]
    return new, logp[torch.arange(len(ids) - 1, len(seq) - 1), torch.tensor(new)]


def test_greedy_equals_transformers(served):
    family, folder, url = served
    tok, ref = Tokenizer.from_dir(folder), hf_reference(folder)
    client = OpenAI(base_url=url, api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [os.path.basename(folder)]
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = client.chat.completions.create(
        model="m",
        messages=messages,
        temperature=0,
        max_tokens=10,
        logprobs=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    want, want_lp = _greedy(ref, prompt, 10)
    c = chat.choices[0]
    assert chat.prompt_token_ids == prompt and c.token_ids == want and c.finish_reason == "length"
    torch.testing.assert_close(
        torch.tensor([t.logprob for t in c.logprobs.content]), want_lp, atol=1e-4, rtol=0
    )
    for prompt_in in ({"prompt": "The sky is"}, {"prompt": [5, 17, 42, 99]}):
        ids = (
            tok.encode("The sky is")
            if isinstance(prompt_in["prompt"], str)
            else prompt_in["prompt"]
        )
        r = client.completions.create(
            model="m",
            temperature=0,
            max_tokens=8,
            logprobs=1,
            extra_body={"return_token_ids": True, "ignore_eos": True},
            **prompt_in,
        )
        want, want_lp = _greedy(ref, ids, 8)
        assert r.prompt_token_ids == ids and r.choices[0].token_ids == want
        torch.testing.assert_close(
            torch.tensor(r.choices[0].logprobs.token_logprobs), want_lp, atol=1e-4, rtol=0
        )
    experts = getattr(c, "routed_experts", None)
    if family.endswith("moe"):  # per token, per layer: the k experts (null for a dense layer)
        assert len(experts) == 10 and all(
            len(layer) == 2 for layer in experts[0] if layer is not None
        )
    else:
        assert experts is None


def test_bad_flags_are_one_line_and_status_2(tmp_path, capsys, monkeypatch):
    from tandem.serve import main

    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path), "--host", "0.0.0.0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "bearer key" in err and len(err.strip().splitlines()) == 1
    assert main(["--model", str(tmp_path)]) == 4  # no model there
    err = capsys.readouterr().err
    assert err.startswith("error: --model") and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path), "--device", "tpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--device" in err and len(err.strip().splitlines()) == 1
