"""Stored responses of the Responses API: kept in memory, at most a bounded number, so that
`previous_response_id` continues a conversation without the client sending it again, and GET,
DELETE, cancel and input_items find them. A response keeps the one it continues alive while it is
stored itself, so a chain never loses its start."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from localrun.errors import NotFoundError, UsageError

MAX_STORED = 1024  # responses kept; the least recently used one goes first


@dataclass
class Stored:
    """One response: the object returned, its own input items and the response it continued."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    parent: Stored | None = None
    cancel: Callable[[], None] | None = field(default=None, repr=False)  # while it is generated

    def conversation(self) -> list[dict[str, Any]]:
        """Every item of the conversation up to and including this response's output, oldest first."""
        chain: list[Stored] = []
        node: Stored | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        items: list[dict[str, Any]] = []
        for s in reversed(chain):
            items += s.input_items
            items += s.response.get("output") or []
        return items


class ResponseStore:
    """The server's stored responses (thread-safe)."""

    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit = limit
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, stored: Stored) -> None:
        with self._lock:
            self._items[rid] = stored
            self._items.move_to_end(rid)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, rid: str) -> Stored:
        """The stored response, or a 404 naming it."""
        with self._lock:
            stored = self._items.get(rid)
            if stored is not None:
                self._items.move_to_end(rid)
        if stored is None:
            raise NotFoundError(f"Response with id '{rid}' not found.",
                                "it was never stored (store: false), was deleted, or the server restarted")
        return stored

    def delete(self, rid: str) -> None:
        with self._lock:
            if self._items.pop(rid, None) is None:
                raise NotFoundError(f"Response with id '{rid}' not found.")

    def forget(self, rid: str) -> None:
        """Drop a response that failed before it began (nothing of it is kept)."""
        with self._lock:
            self._items.pop(rid, None)

    def find_item(self, item_id: str) -> dict[str, Any] | None:
        """An input or output item of any stored response, by its id (what item_reference names)."""
        with self._lock:
            stored = list(self._items.values())
        for s in reversed(stored):
            for item in s.input_items + list(s.response.get("output") or []):
                if item.get("id") == item_id:
                    return item
        return None

    def cancel(self, rid: str) -> Stored:
        """Stop a response that is being generated; one that has ended cannot be cancelled."""
        stored = self.get(rid)
        if stored.cancel is None or stored.response.get("status") not in ("in_progress", "queued"):
            raise UsageError(f"Cannot cancel response '{rid}': it is {stored.response.get('status')}",
                             "only a response that is being generated can be cancelled")
        stored.cancel()
        return stored
