"""StopChecker: decides after each sampled token whether a request is finished, and why.

Flow: EngineCore._finish puts each sampled token in its request's output, then calls `check`. Finish reasons follow
SGLang: {"type": "stop", "matched": token id or stop string}, {"type": "length", "length": n}.
Stop strings are searched in the decoded tail of the output; the frontend trims the text at the match.
"""

from __future__ import annotations

from transformers import AutoTokenizer

from sgl_jax_lora.managers.req import Req


class StopChecker:
    def __init__(self, tokenizer_path: str, eos_token_ids: tuple[int, ...]):
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        eos = set(eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    def check(self, req: Req, context_length: int) -> dict | None:
        params = req.sampling
        token = req.output_ids[-1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        if params.stop:
            tail_len = max(len(s) for s in params.stop) + 8
            tail = self.tokenizer.decode(req.output_ids[-tail_len:], skip_special_tokens=params.skip_special_tokens)
            for stop in params.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= context_length:
            return {"type": "length", "length": len(req.output_ids)}
        return None
