"""Host allocator tuning (tandem/rl/core/system.py)."""

import platform


def test_tune_host_allocator_applies_on_glibc_and_defers_to_the_environment(monkeypatch) -> None:
    from tandem.rl.core.system import tune_host_allocator

    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert tune_host_allocator() is True
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert tune_host_allocator() is False  # the user's own setting wins
