"""StopChecker: decides, on the engine loop, whether a request's last sampled token finishes it, and why.

Flow: EngineCore._finish appends each sampled token that reached the host to its request's output_ids, then calls
`check` (no token of the request is in flight then: the next step's requests are advanced after). Only token-level
conditions are checked here (stop_token_ids, EOS, max_new_tokens, the context length), so the loop never decodes
text. Stop strings are matched in the frontend, on the text it decodes anyway for streaming
(managers/request_output.py), which then aborts the request here. Finish reasons follow SGLang:
{"type": "stop", "matched": token id or stop string}, {"type": "length", "length": n}.
"""

from __future__ import annotations

from transformers import AutoTokenizer

from sgl_jax_lora.managers.req import Req


def eos_token_ids(tokenizer_path: str, config_eos_ids: tuple[int, ...]) -> frozenset[int]:
    """The model config's EOS ids and the tokenizer's (read once at startup; the tokenizer is not kept)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    eos = set(config_eos_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return frozenset(eos)


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
