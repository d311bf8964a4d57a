"""What the KV cache, once sized, allows against the settings that assumed more: EngineCore logs it at startup.

The cache is sized after the programs compile (from device memory, or --max-total-tokens), so the context length and
--max-running-requests are set before anyone knows what it holds. `warn_kv_capacity` logs a warning naming the
setting to change where a request can never use its whole context length (the cache holds fewer tokens) or where
more requests may run than the cache has pages (each running request holds a page of its own at least), so the
larger sequence buckets were compiled for steps that never come. `check_fits_kv_cache` refuses, on arrival, a
request that the cache could never hold whole.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def warn_kv_capacity(context_length: int, max_running_requests: int, kv_tokens: int, page_size: int) -> list[str]:
    """The warnings for a cache of `kv_tokens` tokens in pages of `page_size`; none where it holds what was set."""
    warnings = []
    if kv_tokens < context_length:
        warnings.append(
            f"the KV cache holds {kv_tokens} tokens, fewer than the context length {context_length}: a request's "
            "prompt and output must fit in the cache (a chat or text completion without max_tokens gets what is left of it); "
            "raise --max-total-tokens or --mem-fraction-static, or lower --context-length"
        )
    num_pages = kv_tokens // page_size
    if num_pages < max_running_requests:
        warnings.append(
            f"--max-running-requests {max_running_requests}, but the KV cache has {num_pages} pages of {page_size} "
            f"tokens and each running request holds one at least: at most {num_pages} run at once; lower "
            "--max-running-requests (fewer programs to compile) or raise --max-total-tokens"
        )
    for warning in warnings:
        logger.warning(warning)
    return warnings


def check_fits_kv_cache(max_len: int, kv_tokens: int) -> None:
    """ValueError (the request's error) where a request's prompt and max_new_tokens, `max_len` tokens, outgrow a
    cache of `kv_tokens` tokens: it would be preempted for ever once it outgrew it."""
    if max_len > kv_tokens:
        raise ValueError(
            f"request needs {max_len} KV tokens but the KV cache holds {kv_tokens}; "
            "lower max_new_tokens (or shorten the prompt) or restart with a larger --max-total-tokens"
        )
