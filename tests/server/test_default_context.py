"""The default context on `localrun serve`'s own defaults: a chat of Open WebUI's shape (its
built-in tools sent with every message, a prompt past 4096 tokens) answers, and a prompt past
the model's trained context is still a clear 400."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import ollama
import pytest

from localrun.cli import build_parser
from localrun.cli.options import load_options_from_args
from localrun.fit import Shape, choose_context

from .conftest import MODEL, Served, serve

TRAINED = 8192  # the starter's llama.context_length

# Function schemas in the shape of Open WebUI's built-in tools (notes, memories, knowledge,
# chats, channels, web, images, code, time), each with its parameters described.
_TOOLS = {
    "search_web": ("Search the public web for up-to-date information and return the most relevant results "
                   "with their titles, links and snippets", {"query": "the search terms", "count": "how many results"}),
    "fetch_url": ("Fetch a web page and return its main text content, without navigation and scripts",
                  {"url": "the address of the page to fetch"}),
    "search_notes": ("Search the user's notes by title and content and return the matching notes with an excerpt",
                     {"query": "words to look for", "count": "how many notes", "start_timestamp": "only notes updated "
                      "after this Unix time", "end_timestamp": "only notes updated before this Unix time"}),
    "view_note": ("Return the whole content of one of the user's notes", {"note_id": "the note's id"}),
    "write_note": ("Create a new note for the user with a title and Markdown content",
                   {"title": "the note's title", "content": "the note's Markdown text"}),
    "replace_note_content": ("Replace the content of an existing note, keeping its title",
                             {"note_id": "the note's id", "content": "the new Markdown text", "title": "a new title"}),
    "search_memories": ("Search what the assistant remembers about the user and return the closest memories",
                        {"query": "what to look for", "count": "how many memories"}),
    "add_memory": ("Remember a fact about the user for later conversations", {"content": "the fact to remember"}),
    "replace_memory_content": ("Replace the text of a memory", {"memory_id": "the memory's id",
                                                                 "content": "the new text"}),
    "delete_memory": ("Forget a memory", {"memory_id": "the memory's id"}),
    "list_memories": ("List every memory the assistant keeps about the user", {}),
    "search_chats": ("Search the user's earlier chats by title and message text",
                     {"query": "words to look for", "count": "how many chats", "start_timestamp": "only chats "
                      "updated after this Unix time", "end_timestamp": "only chats updated before this Unix time"}),
    "view_chat": ("Return the messages of one of the user's earlier chats", {"chat_id": "the chat's id"}),
    "list_knowledge_bases": ("List the knowledge bases the user can read, with their descriptions", {}),
    "search_knowledge_bases": ("Find knowledge bases whose name or description matches the query",
                               {"query": "words to look for", "count": "how many knowledge bases"}),
    "query_knowledge_bases": ("Search the documents of the knowledge bases by meaning and return the passages "
                              "closest to the query with their sources",
                              {"query": "what to find", "knowledge_ids": "the knowledge bases to search (all when "
                               "empty)", "count": "how many passages"}),
    "search_knowledge_files": ("Find files in the knowledge bases by their names",
                               {"query": "part of the file name", "knowledge_id": "one knowledge base",
                                "count": "how many files"}),
    "query_knowledge_files": ("Search the attached files by meaning and return the closest passages",
                              {"query": "what to find", "file_ids": "the files to search", "count": "how many passages"}),
    "view_knowledge_file": ("Return the whole text of a file of a knowledge base", {"file_id": "the file's id"}),
    "view_file": ("Return the text content of a file the user attached to the chat", {"file_id": "the file's id"}),
    "list_channels": ("List the channels the user is a member of", {}),
    "search_channels": ("Find channels whose name or description matches the query",
                        {"query": "words to look for", "count": "how many channels"}),
    "search_channel_messages": ("Search the messages of the user's channels",
                                {"query": "words to look for", "channel_id": "one channel", "count": "how many messages",
                                 "start_timestamp": "only messages after this Unix time",
                                 "end_timestamp": "only messages before this Unix time"}),
    "view_channel_message": ("Return a channel message with its replies", {"message_id": "the message's id"}),
    "view_channel_thread": ("Return every message of a thread in a channel", {"message_id": "the thread's first "
                                                                              "message"}),
    "generate_image": ("Generate an image from a text description and show it in the chat",
                       {"prompt": "what the image shows, in detail", "size": "WIDTHxHEIGHT in pixels",
                        "negative_prompt": "what the image must not show"}),
    "edit_image": ("Change an image the user attached, following an instruction",
                   {"prompt": "the change to make", "image_url": "the image to change"}),
    "execute_code": ("Run Python code in a sandbox and return its standard output, errors and any files it made",
                     {"code": "the Python source", "timeout": "seconds before it is stopped"}),
    "get_current_timestamp": ("Return the current date and time as a Unix timestamp and in ISO 8601", {}),
    "calculate_timestamp": ("Add or subtract a duration from a date and return the result",
                            {"days_ago": "days back", "weeks_ago": "weeks back", "months_ago": "months back",
                             "years_ago": "years back"}),
    "convert_timezone": ("Convert a date and time from one time zone to another",
                         {"datetime": "an ISO 8601 date and time", "from_zone": "an IANA zone name",
                          "to_zone": "an IANA zone name"}),
    "list_models": ("List the models the user can chat with, with their capabilities", {}),
    "view_model": ("Return the description, system prompt and tools of one model", {"model_id": "the model's id"}),
    "list_prompts": ("List the user's saved prompts with their commands", {}),
    "view_prompt": ("Return the text of a saved prompt", {"command": "the prompt's slash command"}),
    "list_tools": ("List the tools installed for the user, with their descriptions", {}),
    "list_folders": ("List the user's chat folders", {}),
    "move_chat_to_folder": ("Move a chat into a folder", {"chat_id": "the chat's id", "folder_id": "the folder's id"}),
    "share_chat": ("Make a chat readable by a link and return the link", {"chat_id": "the chat's id"}),
    "get_user_settings": ("Return the user's interface settings: language, theme, default model", {}),
}


def _tool(name: str, description: str, params: dict[str, str]) -> dict[str, Any]:
    props = {k: {"type": "integer" if k in ("count", "timeout") or "ago" in k or k.endswith("timestamp") else "string",
                 "description": v} for k, v in params.items()}
    return {"type": "function", "function": {
        "name": name, "description": f"{description}. Only when needed.",
        "parameters": {"type": "object", "properties": props, "required": list(params)[:1]}}}


TOOLS = [_tool(name, *spec) for name, spec in _TOOLS.items()]


@pytest.fixture(scope="module")
def served_on_defaults() -> Iterator[Served]:
    """The server with `localrun serve`'s own load options (no --ctx, its default --parallel)."""
    args = build_parser().parse_args(["serve"])
    options = load_options_from_args(args, n_parallel=args.parallel)
    assert options.n_ctx is None and options.n_parallel > 1
    with serve(options) as s:
        yield s


def test_a_chat_with_open_webuis_tools_answers_on_defaults(served_on_defaults: Served) -> None:
    client = served_on_defaults.ollama()
    assert len(TOOLS) == 40
    assert re.search(rf"^num_ctx +{TRAINED}$", client.show(MODEL).parameters, re.M)
    out = client.chat(model=MODEL, messages=[{"role": "user", "content": "What is the opposite of hot?"}],
                      tools=TOOLS, options={"temperature": 0, "num_predict": 8})
    assert out.done and 4096 < out.prompt_eval_count < TRAINED and out.eval_count > 0
    ps = client.ps().models
    assert [(m.model, m.context_length) for m in ps] == [(MODEL, TRAINED)]


def test_a_prompt_past_the_trained_context_is_a_clear_400(served_on_defaults: Served) -> None:
    client = served_on_defaults.ollama()
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "hot cold " * TRAINED}],
                    options={"num_predict": 8})
    assert e.value.status_code == 400
    assert f"but the context holds {TRAINED}" in e.value.error


def test_the_default_follows_memory_and_the_sequences() -> None:
    shape = Shape(layers=32, kv_heads=8, key_dim=128, value_dim=128, context_length=131072)
    per_token = 32 * 8 * 256 * 2
    weights = 4 << 30
    # Plenty of memory: the trained context for every sequence.
    big = choose_context(shape, weights, sequences=4, memory=1 << 40)
    assert (big.tokens, big.reason) == (131072, "fits in memory for 4 sequences")
    # 24 GiB: half of it, less the weights and buffers, shared by 4 sequences, in whole 256s.
    small = choose_context(shape, weights, sequences=4, memory=24 << 30)
    room = (12 << 30) - weights - ((256 << 20) + weights // 20)
    assert small.tokens == room // (4 * per_token) // 256 * 256 and small.tokens < 131072
    assert small.text == f"{small.tokens} (trained 131072; memory holds {small.tokens} tokens for 4 sequences)"
    assert choose_context(shape, weights, sequences=1, memory=24 << 30).tokens > small.tokens
    # Never under 4096 (the engine then reports what it cannot allocate), --ctx always wins.
    assert choose_context(shape, weights, sequences=4, memory=8 << 30).tokens == 4096
    assert choose_context(shape, weights, requested=1000, memory=1).text == "1000 (trained 131072; set by --ctx)"
    unknown = choose_context(Shape(None, None, None, None, None), weights)
    assert (unknown.tokens, unknown.trained) == (4096, None)

