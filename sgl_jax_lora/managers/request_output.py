"""RequestOutput: one request's result as the frontend builds it from the engine's increments.

Flow: TokenizerManager.generate_request makes one per request; each EngineOutput of that request (io_struct.py) goes
through `add`, which appends its token ids and logprobs, grows the text (IncrementalDetokenizer) and returns the
cumulative result dict ({"text", "output_ids", "meta_info"}).

Stop strings are matched here, on the text decoded for streaming anyway, not on the engine loop (like vLLM's output
processor): the engine checks token-level stops only (managers/stop_checker.py). When a stop string appears, the
request finishes here at the token that completed it: text cut before the stop string, later tokens (the engine keeps
decoding until the abort reaches it) dropped, so output ids, logprobs and completion_tokens all end at that token.
The caller then aborts the request in the engine (`engine_finished` is False), which frees its pages. The finish reason is the
one the engine would give: a stop token id or EOS that is the increment's last token wins over a stop string it
completes, a stop string wins over the length limit. A prompt-only request (max_new_tokens 0, SGLang's way to score a
prompt) keeps its prompt logprobs and drops the one token the engine samples: no text, finish reason length 0.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from sgl_jax_lora.managers.detokenizer import IncrementalDetokenizer
from sgl_jax_lora.managers.io_struct import EngineOutput, GenerateRequest
from sgl_jax_lora.managers.stop_strings import StopStrings


class RequestOutput:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        skip_special_tokens: bool,
        stop: list[str],
        prompt_ids: list[int],
        prompt_only: bool = False,
    ):
        self.prompt_only = prompt_only  # max_new_tokens 0: the token the engine samples is dropped
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_ids)
        self.stop_strings = StopStrings(stop)
        self.output_ids: list[int] = []
        self.input_logprobs: list = []
        self.output_logprobs: list = []
        self.text = ""
        self.finish_reason: dict | None = None
        self.engine_finished = False  # the engine sent its finish reason: it holds nothing of the request anymore

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, item: EngineOutput) -> None:
        """Take one engine increment: new_ids, new_output_logprobs (one per id, or none), new_input_logprobs,
        finish_reason (the engine's, for the increment's last token)."""
        finish = item.finish_reason
        self.engine_finished = finish is not None
        self.input_logprobs += item.new_input_logprobs
        if self.prompt_only:  # an abort (the client's, or an engine error) stays one: its logprobs may be cut short
            self.finish_reason = (
                finish if finish is None or finish["type"] == "abort" else {"type": "length", "length": 0}
            )
            return
        if not self.stop_strings:
            self.output_ids += item.new_ids
            self.output_logprobs += item.new_output_logprobs
            self.text = self.detokenizer.append(item.new_ids, is_last=finish is not None)
            self.finish_reason = finish
            return
        self._add_checking_stop_strings(item.new_ids, item.new_output_logprobs, finish)

    def _add_checking_stop_strings(self, new_ids: list[int], new_logprobs: list, finish: dict | None) -> None:
        """Token by token, so that a stop string ends the output at the token that completes it."""
        stops_on_token = finish is not None and finish["type"] == "stop" and not isinstance(finish.get("matched"), str)
        for k, token in enumerate(new_ids or [None]):
            is_last = k == len(new_ids) - 1 or not new_ids
            if token is not None:
                self.output_ids.append(token)
                if new_logprobs:
                    self.output_logprobs.append(new_logprobs[k])
            text = self.detokenizer.append([] if token is None else [token], is_last=is_last and finish is not None)
            match = None if is_last and stops_on_token else self.stop_strings.find(text)
            if match is not None:
                stop, position = match
                self.text = text[:position]
                self.finish_reason = {"type": "stop", "matched": stop}
                return
            self.text = text
        self.finish_reason = finish

    def result(self, request: GenerateRequest, item: EngineOutput) -> dict:
        """The cumulative result dict of `request` after `item`; token counts and logprobs are those of the (maybe
        cut) output."""
        meta = {
            "id": request.client_rid or request.rid,
            "prompt_tokens": item.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": item.cached_tokens,
            "finish_reason": self.finish_reason,
        }
        if request.return_logprob:
            meta["input_token_logprobs"] = [[lp, tid] for lp, tid, _ in self.input_logprobs]
            meta["output_token_logprobs"] = [[lp, tid] for lp, tid, _ in self.output_logprobs]
            if request.top_logprobs_num:
                meta["input_top_logprobs"] = [top for _, _, top in self.input_logprobs]
                meta["output_top_logprobs"] = [top for _, _, top in self.output_logprobs]
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
