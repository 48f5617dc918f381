"""The split world's weight bridge (tandem/parallel/split.py) on 3 CPU ranks: two senders'
Shard(0) shards reach the receiver whole and bit for bit, in several bucketed collectives with
every sender sending its own shard; the checksum equals one computed from the full tensors, and
a single flipped bit on the receiver fails the check on every rank."""

import os

from tests.fixtures import launch_worker

HERE = os.path.dirname(os.path.abspath(__file__))


def test_the_bridge_moves_every_shard_bit_for_bit_and_the_checksum_catches_one_bit(tmp_path):
    every = launch_worker(os.path.join(HERE, "bridge_worker.py"), 3, tmp_path / "out.pt")
    receiver, senders = every[0], every[1:]
    assert receiver["equal"] and receiver["got"] == ["a.weight", "b.bias"]
    assert receiver["collectives"] > 1  # buckets of 64 bytes: the move took several collectives
    assert all(s["sent"] > 0 and s["got"] == [] for s in senders)  # no single sender
    assert receiver["sent"] == 0
    assert {r["checksum"] for r in every} == {receiver["reference"]}
    for r in every:
        assert r["mismatch"] == (
            "weight sync: 1 tensor(s) differ between the senders and the "
            "receivers after the move (checksum), first 'a.weight'"
        )
