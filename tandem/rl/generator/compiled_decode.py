"""A pure decode step compiled with torch.compile (inductor), over the decode mirror's rows.

The eager mirror step (decode_mirror.py) writes each layer's new K/V into the mirror's rows
and the pool inside the model's forward, then attends over the rows. Compiled, those writes
would be input mutations of one large tensor, which the compiler functionalises into a copy
of the whole buffer per layer. So the compiled step is a pure function: every layer reads
its rows (positions before the new token, never written in the graph), scores the new
token's own key beside them, and the graph returns the logits with the step's new K/V
``[L, 2, B, Hkv, D]``; after it, two eager stores put them into the rows and into the pool
(one ``index_put_`` and one ``index_copy_`` for all layers).

Shapes are dynamic (``torch.compile(dynamic=True)``): one graph serves every batch size and
attended width, because on the CPU each static shape costs 10-20 s of compilation (measured
on the bench.generate model, 2 cores) and ran no faster than the dynamic graph there (6.07
against 6.15 ms for 32 rows). The batch is padded to at least 2 rows and the width rounded
up to a multiple of ``WIDTH_STEP`` so a size of 1 never specialises a second graph. A
padded row has token 0 at position 0 and no key in its rows; it attends to its own key
only, and its outputs are dropped.

The compiled graph computes what the eager step computes up to floating-point rounding
(inductor fuses the norms and the softmax in its own order: logits within 1e-5, not bit for
bit), so it never runs under ``rl.exact`` (whose generator takes the batch-invariant page
path anyway), nor for MoE models (their routing record is a side effect of the forward).

Whether to compile (``advanced.compile_decode = "auto"``) is `choose`'s call: compiling pays
when the run's decode steps times the step time it saves exceeds the compile time. Both are
measured once per machine and model shape on a synthetic step and kept in
``$XDG_CACHE_HOME/tandem/compile_decode.json`` (``~/.cache`` without it); a run too short to
repay even the cheapest compile is not measured at all.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem import device as seam
from tandem.models.transformer import Transformer
from tandem.rl.generator.decode_mirror import DecodeMirror, MirrorStep
from tandem.rl.generator.sampler import hash_uniforms

WIDTH_STEP = 64  # the attended width is rounded up to a multiple of this
log = logging.getLogger(__name__)


class _RowsAttention:
    """The traced attention backend: the layer's mirror rows plus the new token's key, with
    the new K/V collected for the caller (nothing is written)."""

    def __init__(self, rows: torch.Tensor, bias: torch.Tensor, scale: float) -> None:
        self.rows, self.bias, self.scale = rows, bias, scale  # [L, 2, B, Hkv, W, D], [B, 1, 1, W]
        self.new: list[torch.Tensor] = []

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q [1, B, Hq, D], k/v [1, B, Hkv, D]
        _, b, hq, d = q.shape
        hkv = k.shape[2]
        g = hq // hkv
        self.new.append(torch.stack((k[0], v[0])))  # [2, B, Hkv, D]
        qg = q[0].view(b, hkv, g, d)  # [B, Hkv, G, D]
        keys, values = self.rows[layer_id, 0], self.rows[layer_id, 1]  # [B, Hkv, W, D]
        old = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale + self.bias  # [B, Hkv, G, W]
        own = (qg * k[0][:, :, None]).sum(-1, keepdim=True) * self.scale  # [B, Hkv, G, 1]
        probs = torch.cat((old, own), dim=-1).softmax(dim=-1)
        out = torch.matmul(probs[..., :-1], values) + probs[..., -1:] * v[0][:, :, None]
        return out.reshape(1, b, hq, d)  # [1, B, Hq, D]


def _step(
    model: Transformer,
    tokens: torch.Tensor,  # [B] long
    rope: torch.Tensor,  # [B] long, the RoPE positions
    lengths: torch.Tensor,  # [B] long, keys already in the rows (the new token's index)
    rows: torch.Tensor,  # [L, 2, B, Hkv, W, D]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    width = rows.shape[-2]
    keep = torch.arange(width, device=rows.device)[None, :] < lengths[:, None]  # [B, W]
    bias = torch.zeros(keep.shape, dtype=rows.dtype, device=rows.device)
    bias = bias.masked_fill(~keep, float("-inf"))[:, None, None, :]  # [B, 1, 1, W]
    attn = _RowsAttention(rows, bias, scale)
    hidden = model(tokens[None], positions=rope[None], attn=attn, return_hidden=True)[0]
    logits = model.output(hidden).float()  # [B, V]
    return logits, torch.stack(attn.new)  # [B, V], [L, 2, B, Hkv, D]


def supported(model: Transformer) -> str | None:
    """Why this model's decode step is not compiled (None: it is)."""
    layers = getattr(model, "layers", {})
    if any(hasattr(block, "moe") for block in layers.values()):
        return "an MoE model (its routing record is a side effect of the forward)"
    if model.tok_embeddings is None or model.output is None:
        return "a pipeline stage"
    return None


class CompiledDecode:
    """Pure decode steps of one generator on its `DecodeMirror`, through one compiled graph."""

    def __init__(self, model: Transformer, mirror: DecodeMirror, scale: float) -> None:
        self.model, self.mirror, self.scale = model, mirror, scale
        self.fn = compiled_step()
        self.steps = 0  # steps served
        self.failed = False  # the first compile failed: eager from then on
        self.shapes: set[tuple[int, int]] = set()  # (rows, width) run so far

    def logits(self, step: MirrorStep, rope: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, V] of a planned mirror step (its new K/V then stored in the rows and the
        pool), or None when the padded step would outgrow the pool's size or the step does not
        compile."""
        if self.failed:
            return None
        n = step.tokens.shape[0]
        size = max(n, 2)
        width = -(-max(step.width - 1, 2) // WIDTH_STEP) * WIDTH_STEP
        m = self.mirror
        if not m.reserve(size, width):
            return None
        tokens, lengths = step.tokens, step.positions
        if size > n:
            zeros = tokens.new_zeros(size - n)
            tokens, rope, lengths = (torch.cat((t, zeros)) for t in (tokens, rope, lengths))
        rows = m.rows[:, :, :size, :, :width]  # [L, 2, B, Hkv, W, D], a view
        try:
            logits, new = self.fn(self.model, tokens, rope, lengths, rows, self.scale)
        except Exception as e:  # noqa: BLE001 - a model the compiler cannot take runs eagerly
            if self.steps:
                raise  # it compiled and ran before: a real error
            log.warning("compile_decode: the step did not compile (%s); it runs eagerly", e)
            self.failed = True
            return None
        self.shapes.add((size, width))
        self.steps += 1
        m.store(step, new[:, :, :n])
        return logits[:n]


_COMPILED = None
_UNIFORMS = None


def compiled_step():  # noqa: ANN201 - torch.compile's wrapper
    """`_step` under torch.compile, one wrapper per process (its graphs serve every generator
    whose model has the same structure)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_step, dynamic=True, fullgraph=True)
    return _COMPILED


def compiled_uniforms() -> Callable[[torch.Tensor, int], torch.Tensor]:
    """The sampler's `hash_uniforms` under torch.compile (one fused loop instead of a dozen
    int64 passes over [rows, V]): integer arithmetic and exact conversions, so the same bits,
    and the sampled tokens do not change (the log after it stays eager). If its first call
    does not compile, it is `hash_uniforms` from then on."""
    global _UNIFORMS
    if _UNIFORMS is None:
        _UNIFORMS = torch.compile(hash_uniforms, dynamic=True, fullgraph=True)
    fn, ran = _UNIFORMS, False

    def uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
        nonlocal fn, ran
        try:
            out = fn(keys, vocab_size)
        except Exception as e:  # noqa: BLE001 - no compiler here: the eager hash, same bits
            if ran:
                raise
            log.warning("compile_decode: the noise did not compile (%s); it runs eagerly", e)
            fn = hash_uniforms
            out = fn(keys, vocab_size)
        ran = True
        return out

    return uniforms


# ---- whether to compile: the process's setting and the once-per-machine measurement --------

MIN_COMPILE_S = 10.0  # no compile of the step took less here (tiny model, warm inductor cache)
MOST_SAVED = 0.75  # a compiled step saves at most this share of the eager one (GEMMs remain)
_mode: bool | str = False  # set_compile_decode: the process's choice
_decode_steps = 0  # ... and the decode steps it expects
_decided: dict[tuple[str, int, Path], bool] = {}  # `choose`'s answers in this process


def set_compile_decode(mode: bool | str, decode_steps: int = 0) -> None:
    """Every generator of this process without a ``compile_decode`` setting of its own takes
    ``mode`` (True, False or "auto"); ``decode_steps``: the decode steps the run expects (auto
    compiles only when they repay the compile). The trainer sets it from
    ``advanced.compile_decode``; a process that never calls this does not compile."""
    global _mode, _decode_steps
    if mode not in (True, False, "auto"):
        raise ValueError(f"compile_decode: expected true, false or 'auto', got {mode!r}")
    _mode, _decode_steps = mode, decode_steps


def process_choice() -> tuple[bool | str, int]:
    """(mode, decode steps) as `set_compile_decode` left them."""
    return _mode, _decode_steps


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem" / "compile_decode.json"


def machine_key(model: Transformer) -> str:
    """The measurement's key: CPU model, cores, threads, torch, and the model's shape."""
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    a, p = model.args, next(model.parameters())
    shape = (
        f"L{a.num_layers} d{a.hidden_size} ffn{a.intermediate_size} q{a.num_heads} "
        f"kv{a.num_kv_heads} hd{a.head_dim} V{a.vocab_size} {p.dtype} {p.device.type}"
    )
    return f"{cpu} x{os.cpu_count()} t{torch.get_num_threads()} torch {torch.__version__} {shape}"


def choose(
    model: Transformer,
    scale: float,
    decode_steps: int,
    path: Path | None = None,
    rows: int = 32,
    width: int = 256,
) -> bool:
    """Auto: whether compiling the decode step repays its compile over ``decode_steps`` steps.

    A measurement already on disk for this machine and model decides. Without one, the eager
    step is timed on a synthetic batch (``rows`` x ``width``); if even a compiled step saving
    `MOST_SAVED` of it could not repay `MIN_COMPILE_S`, no compile happens and nothing is
    kept. Otherwise the step is compiled and timed, and the measurement kept."""
    path = path or cache_path()
    key = machine_key(model)
    if (key, decode_steps, path) in _decided:
        return _decided[key, decode_steps, path]
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if entry is None:
        eager_ms = _time_step(_step, model, scale, rows, width)
        if MOST_SAVED * eager_ms * decode_steps / 1e3 < MIN_COMPILE_S:
            _decided[key, decode_steps, path] = False
            return False
        t0 = time.perf_counter()
        try:
            _time_step(compiled_step(), model, scale, rows, width, repeat=1)  # compiles
        except Exception as e:  # noqa: BLE001 - a model the compiler cannot take runs eagerly
            log.warning("compile_decode: the step did not compile (%s); it runs eagerly", e)
            _decided[key, decode_steps, path] = False
            return False
        compile_s = time.perf_counter() - t0  # (and two steps)
        compiled_ms = _time_step(compiled_step(), model, scale, rows, width)
        eager_ms = min(eager_ms, _time_step(_step, model, scale, rows, width))
        entry = dict(eager_ms=eager_ms, compiled_ms=compiled_ms, compile_s=compile_s)
        known[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        os.replace(tmp, path)
    saved_s = (entry["eager_ms"] - entry["compiled_ms"]) * decode_steps / 1e3
    _decided[key, decode_steps, path] = saved_s > entry["compile_s"]
    return _decided[key, decode_steps, path]


@torch.inference_mode()
def _time_step(
    fn: Callable, model: Transformer, scale: float, rows: int, width: int, repeat: int = 5
) -> float:
    """The fastest of ``repeat`` synthetic decode steps of ``fn`` after one untimed, in ms."""
    a, p = model.args, next(model.parameters())
    kv = p.new_zeros(a.num_layers, 2, rows, a.num_kv_heads, width, a.head_dim)
    ids = torch.zeros(rows, dtype=torch.long, device=p.device)
    lengths = torch.full_like(ids, width // 2)
    fn(model, ids, lengths, lengths, kv, scale)  # first-call costs (and the compile)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(model, ids, lengths, lengths, kv, scale)
        seam.synchronize(p.device)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3
