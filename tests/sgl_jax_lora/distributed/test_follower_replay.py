"""sgl_jax_lora/distributed/follower.py's replay loop: `Follower.run` takes node 0's commands from its receiver
thread in the order sent, calls each command's handler, counts them for /health, and returns at Shutdown; a
command it has no handler for and a lost coordination service both end the replay with an error that names them.

The channel is the real CommandChannel over tests/support/coordination.py's in-memory store; the commands are
really encoded and decoded; the follower's model runner is left out (its handlers are replaced by recorders), since
these tests are about the loop.
"""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax_lora.distributed import channel as channel_module
from sgl_jax_lora.distributed.channel import CommandChannel
from sgl_jax_lora.distributed.commands import KVPages, PromptLogprobs, Ready, Shutdown, WriteLoRASlot, encode
from sgl_jax_lora.distributed.follower import Follower, FollowerStatus
from tests.support.coordination import FakeCoordinationClient


class NoCompiles:
    count = 0


@pytest.fixture
def client(monkeypatch) -> FakeCoordinationClient:
    fake = FakeCoordinationClient()
    monkeypatch.setattr(channel_module, "coordination_client", lambda: fake)
    return fake


def replaying_follower(replayed: list) -> Follower:
    """A Follower whose handlers record the commands they get (no ModelRunner behind them)."""
    follower = Follower.__new__(Follower)
    follower.channel = CommandChannel(1, 2)
    follower.status = FollowerStatus(node_rank=1)
    follower.compile_counter = NoCompiles()
    follower.handlers = {kind: replayed.append for kind in (PromptLogprobs, WriteLoRASlot, Ready)}
    return follower


def test_commands_are_replayed_in_order_until_shutdown(client):
    leader, replayed = CommandChannel(0, 2), []
    follower = replaying_follower(replayed)
    sent = [PromptLogprobs(np.arange(3, dtype=np.int32), n) for n in range(40)]
    sent.insert(20, WriteLoRASlot(3, [np.ones((2, 4), np.float32)]))
    for command in [*sent, Ready(), Shutdown()]:
        leader.send(encode(command))
    follower.run()
    assert [type(c).__name__ for c in replayed] == [type(c).__name__ for c in sent] + ["Ready"]
    assert [c.num_top for c in replayed if isinstance(c, PromptLogprobs)] == list(range(40))
    np.testing.assert_array_equal(replayed[20].values[0], np.ones((2, 4), np.float32))
    assert follower.status.num_commands == len(sent) + 2  # Ready and Shutdown counted too


def test_a_command_without_a_handler_ends_the_replay_naming_it(client):
    leader = CommandChannel(0, 2)
    follower = replaying_follower([])
    leader.send(encode(KVPages(7)))  # only valid at start-up, before the replay
    with pytest.raises(RuntimeError, match="node 1: unexpected command KVPages"):
        follower.run()


def test_a_lost_node_0_ends_the_replay_with_the_receivers_error(client):
    replayed = []
    follower = replaying_follower(replayed)
    client.errors_before_get = [RuntimeError("UNAVAILABLE: failed to connect")]  # the receiver thread's first get
    with pytest.raises(ConnectionError, match=r"node 1: lost node 0's coordination service .*command 0"):
        follower.run()
    assert replayed == []
