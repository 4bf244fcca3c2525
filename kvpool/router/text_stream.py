"""The text a streamed answer sends as its tokens arrive (the OpenAI API's `delta`s, `kvpool.router.http`)."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Incremental detokenisation: deltas of the decoded text, holding back a split UTF-8 tail and stops.

    `model` decodes token ids (`decode(ids) -> str`); `eos` ids are left out of the text; the text ends
    before the first of `stops`. `push(ids)` answers the new text to send, `finish()` the rest."""

    def __init__(self, model: Any, eos: set[int], stops: list[str]) -> None:
        self.model, self.eos, self.stops = model, eos, stops
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def _text(self) -> str:
        return str(self.model.decode([t for t in self.ids if t not in self.eos]))

    def push(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self._text()
        for s in self.stops:
            at = text.find(s)
            if at >= 0:
                text, self.stopped = text[:at], True
        end = len(text)
        if not self.stopped:
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            hold = max((len(s) - 1 for s in self.stops), default=0)
            end = max(self.sent, end - hold)
        delta = text[self.sent : end]
        self.sent = end
        return delta

    def finish(self) -> str:
        if self.stopped:
            return ""
        text = self._text()
        for s in self.stops:
            at = text.find(s)
            if at >= 0:
                text = text[:at]
        delta = text[self.sent :]
        self.sent = len(text)
        return delta
