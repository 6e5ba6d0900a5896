"""The library's types, read from include/lethe.h, and the loaded library.

The structures are built at import from the header's own definitions (the
package ships the lethe.h its library was built with), so a field added to
a struct in C is a field here with no edit; tests/e2e/test_python_pkg.py
compiles a C program that prints every field's offsetof and every struct's
sizeof and compares them with the classes built here. The reader handles
what lethe.h uses: typedef'd structs and enums, scalar / pointer / array
fields (sizes are numbers or #defines), several names in one declaration,
one function-pointer typedef (lethe_event_cb).

The library is $LETHE_LIBRARY when set, else the liblethe.so the package
was installed with (python/lethe_build.py copies build/liblethe.so, which
`make` builds, into the wheel); the header is $LETHE_HEADER, else the
package's lethe.h, else include/lethe.h of the source tree it sits in."""
import ctypes
import os
import re
from ctypes import (CFUNCTYPE, POINTER, Structure, c_bool, c_char, c_char_p, c_double, c_float, c_int, c_int32,
                    c_int64, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p)

HERE = os.path.dirname(os.path.abspath(__file__))


def header_path():
    for p in (os.environ.get("LETHE_HEADER"), os.path.join(HERE, "lethe.h"),
              os.path.join(HERE, "..", "..", "include", "lethe.h")):
        if p and os.path.exists(p):
            return os.path.abspath(p)
    raise ImportError("lethe: lethe.h not found (set LETHE_HEADER, or reinstall the package)")


_SCALARS = {"int32_t": c_int32, "int64_t": c_int64, "uint64_t": c_uint64, "uint32_t": c_uint32,
            "uint8_t": c_uint8, "double": c_double, "float": c_float, "bool": c_bool, "size_t": c_size_t,
            "char": c_char, "int": c_int}


def _read_header(path):
    """(#define constants, enums {name: {member: value}}, structs {name: Structure class})."""
    text = open(path).read()
    defines = {m[0]: int(m[1]) for m in re.findall(r"^#define\s+(\w+)\s+(\d+)\s*$", text, re.M)}
    code = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    code = re.sub(r"//[^\n]*", " ", code)
    enums, structs, types = {}, {}, dict(_SCALARS)
    types["lethe_event_cb"] = None  # filled once lethe_event exists
    for m in re.finditer(r"typedef\s+enum\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", code, re.S):
        vals, nxt = {}, 0
        for item in m[2].split(","):
            item = item.strip()
            if not item:
                continue
            name, _, val = (x.strip() for x in item.partition("="))
            nxt = (int(val, 0) if re.fullmatch(r"-?(0x)?[0-9a-fA-F]+", val) else vals[val]) if val else nxt
            vals[name] = nxt
            nxt += 1
        enums[m[3]] = vals
        types[m[3]] = c_int
    for m in re.finditer(r"typedef\s+struct\s+(\w+)\s+(\w+)\s*;", code):  # opaque handles
        types[m[2]] = "opaque"
    for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", code, re.S):
        fields = []
        for decl in m[2].split(";"):
            decl = " ".join(decl.replace("*", " * ").split())
            if not decl:
                continue
            words = [w for w in decl.split(" ") if w not in ("const", "struct", "unsigned")]
            base, rest = words[0], " ".join(words[1:])
            for d in rest.split(","):
                d = d.replace(" ", "")
                dm = re.fullmatch(r"(\**)(\w+)(?:\[(\w+)\])?", d)
                assert dm, f"lethe.h: cannot read the field '{decl}' of {m[3]}"
                stars, name, dim = dm.groups()
                t = _field_type(base, len(stars), types, m[3])
                if dim:
                    t = t * (int(dim) if dim.isdigit() else defines[dim])
                fields.append((name, t))
        cls = type(m[3], (Structure,), {"_fields_": fields})
        structs[m[3]] = types[m[3]] = cls
        if m[3] == "lethe_event":
            types["lethe_event_cb"] = CFUNCTYPE(None, c_void_p, POINTER(cls))
    return defines, enums, structs, types


def _field_type(base, n_stars, types, owner):
    if base not in types and base != "void":
        raise ImportError(f"lethe.h: unknown type {base} in {owner}")
    t = types.get(base)
    if n_stars == 0:
        assert t not in (None, "opaque"), f"lethe.h: {base} by value in {owner}"
        return t
    if n_stars == 1 and base == "char":
        return c_char_p
    if base == "void" or t == "opaque" or n_stars > 1:
        return c_void_p
    return POINTER(t)


DEFINES, ENUMS, STRUCTS, _TYPES = _read_header(header_path())
MAX_STOP = DEFINES["LETHE_MAX_STOP"]
MAX_TOP_LOGPROBS = DEFINES["LETHE_MAX_TOP_LOGPROBS"]

OK = ENUMS["lethe_status"]["LETHE_OK"]
STATUS_NAMES = {v: k[len("LETHE_ERR_"):].lower() if k.startswith("LETHE_ERR_") else "ok"
                for k, v in ENUMS["lethe_status"].items()}
FINISH = ENUMS["lethe_finish_reason"]
FINISH_NAMES = {v: (None if k == "LETHE_FINISH_NONE" else k[len("LETHE_FINISH_"):].lower())
                for k, v in FINISH.items()}
GRAMMAR = {k[len("LETHE_GRAMMAR_"):].lower(): v for k, v in ENUMS["lethe_grammar_kind"].items()}

SamplingParamsC = STRUCTS["lethe_sampling_params"]
EventC = STRUCTS["lethe_event"]
RequestParamsC = STRUCTS["lethe_request_params"]
EngineParamsC = STRUCTS["lethe_engine_params"]
ChatOptionsC = STRUCTS["lethe_chat_options"]
EngineStatsC = STRUCTS["lethe_engine_stats"]
ChainStatsC = STRUCTS["lethe_engine_chain_stats"]
KvSpaceUseC = STRUCTS["lethe_kv_space_use"]
SparseStatsC = STRUCTS["lethe_engine_sparse_stats"]
ChainSummaryC = STRUCTS["lethe_chain_summary"]
EVENT_CB = _TYPES["lethe_event_cb"]

P = c_void_p  # lethe_engine *, lethe_grammar *
# name: (restype, argtypes)
_PROTOS = {
    "lethe_status_str": (c_char_p, [c_int]),
    "lethe_sampling_default_params": (None, [POINTER(SamplingParamsC)]),
    "lethe_engine_default_params": (None, [POINTER(EngineParamsC)]),
    "lethe_engine_create": (c_int, [POINTER(EngineParamsC), POINTER(P)]),
    "lethe_engine_destroy": (None, [P]),
    "lethe_engine_last_error": (c_char_p, []),
    "lethe_engine_tokenize": (c_int, [P, c_char_p, c_bool, c_bool, POINTER(POINTER(c_int32)), POINTER(c_int32)]),
    "lethe_engine_detokenize": (c_void_p, [P, POINTER(c_int32), c_int32]),
    "lethe_engine_apply_chat_json": (c_int, [P, c_char_p, POINTER(ChatOptionsC), POINTER(c_void_p)]),
    "lethe_engine_chat_format": (c_char_p, [P]),
    "lethe_engine_tool_format": (c_char_p, [P]),
    "lethe_engine_adds_bos": (c_bool, [P]),
    "lethe_engine_max_model_len": (c_int32, [P]),
    "lethe_engine_model_name": (c_char_p, [P]),
    "lethe_engine_compile_grammar": (c_int, [P, c_int, c_char_p, POINTER(P)]),
    "lethe_grammar_free": (None, [P]),
    "lethe_engine_add_request": (c_int, [P, POINTER(RequestParamsC), POINTER(c_uint64)]),
    "lethe_engine_step": (c_int, [P]),
    "lethe_engine_has_work": (c_bool, [P]),
    "lethe_engine_abort": (c_int, [P, c_uint64]),
    "lethe_engine_get_stats": (None, [P, POINTER(EngineStatsC)]),
    "lethe_engine_get_chain_stats": (None, [P, POINTER(ChainStatsC)]),
    "lethe_engine_get_kv_spaces": (c_int32, [P, POINTER(KvSpaceUseC), c_int32]),
    "lethe_engine_get_sparse_stats": (None, [P, POINTER(SparseStatsC)]),
    "lethe_engine_list_chains": (c_int32, [P, POINTER(ChainSummaryC), c_int32]),
    "lethe_engine_chain_mode": (c_bool, [P]),
    "lethe_engine_prefix_cache_mode": (c_char_p, [P]),
}


def library_path():
    return os.environ.get("LETHE_LIBRARY") or os.path.join(HERE, "liblethe.so")


def _load():
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(f"lethe: the shared library {path} is missing: build it with `make lib` "
                          "(build/liblethe.so) and reinstall the package, or set LETHE_LIBRARY")
    lib = ctypes.CDLL(path)
    for name, (res, args) in _PROTOS.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


lib = _load()
libc = ctypes.CDLL(None)
libc.free.argtypes, libc.free.restype = [c_void_p], None


def take_string(ptr):
    """A malloc'd char * from the library as str; frees it."""
    if not ptr:
        return None
    try:
        return ctypes.string_at(ptr).decode("utf-8", errors="replace")
    finally:
        libc.free(ptr)


def last_error():
    m = lib.lethe_engine_last_error()
    return m.decode("utf-8", errors="replace") if m else ""
