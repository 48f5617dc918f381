"""The search-space file of ``tandem-sweep`` and every check that can run before a trial starts.

    [space]                                   # distributions, keyed by config key
    "optimizer.lr" = { log_uniform = [1e-6, 1e-3] }
    "rl.clip_high" = { uniform = [0.2, 0.3] }
    "rl.num_samples" = { int = [4, 16] }
    "rl.advantage" = { choice = ["grpo", "rloo"] }
    [fixed]                                   # overrides every trial gets
    "training.steps" = 40
    [objective]                               # default: the recipe's held-out metric
    metric = "eval/accuracy"                  # any metrics.jsonl key
    mode = "last"                             # or "best" (over the logged steps)
    direction = "maximize"
    [pruner]                                  # optional
    name = "median"                           # or "successive_halving", "none"
    [sampler]                                 # optional
    name = "tpe"                              # or "random"
    seed = 0

A config key is checked the way ``train.py`` checks it: `check_configs` loads
the config with the fixed overrides and with every range end and every choice
of every parameter through ``load_config``, so an unknown key, a value of the
wrong type or one the key's own validation refuses is one line before anything
runs. (A combination only the sampled values reveal is caught when it is
sampled, before its trial starts.)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.rl.config.schema import Config, ConfigError, load_config
from tandem.rl.core.configlib import read_toml
from tandem.sweep import EXIT_USAGE, SweepError

KINDS = ("uniform", "log_uniform", "int", "choice")
# set per trial by the sweep; shared, trials would resume each other's checkpoints
PER_TRIAL = ("job.dump_folder", "checkpoint.folder")


@dataclass(frozen=True)
class Param:
    """One searched config key: a range (uniform, log_uniform, int) or a list of choices."""

    key: str
    kind: str
    values: tuple[Any, ...]  # (low, high) or the choices

    def distribution(self):  # -> optuna.distributions.BaseDistribution (optuna imported lazily)
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "choice":
            return CategoricalDistribution(list(self.values))
        if self.kind == "int":
            return IntDistribution(*self.values)
        return FloatDistribution(*self.values, log=self.kind == "log_uniform")

    def edges(self) -> list[Any]:
        """The values worth validating before any trial: both range ends, or every choice."""
        return list(self.values)


@dataclass
class Objective:
    metric: str
    mode: str = "last"  # last: the value at the last logged step; best: the best over the logged
    # steps
    direction: str = "maximize"


@dataclass
class PrunerSpec:
    name: str = "median"  # median | successive_halving | none
    startup_trials: int = 5  # median: completed trials before any trial is pruned (Optuna's
    # default)
    warmup_steps: int = 0  # median: no pruning before this training step
    min_resource: int = 0  # successive_halving: first rung, in training steps; 0 = Optuna's "auto"
    reduction_factor: int = 3  # successive_halving

    def build(self):  # -> optuna.pruners.BasePruner
        from optuna import pruners

        if self.name == "median":
            return pruners.MedianPruner(
                n_startup_trials=self.startup_trials, n_warmup_steps=self.warmup_steps
            )
        if self.name == "successive_halving":
            return pruners.SuccessiveHalvingPruner(
                min_resource=self.min_resource or "auto", reduction_factor=self.reduction_factor
            )
        return pruners.NopPruner()


@dataclass
class SamplerSpec:
    name: str = "tpe"  # tpe | random
    seed: int = 0
    startup_trials: int = 10  # tpe: random trials before the model is used (Optuna's default)

    def build(self, offset: int):  # -> optuna.samplers.BaseSampler
        """A sampler seeded with ``seed + offset``: a resumed sweep (offset = trials so far) draws
        new parameters rather than repeating the first session's."""
        from optuna import samplers

        if self.name == "random":
            return samplers.RandomSampler(seed=self.seed + offset)
        return samplers.TPESampler(seed=self.seed + offset, n_startup_trials=self.startup_trials)


@dataclass
class Space:
    params: dict[str, Param]
    fixed: dict[str, Any]
    objective: Objective | None  # None: the recipe's default (`resolve_objective`)
    pruner: PrunerSpec = field(default_factory=PrunerSpec)
    sampler: SamplerSpec = field(default_factory=SamplerSpec)

    def overrides(self, values: dict[str, Any]) -> list[str]:
        """``key=text`` overrides for load_config: the fixed keys, then the sampled ``values``."""
        return [f"{k}={override_text(v)}" for k, v in {**self.fixed, **values}.items()]

    def distributions(self) -> dict:
        return {k: p.distribution() for k, p in self.params.items()}

    def canonical(self) -> str:
        """The whole space as one JSON text: a resumed study must have been made with
        the same one."""
        return json.dumps(
            {
                "params": {k: [p.kind, list(p.values)] for k, p in self.params.items()},
                "fixed": self.fixed,
                "objective": asdict(self.objective) if self.objective else None,
                "pruner": asdict(self.pruner),
                "sampler": asdict(self.sampler),
            },
            sort_keys=True,
        )


def override_text(value: Any) -> str:
    """A TOML value as the command-line text configlib parses back to it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value)  # a TOML array for lists; a dict is refused by the key's own check
    return str(value)


# ---------------------------------------------------------------- parsing


def _fail(path: str, msg: str) -> SweepError:
    return SweepError(EXIT_USAGE, f"{path}: {msg}")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _param(path: str, key: str, spec: Any) -> Param:
    where = f'[space] "{key}"'
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise _fail(
            path,
            f"{where}: give exactly one of {', '.join(KINDS)}, e.g. "
            f"{{ log_uniform = [1e-6, 1e-3] }} (got {spec!r})",
        )
    kind, values = next(iter(spec.items()))
    if not isinstance(values, list):
        raise _fail(path, f"{where}: {kind} takes a list, got {values!r}")
    if kind == "choice":
        if not values:
            raise _fail(path, f"{where}: choice needs at least one value")
        bad = [v for v in values if not isinstance(v, (str, int, float, bool))]
        if bad:
            raise _fail(
                path, f"{where}: choices must be strings, numbers or booleans, got {bad[0]!r}"
            )
        if len(set(map(repr, values))) != len(values):
            raise _fail(path, f"{where}: choice lists a value twice: {values!r}")
        return Param(key, kind, tuple(values))
    if len(values) != 2 or not all(_number(v) for v in values):
        raise _fail(path, f"{where}: {kind} takes [low, high] (two finite numbers), got {values!r}")
    low, high = values
    if kind == "int" and not all(isinstance(v, int) for v in values):
        raise _fail(path, f"{where}: int takes two integers, got {values!r}")
    if low >= high:
        raise _fail(
            path,
            f"{where}: {kind} range {values!r} is inverted or empty; write [low, "
            "high] with low < high",
        )
    if kind == "log_uniform" and low <= 0:
        raise _fail(path, f"{where}: log_uniform needs low > 0, got {values!r}")
    return Param(key, kind, (float(low), float(high)) if kind != "int" else (low, high))


def _is_spec(value: Any) -> bool:
    """A [space] value that is a distribution (good or bad), not a table of further keys."""
    if not isinstance(value, dict) or not value:
        return True
    return any(k in KINDS for k in value) or not all(isinstance(v, dict) for v in value.values())


def _flatten(
    table: dict[str, Any], leaf: Callable[[Any], bool], prefix: str = ""
) -> dict[str, Any]:
    """Unquoted dotted keys (optimizer.lr = ...) parse as nested tables; make them
    "optimizer.lr" again."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if leaf(value):
            out[prefix + key] = value
        else:
            out.update(_flatten(value, leaf, f"{prefix}{key}."))
    return out


def _table(
    path: str, data: dict[str, Any], name: str, allowed: dict[str, type | tuple]
) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise _fail(path, f"[{name}] must be a table")
    for key, value in table.items():
        if key not in allowed:
            raise _fail(path, f"[{name}] unknown key {key!r} (known: {', '.join(allowed)})")
        want = allowed[key]
        if isinstance(want, tuple) and all(isinstance(w, str) for w in want):
            if value not in want:
                raise _fail(
                    path, f"[{name}] {key} = {value!r}: choose one of {', '.join(map(repr, want))}"
                )
        elif not isinstance(value, want) or isinstance(value, bool) and want is not bool:
            raise _fail(
                path, f"[{name}] {key}: expected {getattr(want, '__name__', want)}, got {value!r}"
            )
    return table


def load_space(path: str) -> Space:
    """Parse and check the space file (the config keys themselves are checked by
    `check_configs`)."""
    try:
        data = read_toml(path)
    except ConfigError as e:
        raise SweepError(EXIT_USAGE, str(e)) from None
    known = ("space", "fixed", "objective", "pruner", "sampler")
    for name in data:
        if name not in known:
            raise _fail(path, f"unknown table [{name}] (known: {', '.join(known)})")
    space = data.get("space", {})
    if not isinstance(space, dict) or not space:
        raise _fail(
            path,
            '[space] is missing or empty; e.g. [space] "optimizer.lr" = { '
            "log_uniform = [1e-6, 1e-3] }",
        )
    params = {key: _param(path, key, spec) for key, spec in _flatten(space, leaf=_is_spec).items()}
    fixed = data.get("fixed", {})
    if not isinstance(fixed, dict):
        raise _fail(path, "[fixed] must be a table of config keys")
    fixed = _flatten(fixed, leaf=lambda v: not isinstance(v, dict))
    both = sorted(set(fixed) & set(params))
    if both:
        raise _fail(path, f'"{both[0]}" is both searched ([space]) and fixed ([fixed])')
    for table, keys in (("space", params), ("fixed", fixed)):
        for key in sorted(set(keys) & set(PER_TRIAL)):
            raise _fail(
                path,
                f'[{table}] "{key}": each trial keeps its checkpoints in its own '
                "dump folder under the study, which the sweep sets; a space file "
                "may not",
            )
    objective = None
    if "objective" in data:
        t = _table(
            path,
            data,
            "objective",
            {"metric": str, "mode": ("last", "best"), "direction": ("maximize", "minimize")},
        )
        if not t.get("metric", "").strip():
            raise _fail(
                path, '[objective] metric: required, a metrics.jsonl key such as "eval/accuracy"'
            )
        if "direction" not in t:
            raise _fail(
                path,
                f'[objective] direction: required ("maximize" or "minimize") for {t["metric"]!r}',
            )
        objective = Objective(**t)
    pruner = PrunerSpec(
        **_table(
            path,
            data,
            "pruner",
            {
                "name": ("median", "successive_halving", "none"),
                "startup_trials": int,
                "warmup_steps": int,
                "min_resource": int,
                "reduction_factor": int,
            },
        )
    )
    for key in ("startup_trials", "warmup_steps", "min_resource"):
        if getattr(pruner, key) < 0:
            raise _fail(path, f"[pruner] {key}: must be >= 0, got {getattr(pruner, key)}")
    if pruner.reduction_factor < 2:
        raise _fail(path, f"[pruner] reduction_factor: must be >= 2, got {pruner.reduction_factor}")
    sampler = SamplerSpec(
        **_table(
            path, data, "sampler", {"name": ("tpe", "random"), "seed": int, "startup_trials": int}
        )
    )
    if sampler.seed < 0 or sampler.startup_trials < 0:
        raise _fail(path, "[sampler] seed and startup_trials must be >= 0")
    return Space(params, fixed, objective, pruner, sampler)


def resolve_objective(space: Space, recipe: str, path: str) -> Objective:
    """The space's [objective], or the recipe's held-out metric when it has none."""
    if space.objective is not None:
        return space.objective
    from tandem.rl.recipes import RECIPES

    metric, direction = RECIPES.get(recipe).objective  # the recipe's held-out metric
    return Objective(metric, "last", direction)


# ---------------------------------------------------------------- config checks


def trial_config(
    config_path: str, space: Space, values: dict[str, Any], extra: list[str] = ()
) -> Config:
    """The validated config of one trial (raises ConfigError like train.py would)."""
    return load_config(config_path, [*space.overrides(values), *extra])


def check_configs(config_path: str, space: Space, space_path: str) -> Config:
    """Load the config with the fixed keys, then with each parameter at each of its edges
    (the others at their first), then every parameter at its last edge; returns the first of these
    (the study's base). Any ConfigError becomes one line naming the space entry."""
    if not os.path.isfile(config_path):
        raise SweepError(EXIT_USAGE, f"--config: no such file: {config_path}")
    first = {k: p.edges()[0] for k, p in space.params.items()}
    try:
        base = load_config(config_path, space.overrides({}))
    except ConfigError as e:
        raise _fail(space_path, f"[fixed]: {e}") from None
    folder = base.checkpoint.folder
    if os.path.isabs(folder) or os.path.normpath(folder).split(os.sep)[0] == "..":
        raise SweepError(
            EXIT_USAGE,
            f"--config {config_path}: checkpoint.folder = {folder!r} is "
            "outside the trial's dump folder, so trials would share "
            "checkpoints; give a folder inside it (the default is "
            '"checkpoints")',
        )
    tries = [(k, {**first, k: v}) for k, p in space.params.items() for v in p.edges()]
    tries.append(
        ("every parameter at its last value", {k: p.edges()[-1] for k, p in space.params.items()})
    )
    for what, values in tries:
        try:
            trial_config(config_path, space, values)
        except ConfigError as e:
            shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
            raise _fail(
                space_path,
                f'[space] "{what}": {e} (at {shown})'
                if what in space.params
                else f"[space] {what}: {e} (at {shown})",
            ) from None
    return base
