"""Test setup: 8 fake CPU devices for sharding tests (must be set before jax is imported)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
