"""The text layer over a token stream: incremental UTF-8 decoding and stop strings. It knows nothing about drafting
or caches: it consumes (token, from_draft) pairs and closes the token stream when a stop string appears."""
from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it releases (may be empty: an incomplete UTF-8 sequence, or text held
    back because it may begin a stop string)."""

    text: str
    token: int | None   # None: a final piece that only releases held-back text
    from_draft: bool


class StopMatcher:
    """Releases text as it arrives, except a tail that could still begin a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hold = max((len(s) for s in self.stops), default=0)

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text to release, stopped)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = 0
        for n in range(min(self.hold - 1, len(self.pending)), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stops):
                keep = n
                break
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def stream_text(tokens: Iterator[tuple[int, bool]], token_bytes: Callable[[int], bytes], stops: Sequence[str],
                on_stop: Callable[[], None]) -> Iterator[Piece]:
    """Pieces of text for a stream of (token, from_draft). A stop string ends the stream (the token stream is
    closed, then `on_stop()` records why); it and what follows are not emitted."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    matcher = StopMatcher(stops)
    try:
        for token, from_draft in tokens:
            text, stopped = matcher.push(decoder.decode(token_bytes(token)))
            yield Piece(text, token, from_draft)
            if stopped:
                tokens.close()
                on_stop()
                return
        # release what was held back (partial UTF-8, a possible stop-string prefix)
        text, stopped = matcher.push(decoder.decode(b"", final=True))
        text += "" if stopped else matcher.flush()
        if text:
            yield Piece(text, None, False)
    finally:
        tokens.close()
