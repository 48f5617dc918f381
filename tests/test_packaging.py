"""One import root: the wheel installs `tandem` and nothing else at the top of site-packages,
and Tandem imports beside transformers and Hugging Face's `kernels` package (which
transformers imports) from any folder, installed editable or not."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = (
    "import transformers; transformers.LlamaConfig; "
    "import kernels; kernels.CUDAProperties; "
    "import tandem, tandem.rl.recipes, tandem.models, tandem.parallel.reshard, "
    "tandem.kernels.paged_attention; import tandem.generate, tandem.sweep.__main__, "
    "tandem.report.__main__, tandem.diagnose; print(tandem.__file__)"
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, **extra}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src")
    # built from a copy: setuptools writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT / "tandem", src / "tandem", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = out.glob("tandem_rl-*.whl")
    return path


def test_the_wheel_installs_only_tandem(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"tandem"}, sorted(top)
    assert len(dist_info) == 1
    # the sandbox's supervisor and the code harness are read as files at run time
    assert {"tandem/rl/sandbox/supervisor.py", "tandem/rl/rewards/code_harness.py"} <= set(names)
    entry_points = configparser.ConfigParser()
    entry_points.read_string(
        zipfile.ZipFile(wheel).read(f"{next(iter(dist_info))}/entry_points.txt").decode()
    )
    assert dict(entry_points["console_scripts"]) == {
        "tandem-generate": "tandem.generate:main",
        "tandem-sweep": "tandem.sweep.__main__:main",
        "tandem-report": "tandem.report.__main__:main",
        "tandem-diagnose": "tandem.diagnose:main",
        "tandem-serve": "tandem.serve:main",
        "tandem-k8s": "tandem.k8s.cli:main",
        "tandem-envd": "tandem.rl.workers.envd:main",
    }


def test_a_non_editable_install_leaves_transformers_and_kernels_intact(wheel: Path, tmp_path: Path):
    """The wheel's files in a site folder of their own, ahead of the environment's: Hugging
    Face's `kernels` must still be the one imported, and Tandem must work from there."""
    site = tmp_path / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(site),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(
        p.name for p in site.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin"
    ) == ["tandem"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", IMPORTS],
        cwd=elsewhere,
        env=_clean_env(PYTHONPATH=str(site)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str(site / "tandem" / "__init__.py")


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_the_installed_package_imports_beside_transformers(where: str, tmp_path: Path):
    """The README's `pip install -e` install, from the repository root and from another folder."""
    try:
        metadata.distribution("tandem-rl")
    except metadata.PackageNotFoundError:
        pytest.fail(
            "tandem-rl is not installed in this environment: run the README's pip install -e"
        )
    cwd = ROOT if where == "root" else tmp_path
    r = subprocess.run(
        [sys.executable, "-c", IMPORTS],
        cwd=cwd,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str(ROOT / "tandem" / "__init__.py")


def test_console_scripts_run(tmp_path: Path):
    bindir = Path(sys.executable).parent
    tools = (
        "tandem-generate",
        "tandem-sweep",
        "tandem-report",
        "tandem-diagnose",
        "tandem-serve",
        "tandem-k8s",
        "tandem-envd",
    )
    for tool in tools:
        exe = bindir / tool
        assert exe.exists(), f"{exe}: not installed (pip install -e . makes it)"
        r = subprocess.run(
            [str(exe), "--help"],
            cwd=tmp_path,
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0 and f"usage: {tool}" in r.stdout, (
            tool,
            r.stdout[-500:],
            r.stderr[-2000:],
        )
