"""The README and docs stay true: the config reference is the one the code generates, and
the files the front page names exist."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_reference_matches_code():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from config_reference import COMPOSES_END, COMPOSES_START, composes, reference, reference_block

    text = open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8").read()
    assert reference_block(text) == reference(), "run: python scripts/config_reference.py --write"
    # the matrix and rows of what composes equal tandem/rl/config/composes.py's table
    block = reference_block(text, COMPOSES_START, COMPOSES_END)
    assert block == composes(), "run: python scripts/config_reference.py --write"


def test_every_config_key_is_described():
    """Each key's line in its dataclass carries a comment, which docs/config.md shows."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from config_reference import undescribed

    assert undescribed() == [], "add a description comment to each of these keys"


def test_readme_commands_name_existing_files():
    for page in ("README.md", "docs/guide.md", "docs/architecture.md"):
        text = open(os.path.join(ROOT, page), encoding="utf-8").read()
        for word in text.replace("(", " ").replace(")", " ").split():
            word = word.strip("`,.;:")
            if word.startswith(("configs/", "docs/")) and word.endswith((".toml", ".md", ".png")):
                assert os.path.exists(os.path.join(ROOT, word)), (page, word)


def test_print_config_exits_zero():
    r = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/quickstart.toml", "--print-config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "[rl]" in r.stdout and 'recipe = "rl"' in r.stdout


def test_every_environment_variable_is_listed():
    """Each ``TANDEM_*`` variable the code or the scripts read is in docs/config.md's
    "Environment variables" section (the one place they are documented)."""
    import re
    from pathlib import Path

    text = open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8").read()
    section = text.split("## Environment variables", 1)[1]
    read = set()
    for path in [*Path(ROOT, "tandem").rglob("*.py"), Path(ROOT, "train.py")]:
        read |= set(re.findall(r"[\"'](TANDEM_[A-Z_]+)[\"']", path.read_text()))
    for path in Path(ROOT, "scripts").rglob("*"):
        if path.is_file() and path.suffix in ("", ".sh", ".sbatch"):
            read |= set(re.findall(r"\$\{?(TANDEM_[A-Z_]+)", path.read_text()))
    assert len(read) >= 12, read  # the scan finds the Slurm settings and the fault drills
    assert sorted(v for v in read if f"`{v}" not in section) == []


def test_readme_speed_figures_are_in_the_performance_log():
    """Every figure of the README's Speed section (a decimal or a ratio, ranges whole) appears,
    as written, in docs/performance.md, where the bench command that printed it is."""
    import re

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    speed = readme.split("\n## Speed\n", 1)[1].split("\n## ", 1)[0]
    log = open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8").read()
    tokens = re.findall(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x?", speed)
    figures = [f for f in tokens if "." in f or f.endswith("x")]
    assert len(figures) >= 4, speed  # the section still quotes figures
    missing = [f for f in figures if f not in log]
    assert not missing, f"README speed figures not in docs/performance.md: {missing}"
