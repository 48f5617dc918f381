"""Helpers shared by the sandbox tests (tests/sandbox/test_sandbox*.py), not tests
themselves: fast limits, a program that prints its uid, and runs on a plan with some
mechanisms left out. The ``temp_root`` fixture is in tests/workers/conftest.py."""

from __future__ import annotations

from tandem.rl.sandbox import (
    SandboxLimits,
    SandboxResult,
    processes_of_uid,
    run_python,
    sandbox_capabilities,
)

FAST = SandboxLimits(cpu_time_s=1, wall_time_s=3.0)
PRINT_UID = "import os, sys\nprint('uid', os.getuid(), flush=True)\n"


def _uid_of(res: SandboxResult) -> int:
    first = res.stdout.splitlines()[0].split()
    assert first[0] == "uid", res
    return int(first[1])


def _assert_no_processes_left(res: SandboxResult) -> None:
    if sandbox_capabilities().privilege_drop:
        assert processes_of_uid(_uid_of(res)) == []


# What each plan leaves out: "no-namespaces" is the fallback of a machine that refuses
# namespaces and cgroups (uid, rlimits and sweeps only), "no-cgroup" one without a
# memory cgroup it may create.
PLANS = {"default": (), "no-cgroup": ("cgroup",), "no-namespaces": ("cgroup", "ipc", "mount")}


def _run(code: str, plan: str, **kwargs) -> SandboxResult:
    """run_python on this machine's plan, or on a plan with some mechanisms left out."""
    if plan == "default":
        return run_python(code, **kwargs)
    from tandem.rl.sandbox import _plan_without, start_python

    return start_python(code, _plan=_plan_without(*PLANS[plan]), **kwargs).wait()
