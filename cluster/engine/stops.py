"""Stop strings over streamed text.

Text is released only when it cannot be the start of a stop string, so a
client never sees the first half of a stop sequence that later completes.
"""

from __future__ import annotations


class StopMatcher:
    """Feeds streamed text pieces; says what may be emitted and whether a stop hit."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._text = ""  # text received but not yet released
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add `piece`; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        self._text += piece
        if not self.stops:
            out, self._text = self._text, ""
            return out
        cut = min((i for i in (self._text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._text = self._text[:cut], ""
            return out
        hold = self._partial_suffix()
        out, self._text = self._text[: len(self._text) - hold], self._text[len(self._text) - hold:]
        return out

    def flush(self) -> str:
        """At the end of generation: whatever was held back is real text."""
        out, self._text = ("" if self.stopped else self._text), ""
        return out

    def _partial_suffix(self) -> int:
        """Length of the longest suffix of the held text that begins some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if s.startswith(self._text[-k:]):
                    best = k
                    break
        return best
