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
]
