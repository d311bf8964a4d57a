"""Training data: a JSONL file -> tokenized examples -> fixed-shape batches with a completion-only loss mask.

Flow: `read_examples(path, tokenizer)` (or `examples_from_records` for records in memory) takes one JSON object per line, either
    {"prompt": "...", "completion": "..."}         the completion gets the loss, then the EOS token
    {"messages": [{"role": ..., "content": ...}]}  the tokenizer's chat template; the last (assistant) message gets
                                                   the loss, the earlier ones are the prompt
-> `Example(input_ids, loss_mask)` -> `batches(...)` pads every batch to one shape [B, S] (right padding, mask 0),
so the jitted train step compiles once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator

import numpy as np

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is part of the completion (predicted, counted in the loss)


def read_examples(path: str, tokenizer, max_len: int) -> list[Example]:
    """Every line of the JSONL file as an Example (truncated to max_len tokens); errors name the line."""
    examples = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{line_no}: not UTF-8 text ({e.reason}); write one JSON object per line"
                ) from e
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e}); write one JSON object per line") from e
            examples.append(_example(tokenizer, record, f"{path}:{line_no}", max_len))
    if not examples:
        raise ValueError(f"{path} holds no examples; write one JSON object per line")
    return _with_loss_tokens(examples, path, max_len)


def examples_from_records(records: list[dict], tokenizer, max_len: int, source: str) -> list[Example]:
    """Records already in memory (the same two forms as a JSONL line) -> Examples; errors name source and index."""
    examples = [_example(tokenizer, record, f"{source}[{i}]", max_len) for i, record in enumerate(records)]
    return _with_loss_tokens(examples, source, max_len)


def _with_loss_tokens(examples: list[Example | str], source: str, max_len: int) -> list[Example]:
    """The examples that keep a completion token after truncation; the others (given as the place they came from)
    are left out with a warning, and a ValueError if none is left."""
    kept = [e for e in examples if isinstance(e, Example)]
    dropped = [e for e in examples if not isinstance(e, Example)]
    if not kept:
        raise ValueError(
            f"{source}: every example's prompt fills --max-len ({max_len} tokens), so no completion token is left "
            "to learn from; raise --max-len or shorten the prompts"
        )
    if dropped:
        logger.warning(
            "%d of %d examples left out (first: %s): the prompt fills --max-len (%d tokens), leaving no completion "
            "token to learn from; raise --max-len to train on them",
            len(dropped),
            len(examples),
            dropped[0],
            max_len,
        )
    return kept


def _example(tokenizer, record: object, where: str, max_len: int) -> Example | str:
    """The record as an Example, or `where` when truncation to max_len leaves none of its completion."""
    if isinstance(record, dict) and isinstance(record.get("messages"), list) and record["messages"]:
        prompt_ids, completion_ids = _chat_ids(tokenizer, record["messages"], where)
    elif (
        isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str)
    ):
        prompt_ids = tokenizer.encode(record["prompt"], add_special_tokens=False)
        completion_ids = tokenizer.encode(record["completion"], add_special_tokens=False)
        if tokenizer.eos_token_id is not None:
            completion_ids = completion_ids + [tokenizer.eos_token_id]
    else:
        raise ValueError(f'{where}: expected {{"prompt": str, "completion": str}} or {{"messages": [...]}}')
    if not prompt_ids or not completion_ids:
        raise ValueError(f"{where}: the prompt and the completion must each have at least one token")
    ids = (prompt_ids + completion_ids)[:max_len]
    mask = ([0] * len(prompt_ids) + [1] * len(completion_ids))[:max_len]
    return Example(ids, mask) if any(mask) else where


def _chat_ids(tokenizer, messages: list, where: str) -> tuple[list[int], list[int]]:
    """(prompt ids: every message but the last plus the generation prompt, ids of the last message's turn)."""
    if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError(f"{where}: each message needs 'role' and 'content'")
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"{where}: the last message must be the assistant's (it is what the adapter learns)")
    if not tokenizer.chat_template:
        raise ValueError(f"{where}: the tokenizer has no chat template; use prompt/completion pairs instead")
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(prompt):
        raise ValueError(f"{where}: the chat template does not extend the prompt with the reply; use prompt/completion")
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    return prompt_ids, tokenizer.encode(full[len(prompt) :], add_special_tokens=False)


def padded_length(examples: list[Example], multiple: int = 16) -> int:
    longest = max(len(e.input_ids) for e in examples)
    return -(-longest // multiple) * multiple


def pad_batch(examples: list[Example], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """-> input_ids [B, S] i32 (right-padded), loss_mask [B, S] f32."""
    ids = np.full((len(examples), seq_len), pad_id, np.int32)
    mask = np.zeros((len(examples), seq_len), np.float32)
    for row, example in enumerate(examples):
        ids[row, : len(example.input_ids)] = example.input_ids
        mask[row, : len(example.loss_mask)] = example.loss_mask
    return ids, mask


def batches(examples: list[Example], batch_size: int, seq_len: int, pad_id: int, seed: int) -> Iterator[tuple]:
    """Endless shuffled batches of batch_size examples (epochs reshuffled; a short dataset repeats within one)."""
    rng = np.random.default_rng(seed)
    order: list[int] = []
    while True:
        while len(order) < batch_size:
            order += rng.permutation(len(examples)).tolist()
        chosen, order = order[:batch_size], order[batch_size:]
        yield pad_batch([examples[i] for i in chosen], seq_len, pad_id)
