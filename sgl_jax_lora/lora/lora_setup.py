"""LoRASetup: what the engine decides about LoRA before the model is built.

Flow: EngineCore (with --enable-lora) -> LoRASetup(args): parse --lora-paths, validate those adapters from
their configs and tensor headers, fix the pool's max rank (--max-lora-rank, else the largest initial rank,
else 16) and the covered modules (--lora-target-modules, else all seven projections), pick the backend
-> `spec` goes to the model (LoRALinear buffers) -> `build_lora_manager(setup, runner)` (managers/lora_manager.py)
registers the initial adapters (pinned ones take their device slot).
Adapters given as tensors (load from memory, or an update's new version) have no directory to re-read: `from_memory`
validates them and keeps the host copy here, and `load` gives it to the host cache (LoRAManager's) from here.

Where it sits: the top of the lora package, below the models it shapes; EngineCore, the multi-host runners and
followers (distributed/) and the LoRAManager (managers/lora_manager.py) read it.
"""

from __future__ import annotations

import json
import os

from jax.sharding import Mesh

from sgl_jax_lora.lora.adapter import (
    AdapterSummary,
    LoRAAdapter,
    adapter_from_tensors,
    inspect_peft_adapter,
    load_peft_adapter,
    targeted_modules,
)
from sgl_jax_lora.lora.backend import make_lora_backend
from sgl_jax_lora.lora.lora_linear import LoRAModelSpec
from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.peft_config import CONFIG_FILE, adapter_error, parse_peft_config
from sgl_jax_lora.lora.target_shapes import LORA_TARGET_MODULES, LORA_TARGETS, LoRATargetShapes
from sgl_jax_lora.lora.tensor_file import map_tensor_files
from sgl_jax_lora.server_args import ServerArgs, parse_lora_path_spec

DEFAULT_MAX_LORA_RANK = 16


class LoRASetup:
    def __init__(self, args: ServerArgs, model_path: str, mesh: Mesh):
        self.args = args
        with open(os.path.join(model_path, "config.json")) as f:
            self.target_shapes = LoRATargetShapes.from_hf_config(json.load(f))
        self.target_modules = _target_modules(args.lora_target_modules)
        # entries parsed and names unique: ServerArgs checked them (server_args_checks.py)
        self.initial_refs = [LoRARef(**parse_lora_path_spec(spec)) for spec in args.lora_paths or []]
        self.loader_max_rank: int | None = args.max_lora_rank
        self.in_memory: dict[str, tuple[LoRAAdapter, dict]] = {}  # lora_id -> (host adapter, its config dict)
        initial_ranks = [self.inspect(ref).rank for ref in self.initial_refs]
        self.max_rank = args.max_lora_rank or max(initial_ranks, default=DEFAULT_MAX_LORA_RANK)
        self.loader_max_rank = self.max_rank
        packed = frozenset(name for name, (parts, _) in LORA_TARGETS.items() if set(parts) & self.target_modules)
        self.spec = LoRAModelSpec(
            num_slots=args.max_loras_per_batch + 1,
            max_rank=self.max_rank,
            backend=make_lora_backend(args.lora_backend, mesh, args.lora_fused_gemm_min_tokens),
            target_modules=packed,
        )

    def load(self, ref: LoRARef) -> LoRAAdapter:
        """The adapter's weights: its host copy if it came from memory (kept here, there being no file to read
        again), else read from its directory (confined to --lora-allowed-dirs for client loads)."""
        if ref.lora_id in self.in_memory:
            return self.in_memory[ref.lora_id][0]
        return load_peft_adapter(
            ref.lora_name, ref.lora_path, self.target_shapes, self.loader_max_rank, self._allowed_dirs(ref)
        )

    def inspect(self, ref: LoRARef) -> AdapterSummary:
        if ref.lora_id in self.in_memory:
            adapter = self.in_memory[ref.lora_id][0]
            return AdapterSummary(
                ref.lora_name, ref.lora_path, adapter.rank, adapter.target_modules, frozenset(adapter.weights)
            )
        return inspect_peft_adapter(
            ref.lora_name, ref.lora_path, self.target_shapes, self.loader_max_rank, self._allowed_dirs(ref)
        )

    def _allowed_dirs(self, ref: LoRARef) -> list[str] | None:
        """Adapters loaded by clients read only inside --lora-allowed-dirs; the operator's --lora-paths anywhere."""
        return list(self.args.lora_allowed_dirs or []) if ref.confined else None

    def from_memory(
        self,
        ref: LoRARef,
        tensors_paths: list[str],
        config: dict | None,
        checked_finite: bool = False,
        replaces: LoRARef | None = None,
    ) -> LoRAAdapter:
        """Validate a TensorFile's tensors + adapter_config.json fields and keep the host adapter for `ref.lora_id`
        (`checked_finite`: the frontend already refused NaN and Inf as it wrote the files). An update (`replaces`:
        the current version) without a config keeps that version's, and must then hold every module it has."""
        kept_config = config is None
        if kept_config:
            config = self.config_of(replaces)
        adapter = adapter_from_tensors(
            ref.lora_name,
            map_tensor_files(ref.lora_name, tensors_paths),
            config,
            self.target_shapes,
            self.max_rank,
            path=ref.lora_path,
            checked_finite=checked_finite,
        )
        if kept_config and replaces is not None:
            self._refuse_partial_update(ref.lora_name, replaces, adapter)
        self.in_memory[ref.lora_id] = (adapter, config)
        return adapter

    def match_config(self, name: str, config: dict) -> None:
        """A tensors load's config matched against the model (adapter.targeted_modules) ahead of the load, on a
        worker thread, so that the load on the engine loop finds the match in module_settings' cache: a config's own
        regular expressions run in a child process for up to 2 s of CPU. Raises what the match raises."""
        targeted_modules(name, parse_peft_config(name, config), self.target_shapes)

    def _refuse_partial_update(self, name: str, current: LoRARef, update: LoRAAdapter) -> None:
        """An update under the current config that leaves out modules the current version has (a module of any one
        layer) would serve them as zero, silently: refused, naming how many and one of them."""
        missing = sorted(self.inspect(current).modules - set(update.weights))
        if missing:
            raise adapter_error(
                name,
                f"the update leaves out {len(missing)} module(s) the current version has (e.g. layer "
                f"{missing[0][0]} {missing[0][1]}), which would serve as zero",
                "send every module's tensors, or send a config whose target_modules names only those sent",
            )

    def config_of(self, ref: LoRARef) -> dict:
        """The adapter_config.json fields of a registered adapter (an update keeps them unless it gives new ones)."""
        if ref.lora_id in self.in_memory:
            return self.in_memory[ref.lora_id][1]
        try:
            with open(os.path.join(ref.lora_path, CONFIG_FILE), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise adapter_error(
                ref.lora_name, f"cannot re-read its {CONFIG_FILE} ({e})", "pass the config with the update"
            ) from e

    def forget(self, lora_id: str) -> None:
        self.in_memory.pop(lora_id, None)

    @property
    def covered_modules(self) -> frozenset[str]:
        """The HF modules the device buffers cover (every part of each packed linear the spec targets)."""
        return frozenset(m for name in self.spec.target_modules for m in LORA_TARGETS[name][0])


def _target_modules(requested: list[str] | None) -> frozenset[str]:
    if not requested:
        return frozenset(LORA_TARGET_MODULES)
    unknown = sorted(set(requested) - set(LORA_TARGET_MODULES))
    if unknown:
        raise ValueError(f"--lora-target-modules {unknown} are not supported; choose among {list(LORA_TARGET_MODULES)}")
    return frozenset(requested)
