"""Tandem models: decoder-only transformers, attention backends, HF I/O, tokenizer.

Nothing here knows about parallelism or RL.
"""

from tandem.models.args import ModelArgs
from tandem.models.attention import (
    CausalAttention,
    DocumentAttention,
    SegmentAttention,
    positions_from_doc_ids,
)
from tandem.models.flavors import FLAVORS, get_flavor
from tandem.models.hf import (
    hf_to_tandem,
    load_args,
    load_model,
    read_hf_state_dict,
    save_hf,
    tandem_to_hf,
)
from tandem.models.tokenizer import Tokenizer, build_char_tokenizer
from tandem.models.transformer import Transformer

__all__ = [
    "FLAVORS",
    "CausalAttention",
    "DocumentAttention",
    "SegmentAttention",
    "ModelArgs",
    "Tokenizer",
    "Transformer",
    "build_char_tokenizer",
    "get_flavor",
    "hf_to_tandem",
    "load_args",
    "load_model",
    "positions_from_doc_ids",
    "read_hf_state_dict",
    "save_hf",
    "tandem_to_hf",
]
