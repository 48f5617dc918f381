"""The OpenAI-compatible endpoint over Tandem's own generator, with exact token ids.

- ``protocol.py``: request parsing and validation (a `BadRequest` names the field) and the
  OpenAI response shapes, with vLLM's extensions (``prompt_token_ids``, ``return_token_ids``,
  ``ignore_eos``); pure Python.
- ``sessions.py``: an episode as a session: its canonical token sequence, the append-only
  check, and the training samples it yields; pure Python.
- ``engine.py``: `ServingEngine`, the generator loop that serves requests step by step on
  every rank of a generation group (the leader decides, the group applies the same commands).
- ``http.py``: the aiohttp server in a thread of the leader (routes, bearer key, errors).
``tandem/serve.py`` (``tandem-serve``) serves an HF folder with the same engine; the RL
recipe's ``env.kind = "http"`` rollout (tandem/rl/rollout/episodes.py) serves a harness with it.
Nothing here knows RL: it drives the generator beside it. docs/serving.md.
"""
