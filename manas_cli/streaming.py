"""From token ids to the text a user sees: UTF-8-safe, ended by end-of-text or a stop string."""

from __future__ import annotations

from collections.abc import Sequence

import tiktoken

from .formats.tokenizer import IncrementalDecoder


class TextStream:
    """Feed one row's tokens; get back text that is safe to print now.

    Text that could still be the start of a stop string is held back until it is known not to be, so a stop
    string never reaches the output even when it arrives split across tokens.
    """

    def __init__(
        self, encoding: tiktoken.Encoding, eot_id: int | None, stops: Sequence[str] = (), record: bool = True
    ) -> None:
        self._decoder = IncrementalDecoder(encoding)
        self._eot_id = eot_id
        self._stops = [stop for stop in stops if stop]
        self._pending = ""
        # Without record, the text and tokens are only streamed: a billion-token run keeps nothing of them.
        self._record = record
        self._released: list[str] = []  # the text released so far, in pieces: appending to one string is O(length)
        self.tokens: list[int] = []  # the tokens consumed (end-of-text excluded), when recorded
        self.logprobs: list[dict] = []  # with each recorded token's log-probabilities, when given
        self.count = 0  # the tokens consumed
        self.finish_reason: str | None = None  # "stop", "end_of_text" or "length" once finished

    @property
    def text(self) -> str:
        """Everything released so far (empty when not recorded)."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def _token(self, token: int) -> dict:
        """A token as a log-probability entry shows it: its id, its bytes, and their text (U+FFFD for a part of a
        character)."""
        piece = self._decoder.encoding.decode_single_token_bytes(token)
        return {"id": token, "text": piece.decode("utf-8", errors="replace"), "bytes": list(piece)}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, token: int, logprobs: tuple[float, list[int], list[float]] | None = None) -> str:
        """logprobs: the token's log-probability and the most likely ids with theirs (sampling.top_logprobs)."""
        if self.finished:
            return ""
        if token == self._eot_id:
            return self.finish("end_of_text")
        self.count += 1
        if self._record:
            self.tokens.append(token)
            if logprobs is not None:
                chosen, ids, values = logprobs
                self.logprobs.append(
                    {
                        **self._token(token),
                        "logprob": chosen,
                        "top_logprobs": [{**self._token(i), "logprob": v} for i, v in zip(ids, values)],
                    }
                )
        self._pending += self._decoder.feed(token)
        return self._release(final=False)

    def finish(self, reason: str = "length") -> str:
        """End the stream (budget spent, end-of-text, interrupted): release what was held back."""
        if self.finished:
            return ""
        self._pending += self._decoder.flush()
        released = self._release(final=True)
        self.finish_reason = self.finish_reason or reason
        return released

    def _release(self, final: bool) -> str:
        hits = [index for index in (self._pending.find(stop) for stop in self._stops) if index >= 0]
        if hits:
            released, self._pending = self._pending[: min(hits)], ""
            self.finish_reason = "stop"
        else:
            keep = 0 if final else self._stop_prefix_length()
            cut = len(self._pending) - keep
            released, self._pending = self._pending[:cut], self._pending[cut:]
        if self._record and released:
            self._released.append(released)
        return released

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest
