"""`RewardModelScorer`: a trained reward-model folder (tandem/rl/recipes/reward_model.py writes one)
used as a reward in the RL recipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tandem.models.tokenizer import Tokenizer
from tandem.models.value_head import last_token_scores, load_scalar_model
from tandem.rl.data.preference import tokenize_response

__all__ = ["RewardModelScorer"]


Context = str | list[dict[str, Any]]


class RewardModelScorer:
    """Scores (prompt, completion) texts with a reward-model folder, on one device, no sharding.

    A prompt is a string (one user turn) or a message list; a completion is the
    assistant reply text. Both go through `tokenize_response`, the function the
    trainer's data used, so a pair scored here gets the trainer's numbers.
    """

    def __init__(
        self,
        folder: str,
        device: torch.device | str = "cpu",
        *,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 16,
    ) -> None:
        self.tokenizer = Tokenizer.from_dir(folder)
        self.model = load_scalar_model(folder, device, dtype).eval()
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.pad_id = self.tokenizer.pad_token_id or 0

    @torch.no_grad()
    def score(self, prompts: Sequence[Context], completions: Sequence[str]) -> list[float]:
        """One scalar per (prompt, completion), in order. Batches are formed by length so
        little padding is computed; right padding never changes a score (causal attention)."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        seqs = [
            tokenize_response(p, c, self.tokenizer).input_ids for p, c in zip(prompts, completions)
        ]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        out = [0.0] * len(seqs)
        for b0 in range(0, len(order), self.batch_size):
            idx = order[b0 : b0 + self.batch_size]
            s = max(len(seqs[i]) for i in idx)
            tokens = torch.full((len(idx), s), self.pad_id, dtype=torch.long)
            for row, i in enumerate(idx):
                tokens[row, : len(seqs[i])] = torch.tensor(seqs[i])
            lengths = torch.tensor([len(seqs[i]) for i in idx])
            scores = last_token_scores(self.model(tokens.to(self.device)), lengths)  # [b]
            for i, v in zip(idx, scores.tolist()):
                out[i] = v
        return out
