"""The Responses API's `mcp` tools on the MCP servers `serve --mcp` names, with the official openai
client: tools listed (mcp_list_tools), a call run within the response (mcp_call) and the model's
answer after it, approval asked (mcp_approval_request) and answered (mcp_approval_response), every
streamed event checked by the openai package's types, and what a request may not do (a server
the owner did not list, a URL of its own)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from localrun.settings import LoadOptions
from localrun.tool_servers import ServerSpec, ToolServers

from .conftest import MODEL, Served, serve
from .test_responses import _events

SERVER = Path(__file__).resolve().parents[1] / "mcp_test_server.py"
ASK = "What is the codeword of project Falcon?"
CODEWORD = {"type": "mcp", "server_label": "t", "name": "codeword"}


def mcp_tool(**kw: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "t", "allowed_tools": ["codeword", "add"], **kw}


@pytest.fixture(scope="module")
def served(starter: Path) -> Iterator[Served]:
    with ToolServers({"t": ServerSpec("t", sys.executable, (str(SERVER), "stdio"))}) as servers, \
            serve(LoadOptions(n_ctx=2048, n_parallel=1), mcp=servers) as s:
        yield s


@pytest.fixture(scope="module")
def starter() -> Path:
    from tests.conftest import starter_or_fail

    return starter_or_fail()


def test_a_call_runs_within_the_response_and_the_model_answers_with_its_result(served: Served) -> None:
    client = served.openai()
    res = client.responses.create(model=MODEL, input=ASK, tools=[mcp_tool(require_approval="never")],
                                  tool_choice=CODEWORD, max_tool_calls=1, temperature=0, max_output_tokens=60)
    kinds = [o.type for o in res.output]
    assert kinds[:2] == ["mcp_list_tools", "mcp_call"] and kinds[-1] == "message", kinds
    listing, call = res.output[0], res.output[1]
    assert listing.server_label == "t" and {t.name for t in listing.tools} == {"codeword", "add"}  # allowed_tools
    assert call.name == "codeword" and call.server_label == "t" and call.error is None
    assert call.output is not None and call.output.startswith("The codeword of") and "PELICAN-" in call.output
    assert "PELICAN-" in res.output_text  # the answer read the call's output
    assert res.usage is not None and res.usage.input_tokens > 0
    # the conversation goes on: the servers are not listed again, the call is in the history
    again = client.responses.create(model=MODEL, input="Say it again.", previous_response_id=res.id,
                                    tools=[mcp_tool(require_approval="never")], tool_choice="none",
                                    temperature=0, max_output_tokens=30)
    assert [o.type for o in again.output] == ["message"]


def test_the_stream_sends_openais_mcp_events_in_order(served: Served) -> None:
    events = _events(served, {"model": MODEL, "input": ASK, "tools": [mcp_tool(require_approval="never")],
                              "tool_choice": CODEWORD, "max_tool_calls": 1, "temperature": 0,
                              "max_output_tokens": 60})
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    order = ["response.created", "response.in_progress", "response.output_item.added",
             "response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed", "response.output_item.done",
             "response.output_item.added", "response.mcp_call.in_progress"]
    assert kinds[:len(order)] == order, kinds
    at = kinds.index("response.mcp_call_arguments.done")
    assert "response.mcp_call_arguments.delta" in kinds[len(order):at]
    assert kinds[at + 1:at + 3] == ["response.mcp_call.completed", "response.output_item.done"]
    done = events[at + 2].item
    assert done.type == "mcp_call" and "PELICAN-" in (done.output or "")
    assert "response.output_text.delta" in kinds[at:] and kinds[-1] == "response.completed"
    assert events[-1].response.output[1].output == done.output


def test_approval_is_asked_and_answered(served: Served) -> None:
    client = served.openai()
    asked = client.responses.create(model=MODEL, input=ASK, tools=[mcp_tool()],  # require_approval: always
                                    tool_choice=CODEWORD, temperature=0, max_output_tokens=60)
    request = asked.output[-1]
    assert request.type == "mcp_approval_request" and request.name == "codeword" and request.server_label == "t"
    assert "project" in json.loads(request.arguments) and asked.status == "completed"
    assert not any(o.type == "mcp_call" for o in asked.output)  # nothing ran
    # refused: the model is told, nothing runs
    no = client.responses.create(model=MODEL, previous_response_id=asked.id, tools=[mcp_tool()], temperature=0,
                                 tool_choice="none", max_output_tokens=30,
                                 input=[{"type": "mcp_approval_response", "approval_request_id": request.id,
                                         "approve": False, "reason": "not now"}])
    refused = no.output[0]
    assert refused.type == "mcp_call" and refused.approval_request_id == request.id and refused.output is None
    assert refused.error is not None
    # approved: it runs, and the model answers with its output
    yes = client.responses.create(model=MODEL, previous_response_id=asked.id, tools=[mcp_tool()], temperature=0,
                                  tool_choice="none", max_output_tokens=60,
                                  input=[{"type": "mcp_approval_response", "approval_request_id": request.id,
                                          "approve": True}])
    ran = yes.output[0]
    assert ran.type == "mcp_call" and ran.approval_request_id == request.id and "PELICAN-" in (ran.output or "")
    assert yes.output[-1].type == "message" and "PELICAN-" in yes.output_text


def test_a_failing_tool_is_an_mcp_call_with_its_error(served: Served) -> None:
    client = served.openai()
    res = client.responses.create(model=MODEL, input="Make it fail.", tools=[mcp_tool(
        require_approval="never", allowed_tools=["fail"])], tool_choice={"type": "mcp", "server_label": "t",
                                                                        "name": "fail"},
        max_tool_calls=1, temperature=0, max_output_tokens=30)
    call = next(o for o in res.output if o.type == "mcp_call")
    assert call.output is None and call.error is not None and call.status == "failed"


def test_what_a_request_may_not_reach(served: Served) -> None:
    client = served.openai()
    with pytest.raises(openai.BadRequestError, match="is not one of this server's MCP servers"):
        client.responses.create(model=MODEL, input=ASK, tools=[{"type": "mcp", "server_label": "elsewhere",
                                                                "server_url": "http://127.0.0.1:1/mcp"}])
    with pytest.raises(openai.BadRequestError, match="server_url"):
        client.responses.create(model=MODEL, input=ASK, tools=[mcp_tool(server_url="http://127.0.0.1:1/mcp")])


def test_a_server_without_mcp_servers_refuses_mcp_tools(starter: Path) -> None:
    with serve(LoadOptions(n_ctx=512)) as plain:
        with pytest.raises(openai.BadRequestError, match="serve --mcp"):
            plain.openai().responses.create(model=MODEL, input=ASK, tools=[mcp_tool()])
