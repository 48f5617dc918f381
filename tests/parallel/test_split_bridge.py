"""The split world's weight bridge (tandem/parallel/split.py) on 3 CPU ranks: two senders'
Shard(0) shards reach the receiver whole and bit for bit, in several bucketed collectives with
every sender sending its own shard; the checksum equals one computed from the full tensors, and
a single flipped bit on the receiver fails the check on every rank."""

import os

import pytest

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


@pytest.mark.slow
def test_a_lora_sync_moves_the_adapters_alone_and_the_checksum_catches_a_corrupted_one(tmp_path):
    """`BridgeCopy` with adapters (FSDP2 trainers): the first sync moves the whole model, the
    next ones only the adapters (bytes = their size; the generator's base tensors stay the same
    objects), after which the copy's logits equal the trainers' whole model's bit for bit and
    the checksum equals one computed from the whole adapters; one flipped bit of one adapter on
    the receiver fails the check (BridgeMismatch, exit 10 in a run) on every rank."""
    every = launch_worker(os.path.join(HERE, "bridge_lora_worker.py"), 3, tmp_path / "out.pt")
    receiver = every[0]
    assert receiver["first"]["split/sync_gb"] * 1e9 == receiver["model_bytes"]
    assert receiver["second"]["split/sync_gb"] * 1e9 == receiver["adapter_bytes"]
    assert receiver["adapter_bytes"] < receiver["model_bytes"] / 4
    assert receiver["equal"] and receiver["base_kept"]
    sums = {r["second"]["split/sync_checksum"] for r in every}
    assert sums == {float(receiver["reference_checksum"])}
    for r in every:
        assert r["mismatch"] == (
            "weight sync: 1 tensor(s) differ between the senders and the receivers after the "
            "move (checksum), first 'layers.1.feed_forward.w2.lora_B.weight'"
        )
