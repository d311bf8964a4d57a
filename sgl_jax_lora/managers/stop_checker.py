"""StopChecker: decides, on the engine loop, whether a request's last sampled token finishes it, and why.

Flow: EngineCore._finish appends each sampled token that reached the host to its request's output_ids, then calls
`check` (no token of the request is in flight then: the next step's requests are advanced after). Only token-level
conditions are checked here (stop_token_ids, EOS, max_new_tokens, the context length), so the loop never decodes
text. Stop strings are matched in the frontend, on the text it decodes anyway for streaming
(managers/request_output.py), which then aborts the request here. Finish reasons follow SGLang:
{"type": "stop", "matched": token id or stop string}, {"type": "length", "length": n}.

The EOS ids are the model config's and the tokenizer's. The frontend takes the tokenizer's from the tokenizer it
loads anyway (`tokenizer_eos_ids`) and hands it to the engine process, which then never imports transformers (with
torch installed, transformers imports it too: about 2 s of every engine start). An EngineCore built without a
frontend (scripts, tests) loads the tokenizer for it (`eos_token_ids`).
"""

from __future__ import annotations

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.managers.req import Req


def tokenizer_eos_ids(tokenizer) -> tuple[int, ...]:
    """A transformers tokenizer's EOS id as a tuple: (id,), or () where it names none."""
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)


def eos_token_ids(cfg: ModelConfig, tokenizer_eos: tuple[int, ...] | None, tokenizer_path: str) -> frozenset[int]:
    """The model config's EOS ids and the tokenizer's: `tokenizer_eos` as the frontend read it, or (None) read from
    the tokenizer at `tokenizer_path`, loaded for it and not kept."""
    if tokenizer_eos is None:
        from transformers import AutoTokenizer  # noqa: PLC0415 (only an EngineCore built without a frontend needs it)

        tokenizer_eos = tokenizer_eos_ids(AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True))
    return frozenset(cfg.eos_token_ids + tuple(tokenizer_eos))


class StopChecker:
    def __init__(self, eos_ids: frozenset[int]):
        self.eos_token_ids = eos_ids

    def check(self, req: Req, context_length: int) -> dict | None:
        params = req.sampling
        token = req.output_ids[-1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        num_output = len(req.output_ids) + req.num_in_flight  # Req.num_output_tokens, read once per token
        if num_output >= params.max_new_tokens or len(req.input_ids) + num_output >= context_length:
            return {"type": "length", "length": num_output}
        return None
