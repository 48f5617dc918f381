"""LoRA: a frozen base plus trainable low-rank adapters, always computed unmerged.

A targeted projection ``y = x W^T + b`` becomes ``y = x W^T + b + (s * (x A^T)) B^T`` with
``A [r, in]``, ``B [out, r]`` and ``s = alpha / r`` (Hu et al. 2021, arXiv:2106.09685);
``B`` starts at zero, so a fresh adapter changes nothing. The update and the generator both
run this same forward (the generation copy is this module with the adapters' values
moved in), so no merged weight ever exists during a run and ``rl.exact`` compares like with
like; `merge_state` folds the adapters in only for the exported ``hf/`` folder.

Applied from outside, like tensor parallelism: `apply_lora` swaps targeted ``nn.Linear``
modules for `LoraLinear` (a subclass that keeps the base's ``weight`` / ``bias`` under
their own names and adds ``lora_A`` / ``lora_B`` children, PEFT's names) and grouped experts
for `LoraGroupedExperts` (one adapter per expert and projection: ``w1_lora_A [E, r, D]``,
``w1_lora_B [E, I, r]``, ...). The model classes are not edited; parallel/ shards the
adapters (tandem/parallel/lora.py) and models/ never sees a process group.

Adapters are switched off together by `adapters_disabled`: the frozen base is then the
reference model of KL terms and DPO, with no second copy in memory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.grouped_gemm import grouped_mm
from tandem.kernels.lora_linear import lora_linear, use_fused_lora
from tandem.models.moe import GroupedExperts

# A target name -> the module paths inside a block it adapts (absent ones are skipped: a
# dense block has no ``moe``, an MoE block no ``feed_forward``, a shared expert is optional).
TARGETS: dict[str, tuple[str, ...]] = {
    "q": ("attention.wq",),
    "k": ("attention.wk",),
    "v": ("attention.wv",),
    "o": ("attention.wo",),
    "gate": ("feed_forward.w1", "moe.shared_experts.w1"),
    "up": ("feed_forward.w3", "moe.shared_experts.w3"),
    "down": ("feed_forward.w2", "moe.shared_experts.w2"),
    "experts": ("moe.experts",),
}
ADAPTER = re.compile(r"(\.lora_[AB]\.weight|\.w[123]_lora_[AB])$")  # an adapter's parameter name
EXPERT_PROJ = ("w1", "w2", "w3")


def is_adapter(name: str) -> bool:
    """Whether a parameter / state-dict name is an adapter's (wrapper prefixes allowed)."""
    return ADAPTER.search(name) is not None


def base_name(name: str) -> str:
    """The base weight an adapter name belongs to (``...wq.lora_A.weight`` -> ``...wq.weight``,
    ``...experts.w1_lora_B`` -> ``...experts.w1``)."""
    m = ADAPTER.search(name)
    if m is None:
        raise KeyError(f"{name!r} is not an adapter name")
    tail = m.group(1)
    return name[: m.start()] + (".weight" if tail.startswith(".lora") else "." + tail[1:3])


@dataclass(frozen=True)
class LoraSpec:
    """What `apply_lora` does: the rank, ``alpha`` (scale ``alpha / rank``), dropout on the
    adapters' input (training forwards only), the target names (`TARGETS`) and other
    modules left trainable (a reward model's new score head)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    trainable: tuple[str, ...] = ()
    base_model: str | None = None  # where the base came from (recorded in an exported adapter's
    # config)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraLinear(nn.Linear):
    """``nn.Linear`` (frozen ``weight`` / ``bias``) plus ``lora_B(s * lora_A(drop(x)))``.

    A subclass, so tensor-parallel styles and isinstance checks still see a linear layer;
    the base keeps its parameter names, the adapters add PEFT's ``lora_A.weight`` /
    ``lora_B.weight``. ``lora_enabled = False`` gives the base alone."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float = 0.0) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        dev = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=dev)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=dev)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scale = scale
        self.lora_enabled = True

    def base_weight(self) -> torch.Tensor:
        """The base weight the forward multiplies by (a subclass may round it:
        tandem/models/quant_linear.py)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.base_weight()
        if not self.lora_enabled:
            return F.linear(x, w, self.bias)  # [..., out]
        if isinstance(self.lora_dropout, nn.Identity) and use_fused_lora(x):  # forced only, so far
            return lora_linear(x, w, self.bias, self.lora_A.weight, self.lora_B.weight, self.scale)
        y = F.linear(x, w, self.bias)  # [..., out]
        # [..., r] -> [..., out]
        return y + self.lora_B(self.lora_A(self.lora_dropout(x)) * self.scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scale={self.scale:g}"


class LoraGroupedExperts(GroupedExperts):
    """`GroupedExperts` with one adapter per expert and projection: for ``w1 [E, I, D]``,
    ``w1_lora_A [E, r, D]`` and ``w1_lora_B [E, I, r]`` (likewise w3; ``w2 [E, D, I]`` gets
    ``[E, r, I]`` and ``[E, D, r]``), each run through the same grouped GEMM as its base."""

    def __init__(self, base: GroupedExperts, rank: int, scale: float) -> None:
        nn.Module.__init__(self)
        dev = base.w1.device
        for proj in EXPERT_PROJ:
            w = getattr(base, proj)  # [E, out, in]
            setattr(self, proj, w)
            e, out, inp = w.shape
            setattr(self, f"{proj}_lora_A", nn.Parameter(torch.zeros(e, rank, inp, device=dev)))
            setattr(self, f"{proj}_lora_B", nn.Parameter(torch.zeros(e, out, rank, device=dev)))
        self.scale = scale
        self.lora_enabled = True

    def _proj(self, x: torch.Tensor, proj: str, offsets: torch.Tensor) -> torch.Tensor:
        y = grouped_mm(x, getattr(self, proj).transpose(1, 2), offsets)  # [R, out]
        if not self.lora_enabled:
            return y
        a, b = getattr(self, f"{proj}_lora_A"), getattr(self, f"{proj}_lora_B")
        low = grouped_mm(x, a.transpose(1, 2), offsets) * self.scale  # [R, r]
        return y + grouped_mm(low, b.transpose(1, 2), offsets)

    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # [R, I]
        gate, up = self._proj(x_sorted, "w1", offsets), self._proj(x_sorted, "w3", offsets)
        return self._proj(F.silu(gate) * up, "w2", offsets)  # [R, D]


def _blocks(model: nn.Module) -> dict[str, nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no transformer blocks (``layers``) to adapt")
    return dict(layers.items())


def apply_lora(model: nn.Module, spec: LoraSpec) -> int:
    """Swap the targeted modules of every block of ``model`` (a Transformer, a pipeline stage,
    a scalar-head model) for their LoRA versions, in place, and freeze everything but the
    adapters and ``spec.trainable``; returns how many modules were adapted. Call it on the
    meta device before parallelizing; a ValueError when no module matches."""
    unknown = sorted(set(spec.targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown} (choose from {sorted(TARGETS)})")
    n = 0
    for block in _blocks(model).values():
        for target in spec.targets:
            for path in TARGETS[target]:
                parent_path, _, leaf = path.rpartition(".")
                try:
                    parent = block.get_submodule(parent_path)
                except AttributeError:
                    continue
                base = getattr(parent, leaf, None)
                if isinstance(base, (LoraLinear, LoraGroupedExperts)) or base is None:
                    continue
                if isinstance(base, GroupedExperts):
                    setattr(parent, leaf, LoraGroupedExperts(base, spec.rank, spec.scale))
                elif isinstance(base, nn.Linear):
                    setattr(parent, leaf, LoraLinear(base, spec.rank, spec.scale, spec.dropout))
                else:
                    continue
                n += 1
    if n == 0 and _blocks(model):
        raise ValueError(f"LoRA targets {list(spec.targets)} match no module of this model")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or any(name.startswith(t + ".") for t in spec.trainable))
    model.lora_spec = spec  # read back by `lora_spec_of` (exports)
    return n


def lora_spec_of(model: nn.Module) -> LoraSpec | None:
    """The `LoraSpec` `apply_lora` gave ``model`` (None: no adapters)."""
    return getattr(model, "lora_spec", None)


def lora_modules(model: nn.Module) -> list[nn.Module]:
    """The adapted modules of ``model`` (empty: no LoRA)."""
    return [m for m in model.modules() if isinstance(m, (LoraLinear, LoraGroupedExperts))]


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, (LoraLinear, LoraGroupedExperts)) for m in model.modules())


@contextmanager
def adapters_disabled(models: nn.Module | Iterable[nn.Module]) -> Iterator[None]:
    """Every adapter of ``models`` off inside the block: the frozen base computes alone."""
    mods = [
        m
        for model in ([models] if isinstance(models, nn.Module) else models)
        for m in lora_modules(model)
    ]
    before = [m.lora_enabled for m in mods]
    for m in mods:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, on in zip(mods, before, strict=True):
            m.lora_enabled = on


def adapter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every adapter parameter of ``model`` (a meta model is enough)."""
    return {n: tuple(p.shape) for n, p in model.named_parameters() if is_adapter(n)}


def init_adapter_state(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Fresh adapters, CPU fp32: each ``A`` uniform in ``+-1/sqrt(in_features)`` (PEFT's default,
    kaiming-uniform with a = sqrt(5)) from a generator seeded by ``seed`` and drawn in name
    order, each ``B`` zero (so the adapted model starts as the base)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if "lora_A" in name:
            bound = 1.0 / math.sqrt(shape[-1])
            out[name] = (torch.rand(shape, generator=gen) * 2 - 1) * bound
        else:
            out[name] = torch.zeros(shape)
    return out


def delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * B @ A`` in fp32 (per expert for 3-D adapters): the weight the adapter adds."""
    return scale * torch.matmul(b.float(), a.float())


def merge_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A full state dict with adapters -> the base's names, each adapted weight ``W + s B A``
    (summed in fp32, stored in W's dtype); the adapter entries are dropped."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for name in state:
        if is_adapter(name) and ("lora_A" in name):
            target = base_name(name)
            b = state[name.replace("lora_A", "lora_B")]
            w = out[target]
            out[target] = (w.float() + delta(state[name], b, scale)).to(w.dtype)
    return out
