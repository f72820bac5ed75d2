"""Host-side text for one generated row: incremental decoding and stop strings.

Text is emitted only once it is final: never half a multi-byte character (the decoder shows
U+FFFD until the character is complete), and never a piece that could still grow into a stop
string (that tail is held back until it can no longer match).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from mlxfun.model.tokenizer import Tokenizer


class RowText:
    """The decoded text of one row's generated tokens, with stop-string detection."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.text = ""  # decoded text of every token so far (complete characters only)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped_at: int | None = None  # index in `text` where a stop string starts
        self.tokens_at_stop: int | None = None  # tokens kept when a stop string ended the row
        # The tokenizers library's incremental decoder: each token decoded in a short window with
        # the previous piece as context (some decoders strip a leading space from a text's first
        # token), text held back while a UTF-8 sequence is incomplete; one native call a token
        # (every live row pays it every step: a 1B step at 128 rows is host-bound on an H200).
        self._stream = DecodeStream(skip_special_tokens=False)

    def add(self, token: int) -> str:
        """Append a token; return the newly final text (possibly empty)."""
        self.tokens.append(token)
        piece = self._stream.step(self.tokenizer.backend, token)
        if not piece:
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.text += piece
        if self.stop and self.stopped_at is None:
            self._find_stop()
        return self._release()

    def flush(self) -> str:
        """All remaining text at the end of the row (held-back tails included)."""
        return self._release(final=True)

    @property
    def final_text(self) -> str:
        return self.text if self.stopped_at is None else self.text[: self.stopped_at]

    def _find_stop(self) -> None:
        longest = max(len(s) for s in self.stop)
        start = max(0, self.emitted - longest)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped_at = min(hits)
            self.tokens_at_stop = len(self.tokens)

    def _release(self, final: bool = False) -> str:
        end = len(self.final_text)
        if not final and self.stopped_at is None and self.stop:
            end -= self._held_back()
        piece = self.final_text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return piece

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        for n in range(min(len(self.text), max(len(s) for s in self.stop) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
