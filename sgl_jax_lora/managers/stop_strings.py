"""StopStrings: finds a request's stop strings in its growing output text, searching only the new part.

Flow: the frontend's RequestOutput (managers/request_output.py) feeds it the cumulative text after each token; the
first text in which a stop string appears ends the request there. Each call searches the text added since the last
call plus the len(longest stop) - 1 characters before it (a stop string may straddle two pieces), so a request
costs O(its text), not O(text x tokens). Where several stop strings complete at once, the one that starts first
wins (the text is cut there, so it holds none of them, as OpenAI's API cuts it); at one position, the first listed.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stop: list[str]):
        self.stop = list(stop)
        self.overlap = max((len(s) for s in self.stop), default=1) - 1
        self.num_searched = 0  # characters of the text already searched (none of them ends a stop string)

    def __bool__(self) -> bool:
        return bool(self.stop)

    def find(self, text: str) -> tuple[str, int] | None:
        """(stop string, its position in text) of the stop string that starts first in `text`, or None."""
        start = max(0, self.num_searched - self.overlap)
        self.num_searched = len(text)
        found = None
        for stop in self.stop:
            position = text.find(stop, start)
            if position >= 0 and (found is None or position < found[1]):
                found = (stop, position)
        return found
