"""Each row's constraint state while it is sampled: the parser of a structured output (structured.Grammar) over
the tokens the row has drawn, which says before each draw which ids may come next. Shared by both engines'
sampling states; free of torch, and of llguidance but through the grammar it is given.

A constraint never pushes a text on where it could end: where the grammar accepts the text so far (end-of-text is
allowed) and the model's own most likely next token is one the grammar refuses, the text ends. Without this, the
mask hands that token's mass to what the grammar allows, and a model that wrote a whole tool call and wanted to stop
talking is pushed into a second call, often the same one."""

from __future__ import annotations

from collections.abc import Callable

from ..constraint_worker import reason
from ..errors import ConstraintError


class Constraints:
    """The parser state of every row of a request whose sampler has a grammar (Sampler.grammar)."""

    def __init__(self, grammar, rows: int) -> None:
        self.matchers = [grammar.matcher() for _ in range(rows)]
        self.eot = grammar.vocabulary.eot

    def allowed(self, row: int, size: int, preferred: Callable[[], int]) -> bytes:
        """One byte per id below `size`, non-zero where the id may be drawn next. Once the grammar is complete, only
        end-of-text is (and stays so after it: rows of one cache decode on past their own end); where it may end and
        preferred() (the model's most likely id, asked only there) is refused, only end-of-text."""
        matcher = self.matchers[row]
        allowed = matcher.compute_logit_bias()
        if matcher.is_error():
            raise ConstraintError(f"the structured output cannot go on: {reason(matcher.get_error())}")
        allowed = allowed[:size].ljust(size, b"\0")
        if self.eot < size and allowed[self.eot] and not allowed[preferred()]:
            return bytes(self.eot) + b"\1" + bytes(size - self.eot - 1)
        return allowed

    def accept(self, row: int, token: int) -> None:
        """The row drew `token` (always one allowed() gave)."""
        matcher = self.matchers[row]
        if not matcher.consume_token(token):
            raise ConstraintError(f"the structured output cannot go on: {reason(matcher.get_error())}")
