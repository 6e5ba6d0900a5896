"""Tool calling, reasoning output and structured output through the official
`openai` client (issue 22's checks), on tiny checkpoints:

  qwen3   dummy (seeded random) weights at a 2-layer Qwen3 shape with the
          Qwen3 vocabulary, served with the shared Qwen3 tokenizer (its chat
          template has tools and <think>); random weights write garbage, so
          tool calls are forced (tool_choice) and reasoning / auto tool
          calls come from forced_token_ids (trace replay);
  smollm2 the default model (real weights; its template has no tools).

Checked: a tool-calling loop (the model calls a tool, the client answers,
the model continues), streaming and not, with tool_choice naming a function
and "required"; tool calls parsed from the model's own <tool_call> output
(auto); reasoning_content in the message and in stream deltas; the Chain
Cache resuming when the client sends back the visible content only; 100
random JSON schemas whose outputs all parse and validate (jsonschema);
json_object and grammar response formats; the errors.
"""
import concurrent.futures as cf
import json
import os
import random

import jsonschema
import openai
import pytest
import requests

from lethe_server import ROOT, Server

os.environ.setdefault("OMP_WAIT_POLICY", "passive")
QWEN3_TOK = next((d for d in (os.path.join(ROOT, "..", "shared", "data", "tokenizers", "qwen3"),
                              "/work/shared/data/tokenizers/qwen3") if os.path.exists(os.path.join(d, "tokenizer.json"))),
                 None)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    assert QWEN3_TOK is not None, "Qwen3 tokenizer not found in ../shared/data/tokenizers/qwen3"
    d = tmp_path_factory.mktemp("tinyqwen3")
    cfg = json.load(open(os.path.join(ROOT, "tests", "data", "tiny-qwen3", "config.json")))
    cfg.update(vocab_size=151936, max_position_embeddings=4096, bos_token_id=151643, eos_token_id=151645)
    json.dump(cfg, open(d / "config.json", "w"))
    srv = Server("--load-format", "dummy", "--tokenizer", QWEN3_TOK, "--threads", "2", "--max-model-len", "2048",
                 model=str(d / "config.json"))
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    srv.model = srv.client.models.list().data[0].id
    yield srv
    srv.stop()


def schema_of(name):
    return next(t for t in TOOLS if t["function"]["name"] == name)["function"]["parameters"]


def check_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    if name:
        assert call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema_of(call.function.name))
    return args


def stream_message(chunks):
    """Folds chat.completion.chunk deltas into (content, reasoning, calls, finish)."""
    content, reasoning, calls, finish = "", "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            e = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                assert e["id"] is None, "a call's id comes once, in its first delta"
                e["id"] = tc.id
                assert tc.function.name, "the first delta of a call names the function"
            e["name"] += tc.function.name or ""
            e["arguments"] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    return content, reasoning, calls, finish


def test_tool_loop_forced_function(qwen3):
    c, m = qwen3.client, qwen3.model
    msgs = [{"role": "system", "content": "You can look up the weather."},
            {"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=m, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=64, seed=1,
                                  extra_body=NO_THINK)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert len(msg.tool_calls) == 1
    check_call(msg.tool_calls[0], "get_weather")
    # the client runs the tool and sends its answer back; the model continues in text
    msgs += [msg.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "{\"temp\": 21, \"sky\": \"clear\"}"}]
    r2 = c.chat.completions.create(model=m, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=8, seed=1,
                                   extra_body=NO_THINK)
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].message.content
    assert r2.choices[0].finish_reason in ("stop", "length")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 10  # the call and the tool result
    # the tool result reached the prompt through the model's template
    toks = requests.post(qwen3.url + "/tokenize", json={"messages": msgs}).json()
    detok = requests.post(qwen3.url + "/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"]
    assert "<tool_response>\n{\"temp\": 21, \"sky\": \"clear\"}\n</tool_response>" in detok
    assert "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " in detok


def test_tool_loop_streaming_required(qwen3):
    c, m = qwen3.client, qwen3.model
    msgs = [{"role": "user", "content": "What time is it in Tokyo?"}]
    s = c.chat.completions.create(model=m, messages=msgs, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=64, seed=5, stream=True,
                                  stream_options={"include_usage": True}, extra_body=NO_THINK)
    content, reasoning, calls, finish = stream_message(s)
    assert finish == "tool_calls" and content == "" and reasoning == ""
    assert list(calls) == [0]
    call = calls[0]
    assert call["id"].startswith("call_") and call["name"] in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call["arguments"]), schema_of(call["name"]))
    # the same call non-streamed (same seed): the same function and arguments
    r = c.chat.completions.create(model=m, messages=msgs, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=64, seed=5, extra_body=NO_THINK)
    tc = r.choices[0].message.tool_calls[0]
    assert (tc.function.name, tc.function.arguments) == (call["name"], call["arguments"])
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "09:30"}]
    s2 = c.chat.completions.create(model=m, messages=msgs, tools=TOOLS, max_tokens=6, seed=5, stream=True,
                                   extra_body=dict(NO_THINK, ignore_eos=True))
    content2, _, calls2, finish2 = stream_message(s2)
    assert finish2 == "length" and content2 and not calls2


def forced(srv, text):
    return requests.post(srv.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_tool_calls_parsed_from_model_output(qwen3):
    """tool_choice auto: the model's own <tool_call> blocks (here replayed with
    forced_token_ids) become tool_calls, parallel ones included, streamed or not."""
    c, m = qwen3.client, qwen3.model
    out = ("Let me check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
           "\"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"arguments\": {\"zone\": 9}, \"name\": "
           "\"get_time\"}\n</tool_call>")
    ids = forced(qwen3, out) + forced(qwen3, "<|im_end|>")
    msgs = [{"role": "user", "content": "Weather in Paris and time in Tokyo?"}]
    body = dict(NO_THINK, forced_token_ids=ids)
    r = c.chat.completions.create(model=m, messages=msgs, tools=TOOLS, max_tokens=len(ids), extra_body=body)
    msg = r.choices[0].message
    assert msg.content == "Let me check both."
    assert [t.function.name for t in msg.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(msg.tool_calls[1].function.arguments) == {"zone": 9}
    s = c.chat.completions.create(model=m, messages=msgs, tools=TOOLS, max_tokens=len(ids), stream=True,
                                  extra_body=body)
    content, _, calls, _ = stream_message(s)
    assert content == "Let me check both."
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == [
        json.loads(t.function.arguments) for t in msg.tool_calls]
    # without tools (or tool_choice none) the same text is plain content
    r = c.chat.completions.create(model=m, messages=msgs, max_tokens=len(ids), extra_body=body)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


def test_reasoning_content(qwen3):
    c, m = qwen3.client, qwen3.model
    ids = forced(qwen3, "<think>\nThe user asks about the sky.\n</think>\n\nIt is blue.")
    msgs = [{"role": "user", "content": "What colour is the sky?"}]
    r = c.chat.completions.create(model=m, messages=msgs, max_tokens=len(ids), extra_body={"forced_token_ids": ids})
    msg = r.choices[0].message
    assert msg.content == "It is blue."
    assert msg.model_extra["reasoning_content"] == "The user asks about the sky."
    s = c.chat.completions.create(model=m, messages=msgs, max_tokens=len(ids), stream=True,
                                  extra_body={"forced_token_ids": ids})
    content, reasoning, _, _ = stream_message(s)
    assert (content, reasoning) == ("It is blue.", "The user asks about the sky.")
    # enable_thinking=false: the template closes an empty think block in the prompt, nothing is split
    p_on = requests.post(qwen3.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}).json()
    p_off = requests.post(qwen3.url + "/v1/chat/completions",
                          json={"messages": msgs, "max_tokens": 1, "enable_thinking": False}).json()
    assert p_off["usage"]["prompt_tokens"] == p_on["usage"]["prompt_tokens"] + 4  # <think>\n\n</think>\n\n
    r = c.chat.completions.create(model=m, messages=msgs, max_tokens=len(ids),
                                  extra_body={"forced_token_ids": ids, **NO_THINK})
    assert "reasoning_content" not in r.choices[0].message.model_extra
    assert r.choices[0].message.content.startswith("<think>")


def test_chain_resumes_with_visible_content_only(tmp_path):
    """The chain holds the turn's reasoning tokens; the client sends back only the
    visible content; the server puts the reasoning back (preserve_thinking, the
    default in chain mode) so the re-rendered prompt continues the chain."""
    assert QWEN3_TOK is not None
    cfg = json.load(open(os.path.join(ROOT, "tests", "data", "tiny-qwen3", "config.json")))
    cfg.update(vocab_size=151936, max_position_embeddings=4096, bos_token_id=151643, eos_token_id=151645)
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    srv = Server("--load-format", "dummy", "--tokenizer", QWEN3_TOK, "--threads", "2", "--max-model-len", "2048",
                 "--prefix-cache-mode", "chain", model=str(tmp_path / "config.json"))
    try:
        url = srv.url + "/v1/chat/completions"
        ids = forced(srv, "<think>\nCheck the forecast.\n</think>\n\nIt will rain.")
        for preserve, status in ((None, "resumed"), (False, "recreated")):
            msgs = [{"role": "user", "content": "Weather tomorrow?"}]
            r1 = requests.post(url, json={"messages": msgs, "max_tokens": len(ids), "forced_token_ids": ids}).json()
            assert r1["chain_status"] == "created"
            m1 = r1["choices"][0]["message"]
            assert (m1["content"], m1["reasoning_content"]) == ("It will rain.", "Check the forecast.")
            msgs += [{"role": "assistant", "content": m1["content"]}, {"role": "user", "content": "And after?"}]
            body = {"messages": msgs, "max_tokens": 2, "chain_id": r1["chain_id"]}
            if preserve is not None:
                body["preserve_thinking"] = preserve
            r2 = requests.post(url, json=body).json()
            assert r2["chain_status"] == status, r2
            cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
            if status == "resumed":  # everything the chain processed (prompt + reasoning + answer)
                assert cached == r1["usage"]["prompt_tokens"] + len(ids) - 1
            else:
                assert cached == 0
    finally:
        srv.stop()


def random_schema(rng, depth=0):
    kinds = ["string", "integer", "number", "boolean", "enum", "null"] + (["object", "array"] if depth < 2 else [])
    k = rng.choice(kinds)
    if k == "string":
        s = {"type": "string", "maxLength": rng.randint(1, 8)}
        if rng.random() < 0.3:
            s["minLength"] = rng.randint(0, s["maxLength"])
        return s
    if k == "integer":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
    if k == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if k == "boolean":
        return {"type": "boolean"}
    if k == "null":
        return {"type": "null"}
    if k == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, True, None, "a b"], rng.randint(1, 4))}
    if k == "array":
        s = {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
        if rng.random() < 0.5:
            s["minItems"] = rng.randint(0, s["maxItems"])
        return s
    props = {f"k{i}_{rng.choice(['id', 'name', 'v'])}": random_schema(rng, depth + 1) for i in range(rng.randint(1, 4))}
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": sorted(rng.sample(list(props), rng.randint(0, len(props))))}


def test_json_schema_100_random(qwen3):
    """response_format json_schema on random weights (no help from the model):
    every output parses and validates."""
    rng = random.Random(22)
    schemas = [{"type": "object", "properties": {"answer": random_schema(rng)}, "required": ["answer"],
                "additionalProperties": False} if i % 2 else random_schema(rng) for i in range(100)]
    schemas = [s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"]}
               for s in schemas]

    def one(i):
        r = qwen3.client.chat.completions.create(
            model=qwen3.model, messages=[{"role": "user", "content": f"Give me JSON number {i}."}], max_tokens=400,
            seed=i, temperature=1.0,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i]}},
            extra_body=NO_THINK)
        return r.choices[0]

    with cf.ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(one, range(100)))
    for i, ch in enumerate(outs):
        assert ch.finish_reason == "stop", (i, schemas[i], ch.message.content)
        jsonschema.validate(json.loads(ch.message.content), schemas[i])


def test_grammar_and_thinking(qwen3):
    c, m = qwen3.client, qwen3.model
    msgs = [{"role": "user", "content": "JSON please"}]
    for seed in range(4):
        r = c.chat.completions.create(model=m, messages=msgs, max_tokens=10, seed=seed,
                                      extra_body=dict(NO_THINK, response_format={
                                          "type": "grammar", "grammar": 'root ::= ("yes" | "no") " " [0-9]'}))
        assert r.choices[0].message.content[:-1] in ("yes ", "no ") and r.choices[0].message.content[-1].isdigit()
    # Qwen3 thinking (the default): a free think block first, then the constraint
    r = c.chat.completions.create(model=m, messages=msgs, max_tokens=60, seed=1, response_format={
        "type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "object", "properties": {
            "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}},
        extra_body={"stop": None})
    ch = r.choices[0]
    if ch.finish_reason == "stop":
        assert json.loads(ch.message.content)["ok"] in (True, False)
    else:  # random weights may think until max_tokens: then it is all reasoning
        assert ch.finish_reason == "length" and ch.message.model_extra.get("reasoning_content") is not None


def test_errors(qwen3):
    url = qwen3.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]

    def err(body, param):
        r = requests.post(url, json=dict({"messages": msgs, "max_tokens": 4}, **body))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        return r.json()["error"]["message"]

    err({"tool_choice": "required"}, "tool_choice")
    err({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice")
    err({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice")
    err({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]")
    err({"tools": [WEATHER, WEATHER]}, "tools[1]")
    err({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls")
    err({"response_format": {"type": "xml"}}, "response_format")
    assert "does not compile" in err({"response_format": {"type": "grammar", "grammar": "root ::= ("}},
                                     "response_format")
    err({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos")
    err({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs")
    assert "built-in templates take" in err({"chat_template_kwargs": {"custom": 1}}, "messages")
    err({"messages": [{"role": "assistant", "content": "", "tool_calls": "x"}]}, "messages[0].tool_calls")


def test_smollm2_has_no_tool_format_but_structured_output_works():
    """The default model (real weights): tools are refused, json_schema and json_object hold."""
    srv = Server("--threads", "2", "--max-model-len", "1024")
    try:
        url = srv.url + "/v1/chat/completions"
        r = requests.post(url, json={"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
        assert r.status_code == 400 and "has no tool-calling format" in r.json()["error"]["message"]
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                  "required": ["name", "age"], "additionalProperties": False}
        r = requests.post(url, json={"messages": [{"role": "user", "content": "Invent a person as JSON."}],
                                     "max_tokens": 60, "temperature": 0,
                                     "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "p", "schema": schema}}}).json()
        out = json.loads(r["choices"][0]["message"]["content"])
        jsonschema.validate(out, schema)
        assert r["choices"][0]["finish_reason"] == "stop"
        r = requests.post(url, json={"messages": [{"role": "user", "content": "Give a JSON object with the keys "
                                                                              "name and age."}],
                                     "max_tokens": 120, "temperature": 0, "repetition_penalty": 1.3,
                                     "response_format": {"type": "json_object"}}).json()
        assert r["choices"][0]["finish_reason"] == "stop"
        assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    finally:
        srv.stop()
