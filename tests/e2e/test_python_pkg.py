"""The Python package (python/, `pip install ./python`): ctypes over
include/lethe.h and build/liblethe.so.

Checked: the ctypes structures match the C layouts (offsetof / sizeof from
a compiled program); a fresh venv installs the package and generates with
the default model; generate / chat / stream give the same tokens as
`lethe generate` (the CLI through the same engine); n samples with seeds,
stop strings, logprobs, structured output, sparse methods, stats, early
stream exit (KV freed) and the errors."""
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile

import jsonschema
import pytest

from lethe_server import BIN, MODEL, ROOT

LIB = os.path.join(os.path.dirname(BIN), "liblethe.so")
os.environ.setdefault("LETHE_LIBRARY", LIB)
# before the library (and its OpenMP runtime) loads: waiting threads sleep
# instead of spinning on the shared cores (tests/run.sh)
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
sys.path.insert(0, os.path.join(ROOT, "python"))
import lethe  # noqa: E402
from lethe import _ffi  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    m = lethe.LLM(MODEL, threads=2, max_model_len=1024)
    yield m
    m.close()


def test_struct_layouts_match_the_header(tmp_path):
    src = ["#include <stddef.h>", "#include <stdio.h>", "#include \"lethe.h\"", "int main(void) {"]
    expect = []
    for cname, cls in _ffi.STRUCTS.items():
        src.append(f'    printf("{cname} %zu\\n", sizeof({cname}));')
        expect.append(f"{cname} {ctypes.sizeof(cls)}")
        for fname, _ in cls._fields_:
            src.append(f'    printf("{cname}.{fname} %zu\\n", offsetof({cname}, {fname}));')
            expect.append(f"{cname}.{fname} {getattr(cls, fname).offset}")
    src.append("    return 0;\n}")
    (tmp_path / "layout.c").write_text("\n".join(src) + "\n")
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-std=c17", "-I", os.path.join(ROOT, "include"), "-o", str(exe), str(tmp_path / "layout.c")],
                   check=True)
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")[:-1]
    assert got == expect
    # every struct the header defines was read, with every member it declares
    hdr = re.sub(r"/\*.*?\*/", "", open(os.path.join(ROOT, "include", "lethe.h")).read(), flags=re.S)
    defined = re.findall(r"typedef struct (\w+) \{", hdr)
    assert sorted(defined) == sorted(_ffi.STRUCTS) and "lethe_engine_stats" in defined
    for cname in defined:
        body = hdr.split(f"typedef struct {cname} {{", 1)[1].split(f"}} {cname};", 1)[0]
        n_members = sum(len(decl.split(",")) for decl in body.split(";") if decl.strip())
        assert n_members == len(_ffi.STRUCTS[cname]._fields_), cname
    assert _ffi.EVENT_CB._argtypes_[1]._type_ is _ffi.EventC
    assert _ffi.FINISH_NAMES == {0: None, 1: "stop", 2: "length", 3: "abort", 4: "error"}


def test_pip_install_in_a_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("LETHE_LIBRARY", None)  # the installed package finds its own copy
    env["LETHE_BUILD"] = os.path.relpath(os.path.dirname(BIN), ROOT)
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", os.path.join(ROOT, "python")], check=True,
                   env=env, cwd=str(tmp_path))
    code = ("import json, lethe; llm = lethe.LLM(%r, threads=2); "
            "o = llm.generate('The capital of France is', lethe.SamplingParams(temperature=0, max_tokens=8))[0]; "
            "print(json.dumps([lethe.library_path(), o.outputs[0].text, o.outputs[0].token_ids]))" % MODEL)
    out = subprocess.run([py, "-c", code], check=True, capture_output=True, text=True, env=env, cwd=str(tmp_path))
    path, text, ids = json.loads(out.stdout.strip().splitlines()[-1])
    assert path.startswith(str(venv)) and path.endswith("lethe/liblethe.so")
    assert os.path.exists(os.path.join(os.path.dirname(path), "lethe.h"))  # the header it reads
    assert len(ids) == 8 and "Paris" in text


def cli(lines):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps(x) + "\n" for x in lines))
    out = subprocess.run([BIN, "generate", "-m", MODEL, "-t", "2", "--max-model-len", "1024", "-i", f.name],
                         check=True, capture_output=True, text=True, cwd=ROOT).stdout
    os.unlink(f.name)
    return [json.loads(l) for l in out.splitlines()]


def test_generate_chat_stream_match_the_cli(llm):
    msgs = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]
    ref = cli([{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
               {"messages": msgs, "max_tokens": 10, "temperature": 0},
               {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.8, "seed": 7}])
    greedy = lethe.SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate(["The capital of France is", "Once upon a time"],
                        [greedy, lethe.SamplingParams(temperature=0.8, seed=7, max_tokens=12)])
    assert [o.outputs[0].token_ids for o in outs] == [ref[0]["token_ids"], ref[2]["token_ids"]]
    assert [o.outputs[0].text for o in outs] == [ref[0]["text"], ref[2]["text"]]
    assert outs[0].prompt == "The capital of France is" and len(outs[0].prompt_token_ids) == 5
    assert outs[0].outputs[0].finish_reason == "length" and outs[0].finished
    c = llm.chat(msgs, lethe.SamplingParams(temperature=0, max_tokens=10))[0]
    assert c.outputs[0].token_ids == ref[1]["token_ids"] and c.outputs[0].text == ref[1]["text"]
    assert len(c.prompt_token_ids) == ref[1]["usage"]["prompt_tokens"]
    # a list of conversations, streamed: the pieces add up to the whole
    pieces = {}
    for s in llm.chat_stream([msgs, [{"role": "user", "content": "Hi"}]], lethe.SamplingParams(temperature=0,
                                                                                                max_tokens=10)):
        p = pieces.setdefault(s.index, {"text": "", "ids": [], "fin": None})
        assert p["fin"] is None, "nothing after the finishing piece"
        p["text"] += s.text
        p["ids"] += s.token_ids
        p["fin"] = s.finish_reason if s.finished else None
    assert pieces[0]["ids"] == ref[1]["token_ids"] and pieces[0]["text"] == ref[1]["text"]
    assert pieces[0]["fin"] == "length" and pieces[1]["fin"] in ("stop", "length")
    # token prompts
    o = llm.generate({"prompt_token_ids": outs[0].prompt_token_ids}, greedy)[0]
    assert o.outputs[0].token_ids == ref[0]["token_ids"] and o.prompt is None


def test_samples_stops_logprobs(llm):
    sp = lethe.SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, logprobs=2)
    a = llm.generate("Once upon a time", sp)[0]
    b = llm.generate("Once upon a time", sp)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # seeded
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # seed + j: different samples
    for c in a.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for t, lp in zip(c.token_ids, c.logprobs):
            assert next(iter(lp)) == t and 1 <= len(lp) <= 3 and all(v <= 0 for v in lp.values())
        assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)))
    full = llm.generate("The capital of France is", lethe.SamplingParams(temperature=0, max_tokens=8))[0]
    cut = llm.generate("The capital of France is", lethe.SamplingParams(temperature=0, max_tokens=8,
                                                                        stop=["answer"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == full.outputs[0].text.split("answer")[0]
    assert llm.generate("Hi", lethe.SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].logprobs is None


def test_structured_output(llm):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    sp = lethe.SamplingParams(temperature=0.7, seed=3, max_tokens=60,
                              structured_outputs=lethe.StructuredOutputsParams(json=schema))
    o = llm.chat([{"role": "user", "content": "Invent a person as JSON."}], sp)[0].outputs[0]
    assert o.finish_reason == "stop"
    jsonschema.validate(json.loads(o.text), schema)
    r = llm.generate("Answer:", lethe.SamplingParams(max_tokens=8, seed=1, structured_outputs=lethe.StructuredOutputsParams(
        regex="(yes|no) [0-9]{2}")))[0].outputs[0]
    assert r.finish_reason == "stop" and r.text[:-3] in ("yes", "no") and r.text[-2:].isdigit()
    with pytest.raises(lethe.LetheError, match="does not compile|grammar") as e:
        llm.generate("x", lethe.SamplingParams(structured_outputs=lethe.StructuredOutputsParams(grammar="root ::= (")))
    assert e.value.status == "invalid"
    with pytest.raises(ValueError, match="exactly one"):
        llm.generate("x", lethe.SamplingParams(structured_outputs=lethe.StructuredOutputsParams()))


def test_stats_and_early_stream_exit(llm):
    before = llm.stats()
    it = llm.stream(["Tell me a long story.", "Another one."], lethe.SamplingParams(temperature=0, max_tokens=200,
                                                                                       ignore_eos=True))
    got = [next(it) for _ in range(4)]
    assert all(not g.finished for g in got)
    st = llm.stats()
    assert st["n_running"] == 2 and st["kv_slots_used"] > 0
    it.close()  # leaving the loop aborts both requests: their KV is freed
    st = llm.stats()
    assert st["n_running"] == 0 and st["n_waiting"] == 0
    llm.generate("x", lethe.SamplingParams(max_tokens=1))  # one more step publishes the stats
    st = llm.stats()
    assert st["kv_slots_used"] == 0 and st["n_requests_finished"] >= before["n_requests_finished"] + 3
    assert st["generation_tokens_total"] > before["generation_tokens_total"] and st["prefix_cache_mode"] == "radix"
    assert len(st["kv_spaces"]) == 1 and st["kv_spaces"][0]["slots_used"] == 0  # one shared pool
    assert st["sparse"]["selected_slots"] == st["sparse"]["resident_slots"] > 0  # dense reads everything


def test_sparse_method_and_chain_stats():
    with lethe.LLM(MODEL, threads=2, max_model_len=512, sparse_method="streamingllm",
                   sparse_config={"sink_keep_tokens": 4, "recent_keep_tokens": 8}) as m:
        o = m.generate("The history of the printing press is", lethe.SamplingParams(temperature=0, max_tokens=20,
                                                                                    ignore_eos=True))[0]
        assert len(o.outputs[0].token_ids) == 20
        st = m.stats()
        assert st["prefix_cache_mode"] == "chain" and st["n_steps"] > 0
        # per-layer rows: one slot space per layer; the method evicted (2 (4 + 8) < prompt + 20)
        assert len(st["kv_spaces"]) == 30 and all(s["slots_total"] > 0 for s in st["kv_spaces"])
        assert st["sparse"]["evicted_slots"] > 0 and st["sparse"]["n_steps"] == st["n_steps"]
        assert 0 < st["sparse"]["selected_slots"] <= st["sparse"]["resident_slots"]
        # generate() runs outside chain turns: the Chain Cache holds no chain
        assert st["chain"]["n_chains"] == 0 and st["chain"]["chains"] == []


def test_errors(llm):
    with pytest.raises(lethe.LetheError) as e:
        lethe.LLM("/nonexistent/model.gguf")
    assert "nonexistent" in str(e.value)
    with pytest.raises(TypeError, match="unknown argument"):
        lethe.LLM(MODEL, tensor_parallel_size=2)
    with pytest.raises(lethe.LetheError, match="sparse"):
        lethe.LLM(MODEL, sparse_method="nope")
    with pytest.raises(lethe.LetheError) as e:
        llm.generate("x", lethe.SamplingParams(top_p=2.0))
    assert e.value.status == "invalid" and "top_p" in str(e.value)
    with pytest.raises(lethe.LetheError, match="max_model_len|1024"):
        llm.generate({"prompt_token_ids": [1] * 2000})
    with pytest.raises(lethe.LetheError, match="unsupported|tool"):
        llm.chat([{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "f"}}])
    assert llm.stats()["n_running"] == 0
