"""The layout rules of docs/architecture.md, checked on the source itself.

- one import root: every package of the project's code lives under tandem/;
- models/, parallel/ and kernels/ never import rl/ (models know nothing of
  parallelism, parallel/ nothing of RL);
- no file over 600 lines and no function over 80 lines, except those listed
  here with the reason;
- the recipes never compare an algorithm's name: what a loop must build for an
  algorithm is a capability declared at registration (tandem/rl/runtime/registry.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tandem"
SOURCES = [p for d in (PKG, ROOT / "bench", ROOT / "scripts") for p in d.rglob("*.py")]
SOURCES += [ROOT / "train.py"]
LONG_FILES: dict[str, str] = {}  # path -> why it may exceed 600 lines
LONG_FUNCTIONS: dict[str, str] = {}  # "path:function" -> why it may exceed 80 lines


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_models_parallel_and_kernels_never_import_rl():
    bad = []
    for folder in ("models", "parallel", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            bad += [f"{path.relative_to(ROOT)} imports {m}" for m in _imports(path) if m == "rl" or m.startswith("rl.")]
    assert not bad, bad


def test_models_never_import_parallel():
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in (ROOT / "models").rglob("*.py")
           for m in _imports(p) if m == "parallel" or m.startswith("parallel.")]
    assert not bad, bad


def test_only_entry_points_reach_the_recipes():
    """train.py runs them; tandem-sweep asks the registry for a recipe's held-out metric."""
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in (ROOT / "rl").rglob("*.py")
           if not {"recipes", "sweep"} & set(p.parts) for m in _imports(p) if m.startswith("tandem.rl.recipes")]
    assert not bad, bad


def test_worker_side_packages_do_not_import_torch_at_module_level():
    """Reward functions, environments and pools run in worker processes that start fast."""
    bad = []
    for folder in ("rewards", "envs", "workers"):
        for path in (PKG / "rl" / folder).glob("*.py"):
            if path.name == "reward_model.py":  # the reward-model scorer runs in the trainer
                continue
            top = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
            names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
            bad += [f"{path.relative_to(ROOT)} imports {m}" for m in names if m.split(".")[0] == "torch"]
    assert not bad, bad


def test_no_file_over_600_lines_and_no_function_over_80_without_a_reason():
    long_files, long_functions = [], []
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        if text.count("\n") > 600 and rel not in LONG_FILES:
            long_files.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80 and f"{rel}:{node.name}" not in LONG_FUNCTIONS:
                    long_functions.append(f"{rel}:{node.name}: {n} lines")
    assert not long_files and not long_functions, long_files + long_functions


def test_recipes_never_compare_algorithm_names():
    """``r.advantage == "gae"`` and the like: the registry's capabilities say what a name needs."""
    keys = r"(advantage|policy_loss|aggregation|kl_estimator|loss)"
    pattern = re.compile(rf"\.{keys}\s*(==|!=|\bin\b)|(==|!=)\s*\w+\.{keys}\b")
    bad = []
    for path in (PKG / "rl" / "recipes").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, bad
