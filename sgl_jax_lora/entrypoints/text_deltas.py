"""TextDeltas: a stream's growing text cut to what will never be taken back.

Flow: the OpenAI streams (openai_streaming.py) send each choice's text as deltas of it; /generate's stream
(native_api.py) sends the cumulative text cut at the same point. Until a request finishes, a trailing U+FFFD and a
tail that could begin a stop string (which the final text omits) are held back.
"""

from __future__ import annotations


class TextDeltas:
    """Turns cumulative texts into deltas that are never taken back.

    Until the request finishes, hold back a trailing U+FFFD (the rest of a multi-byte character has
    not arrived) and any tail that could be the start of a stop string (the final text omits it).
    """

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.num_sent = 0

    def delta(self, text: str, is_finished: bool) -> str:
        end = len(text) if is_finished else self._stable_len(text)
        if end <= self.num_sent:
            return ""
        piece = text[self.num_sent : end]
        self.num_sent = end
        return piece

    def _stable_len(self, text: str) -> int:
        end = len(text)
        while end > self.num_sent and text[end - 1] == "\ufffd":
            end -= 1
        held = 0
        for stop in self.stop:
            for k in range(len(stop) - 1, held, -1):
                if text.endswith(stop[:k], 0, end):  # no copy of the text: it grows with the output
                    held = k
                    break
        return max(end - held, self.num_sent)
