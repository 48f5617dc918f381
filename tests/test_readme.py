"""The README stays true: its config reference is the one the code generates."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_reference_matches_code():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from config_reference import readme_block, reference

    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert readme_block(text) == reference(), "run: python scripts/config_reference.py --write"


def test_readme_commands_name_existing_configs():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    for word in text.split():
        if word.startswith("configs/") and word.endswith(".toml"):
            assert os.path.exists(os.path.join(ROOT, word.strip("`,")), ), word


def test_print_config_exits_zero():
    r = subprocess.run([sys.executable, "train.py", "--config", "configs/quickstart.toml", "--print-config"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[rl]" in r.stdout and 'recipe = "rl"' in r.stdout
