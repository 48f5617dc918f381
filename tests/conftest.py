"""Suite-wide setup: Triton kernels run under the CPU interpreter when there is no GPU,
and the tests marked ``slurm`` (they start a local Slurm) run only with ``--slurm``.

TRITON_INTERPRET must be set before triton is first imported, so it is set here,
before any test module loads.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slurm",
        action="store_true",
        default=False,
        help="run the tests marked slurm: they start a one-node Slurm on this machine (minutes)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slurm"):
        return
    skip = pytest.mark.skip(reason="starts a local Slurm and takes minutes: run with --slurm")
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch):
    """``kernels("triton" | "torch" | None)``: the process's kernel choice for one test (what
    ``advanced.kernels`` sets, `tandem.kernels.dispatch.set_kernels`), back as it was after."""
    from tandem.kernels import dispatch

    monkeypatch.setattr(dispatch, "_chosen", dispatch.chosen_kernels())
    return dispatch.set_kernels


@pytest.fixture(autouse=True, scope="module")
def no_process_group_left_behind():
    """Every test module starts without a default process group: a module that runs a recipe in
    this process (a world of one it never tears down) must not make the next module's
    ``init_process_group`` fail with "initialize the default process group twice"."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
