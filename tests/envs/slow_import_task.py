"""A task whose module takes 2 s to import (tests/envs/test_envs.py): what a fresh worker pays
when it unpickles its first task from a module no worker has imported yet, as a fresh
checkout's imports did under load (compiling every file)."""

import time

time.sleep(2.0)


def square(x: int) -> int:
    return x * x
