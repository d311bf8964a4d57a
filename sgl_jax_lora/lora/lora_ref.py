"""LoRARef: the identity of one registered adapter, shared by the frontend and the engine.

Flow: `--lora-paths` / `/load_lora_adapter` create a LoRARef -> LoRARegistry (frontend, name -> ref) ->
requests carry `lora_id` over IPC -> HostAdapterCache and device slots are keyed by `lora_id`.

`lora_id` is a fresh UUID per registration, so a cache keyed by adapter (host cache, device slots,
prefix cache) never mistakes an adapter reloaded under the same name or path for its predecessor.
"""

from __future__ import annotations

import dataclasses
import time
import uuid


@dataclasses.dataclass(frozen=True)
class LoRARef:
    lora_name: str  # user-facing name (a bare path when the adapter was given as PATH)
    lora_path: str  # PEFT adapter directory; "" for weights that came from memory (tensors, an update)
    pinned: bool = False  # never evicted from the device (and host) tiers
    confined: bool = False  # loaded by a client: every file it opens must lie inside --lora-allowed-dirs
    lora_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    version: int = 1  # 1 at load; each update_lora_adapter registers the next version under a new lora_id
    # when the name was first registered (Unix seconds; an update keeps it): the OpenAI model card's `created`
    created: int = dataclasses.field(default_factory=lambda: int(time.time()), compare=False)
