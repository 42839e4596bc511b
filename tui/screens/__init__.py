"""The app's screens: one per mode, plus modal dialogs."""

from __future__ import annotations
