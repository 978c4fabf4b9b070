"""Each row's constraint state while it is sampled: the parser of a structured output (structured.Grammar) over
the tokens the row has drawn, which says before each draw which ids may come next. Shared by both engines'
sampling states; free of torch, and of llguidance but through the grammar it is given."""

from __future__ import annotations

from ..constraint_worker import reason
from ..errors import ConstraintError


class Constraints:
    """The parser state of every row of a request whose sampler has a grammar (Sampler.grammar)."""

    def __init__(self, grammar, rows: int) -> None:
        self.matchers = [grammar.matcher() for _ in range(rows)]

    def allowed(self, row: int, size: int) -> bytes:
        """One byte per id below `size`, non-zero where the id may be drawn next. Once the grammar is complete, only
        end-of-text is (and stays so after it: rows of one cache decode on past their own end)."""
        matcher = self.matchers[row]
        allowed = matcher.compute_logit_bias()
        if matcher.is_error():
            raise ConstraintError(f"the structured output cannot go on: {reason(matcher.get_error())}")
        return allowed[:size].ljust(size, b"\0")

    def accept(self, row: int, token: int) -> None:
        """The row drew `token` (always one allowed() gave)."""
        matcher = self.matchers[row]
        if not matcher.consume_token(token):
            raise ConstraintError(f"the structured output cannot go on: {reason(matcher.get_error())}")
