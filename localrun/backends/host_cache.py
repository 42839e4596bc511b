"""Evicted prompt prefixes kept in host memory, so a conversation whose KV cache was taken by
another finds its prefix again (as llama-server's --cache-ram does).

When the engine loop gives a slot to a request whose prompt shares little with what the slot
holds, the slot's sequence state (its KV cells, copied out by the engine) goes here with the
tokens it holds; a later request whose prompt starts with those tokens gets the state restored
into its slot and evaluates only the rest. The store is bounded in bytes and forgets the entry
used least recently first; an entry whose tokens another one extends is dropped for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from localrun.system import ram_bytes

DEFAULT_MIB = 4096  # and at most an eighth of the machine's memory


def default_bytes() -> int:
    total = ram_bytes()[0]
    cap = DEFAULT_MIB << 20
    return min(cap, total // 8) if total else cap


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most limit (compared in blocks, then one by one)."""
    n = min(len(a), len(b), limit)
    i, step = 0, 256
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Entry:
    tokens: list[int]
    lora: Any
    state: Any  # the engine's copy of the sequence state
    size: int  # bytes
    used: int = field(default=0)


class HostCache:
    """Sequence states of evicted prefixes, at most `limit` bytes of them."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.entries: list[Entry] = []
        self._clock = 0
        self.saved = 0  # states saved, and restored, over the store's life
        self.restored = 0

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)

    def covers(self, tokens: list[int], lora: Any) -> bool:
        """Whether an entry already holds these tokens (or a longer run that starts with them)."""
        n = len(tokens)
        return any(e.lora == lora and len(e.tokens) >= n and e.tokens[:n] == tokens for e in self.entries)

    def find(self, tokens: list[int], lora: Any, limit: int) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with tokens (at most limit), and that length."""
        best, best_n = None, 0
        for e in self.entries:
            if e.lora == lora:
                n = common_prefix(e.tokens, tokens, limit)
                if n > best_n:
                    best, best_n = e, n
        return best, best_n

    def fits(self, size: int) -> bool:
        return 0 < size <= self.limit

    def put(self, tokens: list[int], lora: Any, state: Any, size: int) -> None:
        """Keep a state; entries it extends go, then the least recently used until it fits."""
        n = len(tokens)
        self.entries = [e for e in self.entries
                        if not (e.lora == lora and len(e.tokens) <= n and tokens[:len(e.tokens)] == e.tokens)]
        self.entries.sort(key=lambda e: e.used)
        while self.entries and self.size + size > self.limit:
            self.entries.pop(0)
        self._clock += 1
        self.entries.append(Entry(list(tokens), lora, state, size, self._clock))
        self.saved += 1

    def touch(self, entry: Entry) -> None:
        self._clock += 1
        entry.used = self._clock
        self.restored += 1

    def clear(self) -> None:
        self.entries.clear()
