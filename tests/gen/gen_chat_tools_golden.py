#!/usr/bin/env python3
"""gen_chat_tools_golden.py - golden prompts with tools, tool calls, tool
results and reasoning for tests/test_chat_tools.c, rendered by HF
transformers' apply_chat_template with each model's own template:

  qwen3     tokenizer_config.json of /work/shared/data/tokenizers/qwen3
  qwen2.5   tests/data/tokenizer/templates/qwen2.5.jinja (Qwen2.5-7B-Instruct)
  llama3.1  tests/data/tokenizer/templates/llama3.1.jinja (Llama-3.1-8B-Instruct)
  llama3.2  tests/data/tokenizer/templates/llama3.2.jinja (Llama-3.2-3B-Instruct)

(The three .jinja files are the models' chat templates as shipped in the
llama-cpp-python 0.3.16 source distribution on PyPI, models/templates/; see
tests/data/tokenizer/templates/README.md.) The Qwen templates render with the
Qwen3 tokenizer and the Llama ones with the Llama-3 tokenizer (for bos_token).

Tool-call arguments are objects, as lethe (and vLLM) pass them to the
template after parsing the OpenAI JSON string; one case keeps a string.
Writes tests/data/tokenizer/chat_tools_golden.jsonl, one case per line:
  {"template", "case", "messages", "tools", "kwargs", "add_generation_prompt",
   "expected"} or {"...", "error": "<message>"} when the template raises.
Run from the repo root: python3 tests/gen/gen_chat_tools_golden.py
"""
import json
import os

from transformers import PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK = "/work/shared/data/tokenizers"
TDIR = os.path.join(ROOT, "tests", "data", "tokenizer", "templates")
OUT = os.path.join(ROOT, "tests", "data", "tokenizer", "chat_tools_golden.jsonl")


def tokenizer(name, template_file=None):
    d = os.path.join(TOK, name)
    cfg = json.load(open(os.path.join(d, "tokenizer_config.json")))
    tk = PreTrainedTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json"),
                                 bos_token=cfg.get("bos_token"), eos_token=cfg.get("eos_token"))
    tk.chat_template = open(os.path.join(TDIR, template_file)).read() if template_file else cfg["chat_template"]
    return tk


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
NUMBERS = {"type": "function", "function": {
    "name": "set_level", "description": "Température °C — ☀ and a tab\there, a back\\slash, ctrl \x01.",
    "parameters": {"type": "object", "properties": {
        "level": {"type": "number", "minimum": 0, "maximum": 1.5, "default": 1.0, "multipleOf": 0.25},
        "big": {"type": "integer", "maximum": 100000000000000000000, "exclusiveMinimum": -1e-07},
        "ratio": {"type": "number", "default": 1e16, "examples": [0.0001, 1e-05, 123456789.125, -0.0]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "default": [True, False, None]}},
        "required": ["level"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Web search.",
                                           "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NUMBERS, SEARCH]


def call(i, name, args):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


SYS = {"role": "system", "content": "  You are a careful assistant.\n"}
U1 = {"role": "user", "content": "What's the weather in Paris? "}
A_CALL = {"role": "assistant", "content": "", "tool_calls": [call(1, "get_weather", {"city": "Paris", "unit": "celsius"})]}
T1 = {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"}
A_FINAL = {"role": "assistant", "content": "It is 21.5 °C and clear in Paris."}
U2 = {"role": "user", "content": "And in Tokyo and Oslo?"}
A_TWO = {"role": "assistant", "content": "", "tool_calls": [call(2, "get_weather", {"city": "Tokyo"}),
                                                            call(3, "get_weather", {"city": "Oslo", "unit": "fahrenheit"})]}
T2 = {"role": "tool", "tool_call_id": "call_2", "content": "rainy, 14"}
T3 = {"role": "tool", "tool_call_id": "call_3", "content": "snow\n-3"}
A_TEXT_CALL = {"role": "assistant", "content": "Let me check that.",
               "tool_calls": [call(4, "set_level", {"level": 0.75, "big": 3, "flags": [True]})]}
A_STR_ARGS = {"role": "assistant", "content": "", "tool_calls": [call(5, "search", "{\"q\":\"lethe\",  \"n\": 2}")]}

CASES = [
    ("sys_user_tools", [SYS, U1], TOOLS, {}),
    ("user_tools", [U1], [WEATHER], {}),
    ("loop_one_call", [SYS, U1, A_CALL, T1], TOOLS, {}),
    ("loop_final", [SYS, U1, A_CALL, T1, A_FINAL], TOOLS, {}),
    ("loop_second_turn", [U1, A_CALL, T1, A_FINAL, U2], TOOLS, {}),
    ("parallel_calls", [U1, A_CALL, T1, A_FINAL, U2, A_TWO, T2, T3], TOOLS, {}),
    ("content_and_call", [SYS, U1, A_TEXT_CALL, {"role": "tool", "content": "ok"}], TOOLS, {}),
    ("string_arguments", [U1, A_STR_ARGS, {"role": "tool", "content": "[]"}], TOOLS, {}),
    ("calls_without_tools", [U1, A_CALL, T1], None, {}),
    ("no_tools_plain", [SYS, U1, A_FINAL, U2], None, {}),
]
QWEN3_CASES = [
    ("thinking_off", [U1], TOOLS, {"enable_thinking": False}),
    ("thinking_off_no_tools", [SYS, U1], None, {"enable_thinking": False}),
    ("reasoning_field", [U1, {"role": "assistant", "content": "", "reasoning_content": "\nNeed the weather.\n",
                              "tool_calls": A_CALL["tool_calls"]}, T1], TOOLS, {}),
    ("reasoning_in_content", [U1, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nCalling.",
                                   "tool_calls": A_CALL["tool_calls"]}, T1,
                              {"role": "assistant", "content": "<think>done</think>It is warm."}], TOOLS, {}),
    ("reasoning_before_last_query", [U1, {"role": "assistant", "content": "<think>\nold\n</think>\n\nWarm."}, U2],
     None, {}),
]
LLAMA_CASES = [
    ("tools_in_system", [SYS, U1, A_CALL, T1], TOOLS, {"tools_in_user_message": False}),
    ("date_string", [U1], [WEATHER], {"date_string": "02 Dec 2025"}),
    ("several_calls_raise", [U1, A_TWO, T2, T3], TOOLS, {}),
    ("no_first_user_raise", [SYS], TOOLS, {}),
]


def main():
    toks = {"qwen3": tokenizer("qwen3"), "qwen2.5": tokenizer("qwen3", "qwen2.5.jinja"),
            "llama3.1": tokenizer("llama3", "llama3.1.jinja"), "llama3.2": tokenizer("llama3", "llama3.2.jinja")}
    n = 0
    with open(OUT, "w", encoding="utf-8") as f:
        for tname, tk in toks.items():
            cases = CASES + (QWEN3_CASES if tname == "qwen3" else LLAMA_CASES if tname.startswith("llama") else [])
            for cname, msgs, tools, kwargs in cases:
                if tname == "llama3.2":
                    kwargs = dict(kwargs, date_string=kwargs.get("date_string", "26 Jul 2024"))
                if tname.startswith("llama") and cname in ("parallel_calls",):
                    cname, msgs = "parallel_calls_raise", msgs
                for gen in (True, False):
                    rec = {"template": tname, "case": cname, "messages": msgs, "tools": tools, "kwargs": kwargs,
                           "add_generation_prompt": gen}
                    try:
                        rec["expected"] = tk.apply_chat_template(msgs, tools=tools, tokenize=False,
                                                                 add_generation_prompt=gen, **kwargs)
                    except Exception as ex:  # the template's raise_exception
                        rec["error"] = str(ex)
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    n += 1
    print(f"wrote {n} cases to {OUT}")


if __name__ == "__main__":
    main()
