"""`lethe methods`: the listing comes from the registry, so it names every
registered method with its kind, aliases and the knob defaults of
methods.md / the anchor, and rejects unknown names with exit code 2."""
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LETHE = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe")


def run(*args):
    return subprocess.run([LETHE, "methods", *args], capture_output=True, text=True, timeout=30)


def test_json_lists_every_method_with_kind_and_defaults():
    p = run("--json")
    assert p.returncode == 0, p.stderr
    methods = {m["name"]: m for m in json.loads(p.stdout)}
    kinds = {"dense": "dense", "streamingllm": "eviction", "snapkv": "eviction", "pyramidkv": "eviction",
             "h2o": "eviction", "quest": "selection", "omnikv": "selection", "kivi": "quantization",
             "fp8_kv": "quantization"}
    for name, kind in kinds.items():
        assert methods[name]["kind"] == kind
    knobs = {k["name"]: k["default"] for k in methods["snapkv"]["knobs"]}
    assert knobs["sink_keep_tokens"] == "64" and knobs["recent_keep_tokens"] == "512"
    assert knobs["decode_keep_tokens"] == "4096" and knobs["snapkv_window_size"] == "32"
    h2o = {k["name"]: k["default"] for k in methods["h2o"]["knobs"]}
    assert h2o["h2o_prefill_budget"] == "8192" and h2o["h2o_decode_budget"] == "4096"
    assert "h2o_prefill" in methods["h2o"]["aliases"]
    assert "attention-sink" in methods["streamingllm"]["aliases"]
    assert {k["name"]: k["default"] for k in methods["kivi"]["knobs"]}["kivi_bits"] == "4"


def test_every_registered_method_is_listed_whole():
    """Iterates the registry's listing: every method (a new one included, with no
    edit here) has a kind, a summary, typed knobs with defaults and help, and is
    found by its name and each alias, case- and '-'/'_'-insensitively."""
    p = run("--json")
    assert p.returncode == 0, p.stderr
    methods = json.loads(p.stdout)
    assert methods and methods[0]["name"] == "dense"
    spellings = set()
    for m in methods:
        assert m["kind"] in ("dense", "eviction", "selection", "quantization", "compression"), m
        assert m["summary"].strip(), m
        names = [k["name"] for k in m["knobs"]]
        assert len(names) == len(set(names)), m["name"]
        for k in m["knobs"]:
            assert k["type"] in ("int", "float", "bool", "str") and k["default"] != "" and k["help"], k
            if "min" in k:  # method knobs carry their bounds (the shared ones are counts >= 0)
                assert k["min"] <= float(k["default"]) <= k["max"], k
        for spelling in [m["name"], *m["aliases"]]:
            key = spelling.lower().replace("-", "_")
            assert key not in spellings, spelling
            spellings.add(key)
            q = run(spelling.upper().replace("_", "-"))
            assert q.returncode == 0 and q.stdout.startswith(m["name"]), (spelling, q.stderr)


def test_one_method_by_alias_and_unknown():
    p = run("attention_sink")
    assert p.returncode == 0 and p.stdout.startswith("streamingllm")
    assert "sink_keep_tokens" in p.stdout and "decode_keep_tokens" not in p.stdout
    p = run("no-such-method")
    assert p.returncode == 2 and "unknown method" in p.stderr


def test_prefill_decode_pairs():
    """A prefill-axis method pairs with a decode method as PREFILL+DECODE: the listing names
    both tables (axis prefill / decode), a pair that cannot work exits 2 with the reason."""
    p = run("--json")
    axes = {m["name"]: m["axis"] for m in json.loads(p.stdout)}
    assert axes["flashprefill"] == axes["omnikv_prefill"] == "prefill"
    assert axes["snapkv"] == axes["dense"] == axes["quest"] == "decode"
    p = run("--json", "flashprefill+snapkv")
    assert p.returncode == 0, p.stderr
    pair = json.loads(p.stdout)
    assert pair["name"] == "flashprefill+snapkv"
    assert pair["prefill"]["name"] == "flashprefill" and pair["decode"]["name"] == "snapkv"
    assert "flashprefill_threshold" in {k["name"] for k in pair["prefill"]["knobs"]}
    p = run("omnikv_prefill+quest")
    assert p.returncode == 0 and p.stdout.startswith("omnikv_prefill+quest:"), p.stderr
    for bad, why in (("snapkv+flashprefill", "prefill method comes first"),
                     ("flashprefill+kivi", "native K / V"), ("flashprefill+nope", "unknown method")):
        q = run(bad)
        assert q.returncode == 2 and why in q.stderr, (bad, q.stderr)
