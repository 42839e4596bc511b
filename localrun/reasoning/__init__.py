"""Reasoning formats: how a thinking model writes its thought apart from its answer.

The format is read from the chat template and the vocabulary (`detect`), never from the model's
name: one module per format in this package, each a `ReasoningFormat` registered with
`@register(order)` (see `base`). A format says how a template turns thinking on and off
(`switch`, `can_switch_off`), whether a rendered prompt already opened the thought
(`starts_inside`), what ends a thought early (`closing_text`, for a thinking budget), where
earlier turns' thoughts go (`history_field`), and makes a streaming `splitter` whose
`feed`/`flush` sort the reply's text into `Split(thinking, answer, calls)`.

The formats: `think_tags` (`<think>…</think>`, most families), `harmony` (gpt-oss's channels),
`glimmer` (Muse Glimmer's `to=self` messages), `seed` (Seed-OSS), `granite` (Granite 3.3),
`gemma4` (Gemma 4's thought channel), `mistral` (`[THINK]`), `kimi_k3` (Kimi K3's think section),
`command_r` (Command R7B, Command A), `apertus` (`<|inner_prefix|>`), `apriel` (Apriel 1.5 and 1.6,
`[BEGIN FINAL RESPONSE]`), `solar_open` (Solar Open's `<|think|>` message), `hy3` (Hy3's
`<think:opensource>`) and `minimax_m3` (`<mm:think>`).
"""

from __future__ import annotations

from localrun.reasoning.base import (
    FORMATS,
    HasToken,
    ReasoningFormat,
    Split,
    Splitter,
    Switch,
    no_token,
)


def detect(template: str | None, has_token: HasToken = no_token) -> ReasoningFormat | None:
    """The reasoning format of a model with this chat template and vocabulary, or None when it
    cannot think. has_token(text): the vocabulary has text as one special or added token."""
    if not template:
        return None
    for cls in FORMATS.all():
        if cls.matches(template, has_token):
            return cls(template)
    return None


def can_think(template: str | None, has_token: HasToken = no_token) -> bool:
    """Whether a model can think (the `thinking` capability)."""
    return detect(template, has_token) is not None


__all__ = ["ReasoningFormat", "Split", "Splitter", "Switch", "can_think", "detect"]
