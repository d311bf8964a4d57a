"""lora/module_settings.py: an adapter config's targeted modules, ranks and alphas over the base model's paths,
its own regular expressions matched in a child process bounded in time, so a pattern that backtracks for ever is
refused without stalling the server's process."""

from __future__ import annotations

import threading

import pytest

from sgl_jax_lora.lora import module_settings as settings_module
from sgl_jax_lora.lora import peft_targets
from sgl_jax_lora.lora.module_settings import module_settings
from sgl_jax_lora.lora.peft_config import LoRAAdapterError, parse_peft_config

PATHS = [
    f"model.layers.{i}.{part}" for i in range(12) for part in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj")
]
# (?:[^z]|[^z])*z: two ways to match each character, and no "z" in any path: 2**n tries on an n-character path
BACKTRACKING = r"(?:[^z]|[^z])*z|.*\.(q_proj|v_proj)"


def test_a_configs_own_patterns_give_in_the_child_what_peft_rules_give_in_process():
    raw = {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": r".*\.(q_proj|up_proj)",
        "exclude_modules": r".*layers\.3\..*",
        "rank_pattern": {r"layers\.1\.self_attn\.q_proj": 4},
        "alpha_pattern": {"up_proj": 2},
    }
    config = parse_peft_config("a", raw)
    assert config.has_client_patterns
    children_before = settings_module._settings_in_child.cache_info().misses
    settings = module_settings("a", config, PATHS)
    assert settings_module._settings_in_child.cache_info().misses == children_before + 1  # it ran in a child
    assert settings == peft_targets.settings_of(config.pattern_fields(), PATHS)
    assert settings["model.layers.1.self_attn.q_proj"] == (4, 16.0)
    assert settings["model.layers.0.mlp.up_proj"] == (8, 2.0)
    assert "model.layers.3.self_attn.q_proj" not in settings and "model.layers.0.self_attn.v_proj" not in settings


def test_short_names_are_matched_in_process():
    config = parse_peft_config("a", {"r": 4, "lora_alpha": 8, "target_modules": ["v_proj"], "layers_to_transform": 2})
    assert not config.has_client_patterns
    children_before = settings_module._settings_in_child.cache_info().misses
    assert module_settings("a", config, PATHS) == {"model.layers.2.self_attn.v_proj": (4, 8.0)}
    assert settings_module._settings_in_child.cache_info().misses == children_before


@pytest.mark.parametrize("field", ["target_modules", "rank_pattern"])
def test_a_pattern_that_backtracks_for_ever_is_refused_while_the_process_runs_on(field):
    raw = {"r": 4, "lora_alpha": 8, "target_modules": BACKTRACKING}
    if field == "rank_pattern":
        alone = r"(?:[^z]|[^z])*z"  # no quick alternative to end the search
        raw = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "rank_pattern": {alone: 2}}
    config = parse_peft_config("slow", raw)
    outcome: list[BaseException] = []

    def match() -> None:
        try:
            module_settings("slow", config, PATHS)
        except LoRAAdapterError as e:
            outcome.append(e)

    worker = threading.Thread(target=match)
    worker.start()
    ticks = 0
    while worker.is_alive():  # this thread runs while the pattern is matched (in process, it would hold the GIL)
        ticks += 1
        worker.join(0.001)
    assert ticks > 10
    assert len(outcome) == 1
    message = str(outcome[0])
    assert "adapter 'slow'" in message and f"took over {settings_module.PATTERN_MATCH_CPU_S} s of CPU" in message
    assert "simplify them" in message
    with pytest.raises(LoRAAdapterError, match="took over"):  # the same config again: refused from memory
        hits = settings_module._settings_in_child.cache_info().hits
        module_settings("slow", config, PATHS)
    assert settings_module._settings_in_child.cache_info().hits == hits + 1


def test_a_child_a_busy_host_kept_past_the_wall_time_is_not_remembered(monkeypatch):
    """Its CPU limit refuses a pattern for good; the wall-time limit, which a busy host may hit for a benign one, does
    not: the next load of the same config tries again."""
    config = parse_peft_config("busy", {"r": 4, "lora_alpha": 8, "target_modules": r".*\.v_proj"})
    paths = ["model.layers.0.self_attn.v_proj", "model.layers.0.busy_marker"]
    monkeypatch.setattr(settings_module, "PATTERN_MATCH_WALL_S", 0.001)
    with pytest.raises(LoRAAdapterError, match=r"did not finish within 0.001 s \(the host is busy\); load it again"):
        module_settings("busy", config, paths)
    monkeypatch.setattr(settings_module, "PATTERN_MATCH_WALL_S", 20.0)
    assert module_settings("busy", config, paths) == {"model.layers.0.self_attn.v_proj": (4, 8.0)}


def test_a_child_that_cannot_run_is_an_adapter_error(monkeypatch):
    monkeypatch.setattr(settings_module.sys, "executable", "/nonexistent/python")
    config = parse_peft_config("nochild", {"r": 4, "lora_alpha": 8, "target_modules": r".*\.q_proj"})
    with pytest.raises(LoRAAdapterError, match="could not be matched in a child process"):
        module_settings("nochild", config, ["model.layers.7.self_attn.q_proj.not_cached"])
