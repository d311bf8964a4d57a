"""RequestOutput (managers/request_output.py): the frontend builds a request's result from the engine's increments and
matches stop strings there. A stop string ends the output at the token that completes it, whatever the split of the
stop string over tokens or of the tokens over increments; the ids, logprobs and token count end with the text."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sgl_jax_lora.demo_model import demo_model_path
from sgl_jax_lora.managers.io_struct import EngineOutput, GenerateRequest
from sgl_jax_lora.managers.request_output import RequestOutput
from sgl_jax_lora.sampling.sampling_params import SamplingParams

TEXT = "Hello world, the story ends here. Then more text follows after the end."


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_path(), local_files_only=True)


def item(ids: list[int], finish: dict | None = None, with_logprobs: bool = True) -> EngineOutput:
    logprobs = [(-0.5 - t / 1000, t, None) for t in ids] if with_logprobs else []
    return EngineOutput(
        rid="r",
        new_ids=ids,
        new_output_logprobs=logprobs,
        new_input_logprobs=[],
        prompt_tokens=3,
        completion_tokens=len(ids),
        cached_tokens=0,
        finish_reason=finish,
    )


def completing_token(tokenizer, ids: list[int], stop: str) -> int:
    """Index of the first token whose text completes `stop`."""
    return next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1]))


def run(tokenizer, ids: list[int], stop: list[str], pieces: list[int], last_finish: dict | None = None):
    """Feed ids in increments of the given sizes until the output finishes -> (output, last result)."""
    request = GenerateRequest(rid="r", input_ids=[1, 2, 3], sampling=SamplingParams(stop=stop), return_logprob=True)
    output = RequestOutput(tokenizer, True, stop, request.input_ids)
    start, result = 0, None
    for size in pieces:
        end = start + size
        output.add(item(ids[start:end], last_finish if end >= len(ids) else None))
        result = output.result(request, item([]))
        start = end
        if output.finished:
            break
    return output, result


@pytest.mark.parametrize("stop", ["story", "ends here.", "d, the st", "after the end"])
@pytest.mark.parametrize("piece", [1, 3])
def test_a_stop_string_ends_the_output_at_the_token_that_completes_it(tokenizer, stop, piece):
    ids = tokenizer.encode(TEXT)
    k = completing_token(tokenizer, ids, stop)
    if stop != "story":  # the others span several tokens: no single token's text holds them
        assert stop not in tokenizer.decode(ids[k : k + 1])
    output, result = run(tokenizer, ids, ["never there", stop], [piece] * len(ids))
    assert result["text"] == TEXT[: TEXT.find(stop)]
    assert result["output_ids"] == ids[: k + 1]
    assert result["meta_info"]["completion_tokens"] == k + 1
    assert [tid for _, tid in result["meta_info"]["output_token_logprobs"]] == ids[: k + 1]
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert not output.engine_finished  # the caller must abort it in the engine


def test_the_first_listed_stop_string_wins_when_two_complete_together(tokenizer):
    ids = tokenizer.encode(TEXT)
    _, result = run(tokenizer, ids, ["the story", "story"], [len(ids)])
    assert result["meta_info"]["finish_reason"]["matched"] == "the story" and result["text"] == "Hello world, "


def test_a_stop_token_that_completes_a_stop_string_keeps_its_finish_reason(tokenizer):
    ids = tokenizer.encode(TEXT)
    k = completing_token(tokenizer, ids, "story")
    finish = {"type": "stop", "matched": ids[k]}
    output, result = run(tokenizer, ids[: k + 1], ["story"], [1] * (k + 1), last_finish=finish)
    assert result["meta_info"]["finish_reason"] == finish and result["text"] == tokenizer.decode(ids[: k + 1])
    assert output.engine_finished


def test_a_stop_string_wins_over_the_length_limit_on_the_same_token(tokenizer):
    ids = tokenizer.encode(TEXT)
    k = completing_token(tokenizer, ids, "story")
    output, result = run(
        tokenizer, ids[: k + 1], ["story"], [1] * (k + 1), last_finish={"type": "length", "length": k + 1}
    )
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": "story"}
    assert result["text"] == "Hello world, the " and output.engine_finished  # the engine is done: no abort


def test_without_stop_strings_the_output_is_the_whole_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    output, result = run(tokenizer, ids, [], [2] * len(ids), last_finish={"type": "length", "length": len(ids)})
    assert result["text"] == TEXT and result["output_ids"] == ids and output.engine_finished
    assert result["meta_info"]["completion_tokens"] == len(ids)


@pytest.mark.parametrize("engine_finish", [{"type": "stop", "matched": 2}, {"type": "length", "length": 1}])
def test_a_prompt_only_request_keeps_its_prompt_logprobs_and_drops_the_sampled_token(tokenizer, engine_finish):
    # max_new_tokens 0 (SGLang's scoring call): the engine samples one token after the prompt, which is not sent
    sampling = SamplingParams(max_new_tokens=0, stop=["Hello"])
    request = GenerateRequest(rid="r", input_ids=[1, 2, 3], sampling=sampling, return_logprob=True, logprob_start_len=0)
    assert request.for_engine().sampling.max_new_tokens == 1 and request.sampling.max_new_tokens == 0
    output = RequestOutput(tokenizer, True, sampling.stop, request.input_ids, request.prompt_only)
    first = tokenizer.encode("Hello")[0]
    prompt_logprobs = [(None, 1, None), (-0.25, 2, None), (-0.75, 3, None)]
    increment = EngineOutput("r", [first], [(-0.1, first, None)], prompt_logprobs, 3, 1, 0, engine_finish)
    output.add(increment)
    result = output.result(request, increment)
    assert (result["text"], result["output_ids"]) == ("", [])
    meta = result["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["completion_tokens"] == 0
    assert meta["input_token_logprobs"] == [[None, 1], [-0.25, 2], [-0.75, 3]] and meta["output_token_logprobs"] == []
    assert output.engine_finished  # nothing to abort


def test_a_generating_request_runs_in_the_engine_as_it_is():
    request = GenerateRequest(rid="r", input_ids=[1], sampling=SamplingParams(max_new_tokens=4))
    assert not request.prompt_only and request.for_engine() is request
    named = GenerateRequest(rid="r", input_ids=[1], sampling=SamplingParams(max_new_tokens=4), client_rid="mine")
    assert named.for_engine().client_rid is None and named.for_engine().rid == "r"  # the client's name stays here


def test_an_aborted_prompt_only_request_says_so(tokenizer):
    # its prompt logprobs may be cut short (an abort during a chunked prefill): a scorer must not take them as whole
    request = GenerateRequest(rid="r", input_ids=[1, 2, 3, 4], sampling=SamplingParams(max_new_tokens=0))
    output = RequestOutput(tokenizer, True, [], request.input_ids, request.prompt_only)
    abort = {"type": "abort", "message": "aborted by the client"}
    output.add(EngineOutput("r", [], [], [(None, 1, None), (-0.5, 2, None)], 4, 0, 0, abort))
    assert output.finish_reason == abort
