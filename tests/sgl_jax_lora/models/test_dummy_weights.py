"""Dummy weights (`--load-format dummy`, models/weight_loader.py) are a function of the seed alone: two Python
processes with different string-hash seeds (PYTHONHASHSEED) make the same weights, so `--random-seed` reproduces
a run; and the weights differ from one parameter to the next."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.tiny_configs import TINY_LLAMA_CONFIG

# Prints {parameter path: sha256 of its dummy value} as JSON.
DIGESTS = """
import hashlib, json, sys
import jax.numpy as jnp
import numpy as np
from flax import nnx
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.models.weight_loader import load_model_state

cfg = ModelConfig.from_dict(json.loads(sys.argv[1]))
_, state = load_model_state(cfg, 1, 16, jnp.float32, make_mesh(1), None, load_format="dummy", seed=3)
print(json.dumps({"/".join(map(str, path)): hashlib.sha256(np.asarray(v.get_value()).tobytes()).hexdigest()
                  for path, v in nnx.to_flat_state(state)}))
"""


def dummy_digests(hash_seed: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=REPO_ROOT)
    done = subprocess.run(
        [sys.executable, "-c", DIGESTS, json.dumps(TINY_LLAMA_CONFIG)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_processes_make_the_same_dummy_weights():
    first, second = dummy_digests("1"), dummy_digests("2")
    assert first == second
    kernels = {path: digest for path, digest in first.items() if path.endswith("kernel")}
    assert len(kernels) >= 4 and len(set(kernels.values())) == len(kernels)  # each parameter draws its own values
