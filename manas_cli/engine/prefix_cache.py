"""An exact prefix cache for continuous batching: the K/V of recently prefilled prompts, by their tokens, so that a
request whose prompt starts with one of them (a shared system prompt, a chat's earlier turns) copies that prefix
into its cache and prefills only the rest. On the native engine a position's K/V depend only on the tokens up to it
and their positions, so the copy holds the bits a prefill would compute, and the answer is the request's alone, bit
for bit. Bounded in bytes, least recently used first out."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    snapshot: object  # what a session's snapshot() gives (its nbytes), for its restore()
    nbytes: int


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # a prefilled window's tokens → its K/V
        self.hits = self.reused_tokens = 0

    def find(self, window: list[int]) -> tuple[int, object | None]:
        """(positions to keep, the snapshot holding them) of the entry sharing the longest start with the window;
        at least one token of the window is always left to prefill (its logits are the answer's first)."""
        best, found = 0, None
        for tokens in self.entries:
            common = common_start(tokens, window)
            if common > best:
                best, found = common, tokens
        best = min(best, len(window) - 1)
        if found is None or best <= 0:
            return 0, None
        self.entries.move_to_end(found)
        self.hits, self.reused_tokens = self.hits + 1, self.reused_tokens + best
        return best, self.entries[found].snapshot

    def add(self, window: list[int], snapshot) -> None:
        """Keep a prefilled window's snapshot, dropping the least recently used past max_bytes, and the entries
        whose tokens start it: any window shares at least as long a start with it as with them."""
        key, nbytes = tuple(window), snapshot.nbytes
        if nbytes > self.max_bytes or key in self.entries:
            return
        for tokens in [tokens for tokens in self.entries if len(tokens) < len(key) and key[: len(tokens)] == tokens]:
            self.bytes -= self.entries.pop(tokens).nbytes
        self.entries[key] = Entry(snapshot, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            self.bytes -= self.entries.popitem(last=False)[1].nbytes


def common_start(a, b) -> int:
    """How many first items a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
