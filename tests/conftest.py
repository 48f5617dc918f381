"""Suite-wide setup: Triton kernels run under the CPU interpreter when there is no GPU,
the tests marked ``slurm`` (they start a local Slurm) run only with ``--slurm``, and
``--device TYPE`` names the device the conformance suite (``pytest -m conformance``, the checks
that judge a port: docs/devices.md) runs on, the CPU by default.

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
    parser.addoption(
        "--device",
        default="cpu",
        help="device type of the tests that take the `device` fixture (the conformance suite, "
        "pytest -m conformance): cpu (the reference, default) or the accelerator torch reports "
        "here (cuda, npu, xpu, openreg, ...)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slurm"):
        return
    skip = pytest.mark.skip(reason="starts a local Slurm and takes minutes: run with --slurm")
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device ``--device`` names: in-process tests put their models and tensors on it; tests
    that launch train.py or torchrun take it as a check only, since the ranks they start take the
    accelerator torch reports (tandem/device.py pick_device), which must then be ``--device``."""
    kind = request.config.getoption("--device")
    if kind == "cpu":
        return torch.device("cpu")
    from tandem import device as seam

    here = seam.accelerator_type()
    if kind != here:
        raise pytest.UsageError(f"--device {kind}: torch reports {here!r} as the accelerator here")
    return torch.device(kind, 0)


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
