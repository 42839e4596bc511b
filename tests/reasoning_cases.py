"""llama.cpp's own reasoning cases (vendor/llama.cpp/tests/test-chat.cpp of llama-cpp-python
0.3.36), ported: a template, whether thinking was switched on (None: not set, so llama.cpp's default, on), the
model's raw output, and what llama.cpp parses it into. `answer` is llama.cpp's content followed by
the raw tool-call text that llama.cpp parses into tool_calls (the splitter leaves calls in the
answer, or in `calls` for harmony, for the tool parser). `note` explains a deliberate difference.
"""

from __future__ import annotations

from typing import NamedTuple

THOUGHT, ANSWER = "I'm\nthinking", "Hello, world!\nWhat's up?"
QWEN_CALL = ("<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n"
             "</function>\n</tool_call>")
PWD_CALL = ("<tool_call>\n<function=run_in_terminal>\n<parameter=command>\npwd\n</parameter>\n"
            "</function>\n</tool_call>")
MISTRAL_CALL = '[TOOL_CALLS]special_function[ARGS]{"arg1":1}'
R1_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
           '```json\n{"arg1": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
R7B_CALL = ('<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "special_function", '
            '"parameters": {"arg1": 1}}\n]<|END_ACTION|>')
KIMI_K3_CALL = ('<|open|>tools<|sep|><|open|>call tool="special_function" index="1"<|sep|>'
                '<|open|>argument key="arg1" type="number"<|sep|>1<|close|>argument<|sep|>'
                '<|close|>call<|sep|><|close|>tools<|sep|>')
KIMI_K3_END = "<|close|>message<|sep|>"
APERTUS_CALL = '<|tools_prefix|>[{"special_function": {"arg1": 1}}]<|tools_suffix|>'
APRIEL_CALL = '<tool_calls>[{"name": "special_function", "arguments": {"arg1": 1}}]</tool_calls>'
MM = "]<]minimax[>["


def minimax_call(*invokes: str) -> str:
    """A MiniMax-M3 tool-call block of the given invokes (each `NAME` or `NAME:KEY=VALUE`)."""
    body = ""
    for invoke in invokes:
        name, _, arg = invoke.partition(":")
        key, _, value = arg.partition("=")
        body += f'{MM}<invoke name="{name}">' + (f"{MM}<{key}>{value}{MM}</{key}>" if key else "") + f"{MM}</invoke>\n"
    return f"{MM}<tool_call>\n{body}{MM}</tool_call>"


def gemma4_call(city: str) -> str:
    """A Gemma 4 get_time call (its own argument syntax, strings between <|"|>)."""
    return f'<|tool_call>call:get_time{{city:<|"|>{city}<|"|>}}<tool_call|>'


ATEM_CALL = ('<atem:function_calls>\n<atem:invoke name="special_function">\n'
             '<atem:parameter name="arg1">1</atem:parameter>\n</atem:invoke>\n</atem:function_calls>')
INVOICE = '{"amount": 123.45, "date": "2025-12-03"}'


class Case(NamedTuple):
    line: int  # where the case is in test-chat.cpp
    template: str
    think: bool | None
    raw: str
    thinking: str
    answer: str
    calls: str = ""
    note: str = ""


CASES: list[Case] = [
    Case(2150, "Qwen3.5-4B", True, f"{THOUGHT}\n</think>\n\n{ANSWER}", THOUGHT, ANSWER),
    Case(2174, "Qwen3.5-4B", None, f"{THOUGHT}\n</think>\n\n{QWEN_CALL}", THOUGHT, QWEN_CALL),
    Case(2379, "Qwen3.5-4B", None, f"<think>\n\n</think>\n\n{QWEN_CALL}", "", QWEN_CALL,
         note="llama.cpp keeps the repeated '<think>' as reasoning text; an opening marker the model "
              "repeats right after the prompt opened the thought is swallowed here, so no marker leaks"),
    Case(2392, "Qwen3.5-4B", None, f"</think>\n\n{QWEN_CALL}", "", QWEN_CALL),
    Case(2406, "Qwen3.5-4B", True, f"</think>\n\n{PWD_CALL}", "", PWD_CALL),
    Case(2425, "Qwen3.5-4B", True, f"</think>\n\nLet me inspect the current directory.\n{PWD_CALL}", "",
         f"Let me inspect the current directory.\n{PWD_CALL}"),
    Case(2467, "Qwen3.5-4B", True,
         f"I should inspect the directory.\n</think>\n\nLet me inspect it now.\n{PWD_CALL}",
         "I should inspect the directory.", f"Let me inspect it now.\n{PWD_CALL}"),
    Case(2604, "mistralai-Ministral-3-14B-Reasoning-2512", None, ANSWER, "", ANSWER),
    Case(2611, "mistralai-Ministral-3-14B-Reasoning-2512", True, f"[THINK]{THOUGHT}[/THINK]{ANSWER}",
         THOUGHT, ANSWER),
    Case(2618, "mistralai-Ministral-3-14B-Reasoning-2512", True, MISTRAL_CALL, "", MISTRAL_CALL),
    Case(2625, "mistralai-Ministral-3-14B-Reasoning-2512", True, f"[THINK]{THOUGHT}[/THINK]{MISTRAL_CALL}",
         THOUGHT, MISTRAL_CALL),
    Case(2711, "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", True, f"{THOUGHT}\n</think>\n\n{ANSWER}", THOUGHT, ANSWER),
    Case(2822, "CohereForAI-c4ai-command-r7b-12-2024-tool_use", None,
         f"<|START_RESPONSE|>{ANSWER}<|END_RESPONSE|>", "", ANSWER),
    Case(2824, "CohereForAI-c4ai-command-r7b-12-2024-tool_use", None,
         f"<|START_THINKING|>{THOUGHT}<|END_THINKING|><|START_RESPONSE|>{ANSWER}<|END_RESPONSE|>", THOUGHT, ANSWER),
    Case(2837, "CohereForAI-c4ai-command-r7b-12-2024-tool_use", None,
         f"<|START_THINKING|>{THOUGHT}<|END_THINKING|>{R7B_CALL}", THOUGHT, R7B_CALL),
    Case(3299, "Qwen-QwQ-32B", True, "Let me think about this...\n</think>\nThe answer is 42.",
         "Let me think about this...", "The answer is 42."),
    Case(3305, "Qwen-QwQ-32B", None, "</think>Hello, world!", "", "Hello, world!"),
    Case(3369, "ibm-granite-granite-3.3-2B-Instruct", None, ANSWER, "", ANSWER),
    Case(3371, "ibm-granite-granite-3.3-2B-Instruct", None, f"<think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    Case(3447, "ByteDance-Seed-OSS", None, ANSWER, "", ANSWER),
    Case(3449, "ByteDance-Seed-OSS", None, "<seed:think>I'm thinking about the answer</seed:think>\nHello, world!",
         "I'm thinking about the answer", "Hello, world!"),
    Case(5991, "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", None, f"</think>{ANSWER}", "", ANSWER),
    Case(5995, "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", True, f"{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    Case(6025, "llama-cpp-deepseek-r1", None, f"</think>{ANSWER}", "", ANSWER),
    Case(6026, "llama-cpp-deepseek-r1", None, f"{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    Case(6030, "llama-cpp-deepseek-r1", None, f"</think>{R1_CALL}", "", R1_CALL),
    Case(6428, "openai-gpt-oss-120b", None, f"<|channel|>final<|message|>{ANSWER}", "", ANSWER),
    Case(6431, "openai-gpt-oss-120b", None, f"<|channel|>commentary<|message|>{ANSWER}", "", ANSWER),
    Case(6434, "openai-gpt-oss-120b", None,
         f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}",
         THOUGHT, ANSWER),
    Case(6451, "openai-gpt-oss-120b", None, f"<|channel|>analysis<|message|>{THOUGHT}", THOUGHT, ""),
    Case(6458, "openai-gpt-oss-120b", None,
         ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', "", "",
         calls=' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}'),
    Case(6465, "openai-gpt-oss-120b", None,
         '<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', "", "",
         calls='<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}'),
    # Gemma 4
    Case(2994, "google-gemma-4-31B-it", None, "Hello, world!", "", "Hello, world!"),
    Case(2997, "google-gemma-4-31B-it", None, f"<|channel>thought\n{THOUGHT}<channel|>{ANSWER}", THOUGHT, ANSWER),
    Case(3004, "google-gemma-4-31B-it", None, f"<|channel>thought<channel|>{ANSWER}", "", ANSWER),
    Case(3018, "google-gemma-4-31B-it", None, gemma4_call("London"), "", gemma4_call("London")),
    Case(3039, "google-gemma-4-31B-it", None, ANSWER + gemma4_call("Paris"), "", ANSWER + gemma4_call("Paris")),
    Case(3054, "google-gemma-4-31B-it", None, f"<|channel>thought\n{THOUGHT}<channel|>" + gemma4_call("Paris"),
         THOUGHT, gemma4_call("Paris")),
    Case(3155, "google-gemma-4-31B-it", None, f"<|channel>thought\n<channel|>{ANSWER}<channel|>", "", ANSWER),
    Case(3161, "google-gemma-4-31B-it", None, f"<|channel>thought\n<channel|>{ANSWER}<|channel>thought\n<channel|>",
         "", ANSWER),
    Case(3167, "google-gemma-4-31B-it", None,
         f"<|channel>thought\n<channel|>{ANSWER}<|channel>thought\n<channel|><channel|>", "", ANSWER),
    Case(3173, "google-gemma-4-31B-it", None, f"<|channel><|channel>thought\n<channel|>{ANSWER}", "", ANSWER),
    # Kimi K3: the generation prompt opens the thought
    Case(4869, "Kimi-K3", None, f"<|open|>response<|sep|>{ANSWER}<|close|>response<|sep|>{KIMI_K3_END}", "", ANSWER),
    Case(4875, "Kimi-K3", None,
         f"I'm thinking about this<|close|>think<|sep|><|open|>response<|sep|>{ANSWER}<|close|>response<|sep|>"
         + KIMI_K3_END, "I'm thinking about this", ANSWER),
    Case(4883, "Kimi-K3", None,
         "<|open|>response<|sep|>Use the response tag, then message the handler.<|close|>response<|sep|>"
         + KIMI_K3_END, "", "Use the response tag, then message the handler."),
    Case(4889, "Kimi-K3", None, "I was still thinking when the budget ran out",
         "I was still thinking when the budget ran out", ""),
    Case(4895, "Kimi-K3", None, f"<|open|>response<|sep|><|close|>response<|sep|>{KIMI_K3_CALL}{KIMI_K3_END}", "",
         KIMI_K3_CALL),
    Case(4907, "Kimi-K3", None,
         f"I should call it<|close|>think<|sep|><|open|>response<|sep|>On it.<|close|>response<|sep|>{KIMI_K3_CALL}"
         + KIMI_K3_END, "I should call it", "On it." + KIMI_K3_CALL),
    # Apertus (llama.cpp's cases have no thought: it splits none for Apertus)
    Case(5424, "Apertus-8B-Instruct", None, APERTUS_CALL, "", APERTUS_CALL),
    # MiniMax-M3: a reply without a thought starts with the closing marker alone
    Case(5495, "MiniMax-M3", True, f"</mm:think>{ANSWER}", "", ANSWER),
    Case(5503, "MiniMax-M3", True, f"<mm:think>{THOUGHT}</mm:think>{ANSWER}", THOUGHT, ANSWER),
    Case(5511, "MiniMax-M3", True, "<mm:think>Let me check the time</mm:think>" + minimax_call("get_time:city=Tokyo"),
         "Let me check the time", minimax_call("get_time:city=Tokyo")),
    Case(5526, "MiniMax-M3", True, "</mm:think>" + minimax_call("special_function:arg1=1"), "",
         minimax_call("special_function:arg1=1")),
    Case(5541, "MiniMax-M3", True, "<mm:think>Let's call a tool:</mm:think>" + minimax_call("empty_args"),
         "Let's call a tool:", minimax_call("empty_args")),
    Case(5555, "MiniMax-M3", True,
         "<mm:think>Calling both</mm:think>" + minimax_call("get_time:city=Paris", "get_weather:city=Paris"),
         "Calling both", minimax_call("get_time:city=Paris", "get_weather:city=Paris")),
    Case(5576, "MiniMax-M3", True,
         "<mm:think>Thinking about it</mm:think>Let me call the function." + minimax_call("special_function:arg1=1"),
         "Thinking about it", "Let me call the function." + minimax_call("special_function:arg1=1")),
    Case(5813, "MiniMax-M3", True, "<mm:think></mm:think>" + minimax_call("get_time:city=XYZCITY"), "",
         minimax_call("get_time:city=XYZCITY")),
    # Apriel 1.5 (llama.cpp splits no thought for it) and 1.6, whose prompt opens the thought
    Case(6191, "unsloth-Apriel-1.5", None, ANSWER, "", ANSWER),
    Case(6192, "unsloth-Apriel-1.5", None, APRIEL_CALL, "", APRIEL_CALL),
    Case(6211, "Apriel-1.6-15b-Thinker-fixed", True, f"{THOUGHT}\n[BEGIN FINAL RESPONSE]\n{ANSWER}", THOUGHT, ANSWER,
         note="llama.cpp's reasoning starts with the generation prompt's 'Here are my reasoning steps:\\n'; "
              "the thinking here is what the model wrote"),
    Case(6219, "Apriel-1.6-15b-Thinker-fixed", True, f"{THOUGHT}\n[BEGIN FINAL RESPONSE]\n{APRIEL_CALL}", THOUGHT,
         APRIEL_CALL, note="as 6211: llama.cpp's reasoning also holds the prompt's opening"),
    # muse-glimmer: messages to=self (thinking), to=user (answer), to=TOOL (calls)
    Case(6365, "muse-glimmer", None, f" to=user<|message|>{ANSWER}<|eot|>", "", ANSWER),
    Case(6372, "muse-glimmer", None, f" to=special_function<|message|>{ATEM_CALL}", "", "",
         calls=f" to=special_function<|message|>{ATEM_CALL}"),
    Case(6380, "muse-glimmer", None,
         f" to=user<|message|>{ANSWER}<|eom|><|start|>assistant to=special_function<|message|>{ATEM_CALL}", "",
         ANSWER, calls=f" to=special_function<|message|>{ATEM_CALL}"),
    Case(6391, "muse-glimmer", None, f" to=user<|message|>You invoke it like this:\n{ATEM_CALL}<|eot|>", "",
         f"You invoke it like this:\n{ATEM_CALL}"),
    Case(6398, "muse-glimmer", None, f" to=user<|message|>{INVOICE}", "", INVOICE),
    Case(6405, "muse-glimmer", None,
         " to=self<|message|>I need to output the invoice details in JSON<|eom|><|start|>assistant to=user<|message|>"
         + INVOICE, "I need to output the invoice details in JSON", INVOICE),
    Case(6414, "muse-glimmer", None,
         f" to=self<|message|>I could use {ATEM_CALL} here<|eom|><|start|>assistant to=user<|message|>Hello!<|eot|>",
         f"I could use {ATEM_CALL} here", "Hello!"),
]

# Replies test-chat.cpp has no case for (Hy3, Solar Open, Apertus and Apriel 1.5 have no reasoning case
# there), written from the markers their templates render; line 0: not from test-chat.cpp. `note`
# says what llama.cpp's own parser (the same sdist's, built) makes of them.
HY3_CALL = ("<tool_calls:opensource>\n<tool_call:opensource>special_function<tool_sep:opensource>\n"
            "<arg_key:opensource>arg1</arg_key:opensource>\n<arg_value:opensource>1</arg_value:opensource>\n"
            "</tool_call:opensource>\n</tool_calls:opensource>")
SOLAR_CALL = ('<|tool_calls|><|tool_call:begin|>a1b2c3d4e5<|tool_call:name|>special_function'
              '<|tool_call:args|>{"arg1": 1}<|tool_call:end|><|calls|>')
OWN_CASES: list[Case] = [
    Case(0, "google-gemma-4-31B-it", None,
         f"<|channel>thought\nFirst<channel|>{ANSWER}<|channel>thought\nSecond<channel|> More.", "First",
         ANSWER + " More.", note="llama.cpp adds a thought channel after the answer to the reasoning ('FirstSecond'); "
                                 "here the thought comes before the answer, and a later channel is dropped, as "
                                 "Gemma 4's template drops it from the history"),
    Case(0, "google-gemma-4-31B-it", None, f"{ANSWER}<channel|>More.", "", ANSWER + "More.",
         note="llama.cpp stops at a stray <channel|> and drops what follows; here only the token is dropped"),
    Case(0, "Kimi-K3", False, f"{ANSWER}<|close|>response<|sep|>{KIMI_K3_END}", "", ANSWER,
         note="llama.cpp's parser gives the same (thinking off: the prompt opens the response)"),
    Case(0, "tencent-Hy3", True, f"{THOUGHT}</think:opensource>{ANSWER}", THOUGHT, ANSWER,
         note="llama.cpp's parser gives the same (reasoning_effort high opens the thought)"),
    Case(0, "tencent-Hy3", True, f"{THOUGHT}</think:opensource>{HY3_CALL}", THOUGHT, HY3_CALL,
         note="llama.cpp's parser gives the same thought and parses the call"),
    Case(0, "tencent-Hy3", False, ANSWER, "", ANSWER, note="llama.cpp's parser gives the same"),
    Case(0, "upstage-Solar-Open-100B", True, f"<|think|>{THOUGHT}<|end|><|begin|>assistant<|content|>{ANSWER}<|end|>",
         THOUGHT, ANSWER, note="llama.cpp splits no thought for Solar Open: all of it is content, markers and all"),
    Case(0, "upstage-Solar-Open-100B", True, f"<|think|>{THOUGHT}<|end|><|begin|>assistant{SOLAR_CALL}", THOUGHT,
         SOLAR_CALL, note="llama.cpp's parser fails on this reply"),
    Case(0, "upstage-Solar-Open-100B", False, f"<|content|>{ANSWER}<|end|>", "", ANSWER,
         note="llama.cpp's parser gives the same"),
    Case(0, "Apertus-8B-Instruct", True, f"<|inner_prefix|>{THOUGHT}<|inner_suffix|>{ANSWER}", THOUGHT, ANSWER,
         note="llama.cpp splits no thought for Apertus: all of it is content"),
    Case(0, "unsloth-Apriel-1.5", None,
         f"Here are my reasoning steps:\n{THOUGHT}\n[BEGIN FINAL RESPONSE]\n{ANSWER}\n[END FINAL RESPONSE]",
         THOUGHT, ANSWER + "\n", note="llama.cpp splits no thought for Apriel 1.5: all of it is content; the "
                                        "newline before the end marker streams out before the marker does"),
]
