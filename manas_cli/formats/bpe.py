"""A byte-level BPE trainer whose output is tiktoken ranks: bytes 0-255 first, then merges in the order learned."""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict

import regex

from .tokenizer import GPT2_PAT_STR

Pair = tuple[int, int]


def train_bpe(text: str, vocab_size: int, pat_str: str = GPT2_PAT_STR) -> dict[bytes, int]:
    """Learn mergeable ranks (vocab_size - 1 of them: the last id is <|endoftext|>) from text.

    Pair counts are kept incrementally: a merge only revisits the distinct words that contain the pair, and a
    max-heap with lazy invalidation finds the next most frequent pair, so a few MB of text takes seconds.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes and <|endoftext|>), got {vocab_size}")
    word_counts = Counter(regex.findall(pat_str, text))
    words = [list(word.encode("utf-8")) for word in word_counts]
    freqs = list(word_counts.values())
    vocab = [bytes([i]) for i in range(256)]
    ranks = {token: rank for rank, token in enumerate(vocab)}

    pair_counts: dict[Pair, int] = defaultdict(int)
    pair_words: dict[Pair, set[int]] = defaultdict(set)
    for index, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freqs[index]
            pair_words[pair].add(index)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    while len(ranks) < vocab_size - 1 and heap:
        negative_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -negative_count or negative_count == 0:
            continue  # stale heap entry: the count changed after it was pushed
        merged = vocab[pair[0]] + vocab[pair[1]]
        new_id = ranks.get(merged)
        if new_id is None:  # another pair may already have spelled the same bytes
            new_id = ranks[merged] = len(vocab)
            vocab.append(merged)
        changed: set[Pair] = set()
        for index in pair_words.pop(pair):
            word, freq = words[index], freqs[index]
            for old in zip(word, word[1:]):
                pair_counts[old] -= freq
                changed.add(old)
            words[index] = word = _merge(word, pair, new_id)
            for new in zip(word, word[1:]):
                pair_counts[new] += freq
                pair_words[new].add(index)
                changed.add(new)
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], p))
            else:
                pair_counts.pop(p, None)
    return ranks


def _merge(word: list[int], pair: Pair, new_id: int) -> list[int]:
    merged, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            merged.append(new_id)
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return merged
