"""Tool calling: OpenAI/Ollama tools in, each model family's own call syntax out and back.

The family is read from the chat template (`detect_format`): one module per family in this
package, each a `ToolFormat` registered with `@register(order)` (see `base`). A template that
renders `tools` itself gets them (`ToolFormat.native`); otherwise, and for history turns a
template cannot show, `prepare` writes tools and calls as text. `grammar` / `lazy_grammar` force
the family's call syntax with every function's arguments checked against its schema (llguidance
Lark, with `<<special:TEXT>>` where the opener may be one token), and `parse` / `streamer` read
the calls back. `ToolPlan` ties them together for one request.
"""

from __future__ import annotations

from localrun.tools.base import ToolFormat, detect_format
from localrun.tools.lark import resolve_specials
from localrun.tools.plan import ToolPlan
from localrun.tools.request import normalize_choice, parse_tools
from localrun.tools.stream import Event, ToolCall

__all__ = [
    "Event",
    "ToolCall",
    "ToolFormat",
    "ToolPlan",
    "detect_format",
    "normalize_choice",
    "parse_tools",
    "resolve_specials",
]
