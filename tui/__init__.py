"""The Textual terminal UI of localrun: library, discover, chat and convert screens."""

from __future__ import annotations
