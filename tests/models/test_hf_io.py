"""HF folder I/O: bit-exact export/reload, sharding, tied heads, transformers compatibility."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.models import (
    Tokenizer,
    hf_to_tandem,
    load_args,
    load_model,
    read_hf_state_dict,
    save_hf,
    tandem_to_hf,
)
from tandem.models.hf import INDEX_FILE, tensor_files
from tests.fixtures import hf_reference, write_hf_model


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=5)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("tied"), "qwen3-tied", seed=6)


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def _tokens() -> torch.Tensor:
    return torch.randint(0, 360, (2, 20), generator=torch.Generator().manual_seed(0))


def test_export_reload_single_file_bit_exact(qwen2_dir, tmp_path):
    model = load_model(qwen2_dir)
    out = save_hf(model.state_dict(), model.args, tmp_path / "export")
    assert (out / "model.safetensors").is_file() and not (out / INDEX_FILE).exists()
    _assert_same_tensors(read_hf_state_dict(out), read_hf_state_dict(qwen2_dir))
    _assert_same_tensors(load_model(out).state_dict(), model.state_dict())


def test_export_sharded_bit_exact_and_transformers_loads(qwen2_dir, tmp_path):
    model = load_model(qwen2_dir)
    tok = Tokenizer.from_dir(qwen2_dir)
    out = save_hf(
        model.state_dict(), model.args, tmp_path / "sharded", tokenizer=tok, max_shard_bytes=60_000
    )
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and all((out / f).is_file() for f in files)
    total = sum(t.numel() * t.element_size() for t in read_hf_state_dict(out).values())
    assert index["metadata"]["total_size"] == total
    for f in files:  # each shard within the limit unless it holds a single tensor
        shard = load_file(out / f)
        assert (
            len(shard) == 1 or sum(t.numel() * t.element_size() for t in shard.values()) <= 60_000
        )
    _assert_same_tensors(read_hf_state_dict(out), read_hf_state_dict(qwen2_dir))
    _assert_same_tensors(load_model(out).state_dict(), model.state_dict())
    # transformers reads our folder (config, index, tokenizer) and computes the same logits.
    x = _tokens()
    with torch.no_grad():
        theirs = hf_reference(out)(x).logits
        original = hf_reference(qwen2_dir)(x).logits
        assert torch.equal(theirs, original)
        assert (model(x) - theirs).abs().max().item() <= 1e-4
    # (AutoTokenizer is not used here: transformers 5 forces its own Qwen2Tokenizer
    # pipeline onto model_type "qwen2" folders, replacing the char tokenizer's.)
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast.from_pretrained(out)
    assert hf_tok.encode("hi <|im_end|>\n") == tok.encode("hi <|im_end|>\n")


def test_tied_export_omits_lm_head_and_transformers_reties(tied_dir, tmp_path):
    assert "lm_head.weight" not in tensor_files(tied_dir)
    model = load_model(tied_dir)
    assert model.output.weight is model.tok_embeddings.weight
    out = save_hf(model.state_dict(), model.args, tmp_path / "tied")
    saved = read_hf_state_dict(out)
    assert "lm_head.weight" not in saved
    _assert_same_tensors(saved, read_hf_state_dict(tied_dir))
    ref = hf_reference(out)
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert (model(_tokens()) - ref(_tokens()).logits).abs().max().item() <= 1e-4


def test_transformers_autotokenizer_reads_our_tokenizer_files(tied_dir, tmp_path):
    from transformers import AutoTokenizer

    model, tok = load_model(tied_dir), Tokenizer.from_dir(tied_dir)
    out = save_hf(model.state_dict(), model.args, tmp_path / "tok", tokenizer=tok)
    hf_tok = AutoTokenizer.from_pretrained(out)
    text = "hi <|im_end|> <think>x</think>\n"
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf_tok.eos_token_id == 355 and hf_tok.pad_token_id == 353
    msgs = [{"role": "user", "content": "2+2?"}]
    assert hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(msgs, add_generation_prompt=True)
    )


def test_tied_name_mapping_both_ways():
    from tandem.models import get_flavor

    args = get_flavor("debug-qwen3")
    emb = torch.randn(3, 2)
    sd = hf_to_tandem({"model.embed_tokens.weight": emb}, args)
    assert sd["output.weight"] is emb and sd["tok_embeddings.weight"] is emb
    sd = hf_to_tandem({"model.embed_tokens.weight": emb, "lm_head.weight": emb.clone()}, args)
    assert sd["output.weight"] is emb
    # A last pipeline stage holds only the head: the export recovers the embedding from it.
    assert tandem_to_hf({"output.weight": emb}, args) == {"model.embed_tokens.weight": emb}
    untied = get_flavor("tiny-qwen2")
    assert tandem_to_hf({"output.weight": emb}, untied) == {"lm_head.weight": emb}
    assert hf_to_tandem({"model.layers.3.mlp.gate_proj.weight": emb}, untied) == {
        "layers.3.feed_forward.w1.weight": emb
    }


def test_bf16_export(qwen2_dir, tmp_path):
    model = load_model(qwen2_dir)
    out = save_hf(model.state_dict(), model.args, tmp_path / "bf16", dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    saved = read_hf_state_dict(out)
    assert all(t.dtype == torch.bfloat16 for t in saved.values())
    reloaded = load_model(out, dtype=torch.bfloat16)
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    _assert_same_tensors(reloaded.state_dict(), expected)
    assert reloaded.rope.inv_freq.dtype == torch.float32


def test_config_and_generation_config(qwen2_dir, tmp_path):
    from transformers import AutoConfig

    llama_dir = write_hf_model(tmp_path / "llama", "llama3", seed=0)
    model = load_model(llama_dir)
    out = save_hf(
        model.state_dict(), model.args, tmp_path / "out", tokenizer=Tokenizer.from_dir(llama_dir)
    )
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "llama" and cfg.num_key_value_heads == 2 and cfg.head_dim == 16
    rope = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert rope["original_max_position_embeddings"] == 64
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [355, 353] and gen["pad_token_id"] == 353
    assert load_args(out) == model.args
    with torch.no_grad():  # llama3-scaled RoPE survives our config.json
        assert torch.equal(
            hf_reference(out)(_tokens()).logits, hf_reference(llama_dir)(_tokens()).logits
        )


def test_load_args_merges_generation_config_eos(qwen2_dir, tmp_path):
    model = load_model(qwen2_dir)
    args = model.args.replace(eos_token_id=[355])
    out = save_hf(model.state_dict(), args, tmp_path / "out")
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = [355, 7]
    (out / "generation_config.json").write_text(json.dumps(gen))
    assert load_args(out).eos_token_id == [355, 7]


def test_unknown_and_missing_tensors_are_clear_errors(qwen2_dir, tmp_path):
    model = load_model(qwen2_dir)
    out = save_hf(model.state_dict(), model.args, tmp_path / "bad", max_shard_bytes=60_000)
    index = json.loads((out / INDEX_FILE).read_text())
    save_file({"model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(out / "extra.safetensors"))
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = "extra.safetensors"
    (out / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.extra\.weight.*extra\.safetensors"):
        load_model(out)
    del index["weight_map"]["model.layers.0.mlp.extra.weight"]
    del index["weight_map"]["model.layers.1.self_attn.k_proj.bias"]
    (out / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(out)
    with pytest.raises(KeyError, match="no Hugging Face counterpart"):
        tandem_to_hf({"layers.0.bogus.weight": torch.zeros(1)}, model.args)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_args(tmp_path / "nowhere")
