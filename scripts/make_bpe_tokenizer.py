"""Write the byte-level BPE tokenizer of the cross-tokenizer quickstart's teacher.

    python scripts/make_bpe_tokenizer.py outputs/bpe-tokenizer

A tokenizer of another family than the student's built-in character one:
byte-level BPE (GPT-2's byte alphabet, so any text encodes), merges learned
here, offline, from synthetic addition text and the template's words (digits
stay single tokens: a model that sees "17" as one token has to learn each sum
by heart and generalises worse to held-out problems), Llama-3-style special tokens and a
Llama-3-style chat template that trims message text and accepts only system, user and assistant
turns. The teacher trained on it (configs/quickstart_opd_xtok.toml says how) is
assets/xtok-teacher, which carries a copy of the files written here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RawTokenizer

SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system = 'You are a helpful assistant.' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['user', 'assistant'] %}\n"
    "        {{- raise_exception('only user and assistant turns after the system turn, got ' + "
    "message['role']) }}\n    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


def corpus() -> list[str]:
    """Every a+b=c of the quickstart task (a, b <= 19) and the template's words, a few times."""
    lines = [f"{a}+{b}={a + b}" for a in range(20) for b in range(20)]
    lines += ["system", "user", "assistant", "You are a helpful assistant."]
    return lines * 4


def build(out: str | Path, vocab_size: int = 320) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = RawTokenizer(models.BPE())
    # digits one by one (as Qwen2's and DeepSeek-V3's pre-tokenizers split them), words with their
    # space
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(r"\p{N}| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+"), behavior="isolated"
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIALS],
        show_progress=False,
    )
    raw.train_from_iterator(corpus(), trainer)
    raw.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos = [raw.token_to_id("<|eot_id|>"), raw.token_to_id("<|end_of_text|>")]
    gen = {
        "bos_token_id": raw.token_to_id("<|begin_of_text|>"),
        "eos_token_id": eos,
        "pad_token_id": eos[1],
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/make_bpe_tokenizer.py OUT_DIR")
    print(f"wrote {build(sys.argv[1])}")
