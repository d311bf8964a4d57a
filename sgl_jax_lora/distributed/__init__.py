"""Multi-host serving over JAX's multi-controller runtime (`jax.distributed`); see docs/multi_host.md.

Flow: every node calls `runtime.initialize` -> node 0 runs today's stack (HTTP, tokenizer, scheduler, EngineCore)
with a `LeaderModelRunner` that sends each device action as a typed command (`commands.py`) over the coordination
service's key-value store (`channel.py`) before running it -> nodes 1..N-1 run `follower.py`, which replays the
commands on the same `ModelRunner` code, so every node runs the same compiled programs in lockstep.
"""
