"""A trainer stand-in for tests/workers/test_worker_signals.py (not a test itself).

Run as ``python -m tests.pool_signal_trainer`` in a session of its own, as
torchrun starts its workers. It installs the preemption handler, says
``installed`` on stdout, waits a moment (the test starts signalling the whole
process group then), starts a RewardPool and an EnvPool, scores a batch and
runs environment tasks while the signals keep coming, and prints one JSON line
with what it saw.
"""

from __future__ import annotations

import json
import sys
import time

import tests.reward_helpers  # noqa: F401  (registers test_slow_len)
from tandem.rl.fault import PreemptionHandler
from tandem.rl.workers.env_pool import EnvPool
from tandem.rl.workers.reward_pool import RewardPool
from tests.reward_helpers import slow_len_reward

COMPLETIONS = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "ggggggg", "hhhhhhhh"]


def main() -> int:
    handler = PreemptionHandler().install()
    print("installed", flush=True)
    time.sleep(0.3)  # the test's signals are arriving by now
    rewards = RewardPool(2, 30.0, rewards=["test_slow_len"])
    envs = EnvPool(2, step_timeout_s=30.0)
    envs.wait_ready()
    reward_pids, env_pids = rewards.worker_pids(), [w.proc.pid for w in envs._workers]
    res = rewards.score([("test_slow_len", 1.0)], COMPLETIONS, [{"sleep": 0.1}] * len(COMPLETIONS))
    tickets = [envs.submit(slow_len_reward, c, {"sleep": 0.1}) for c in COMPLETIONS[:4]]
    outcomes = []
    while len(outcomes) < len(tickets):
        outcomes += envs.poll(None)
    out = {
        "total": res.total,
        "failures": [
            res.errors["test_slow_len"],
            res.timeouts["test_slow_len"],
            res.crashes["test_slow_len"],
        ],
        "reward_pids_kept": rewards.worker_pids() == reward_pids,
        "env": sorted((o.ticket, o.status, o.value, o.attempts) for o in outcomes),
        "env_counts": envs.counts,
        "env_pids_kept": [w.proc.pid for w in envs._workers] == env_pids,
        "trainer_signals": handler.count,
        "trainer_signal": handler.signal_name,
    }
    rewards.close()
    envs.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
