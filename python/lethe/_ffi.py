"""ctypes mirror of include/lethe.h and the loaded shared library.

The structures below copy lethe.h field by field (same order, same C types);
tests/python/test_abi.py compiles a C program that prints every field's
offsetof and every struct's sizeof and compares them with these classes, so
a header change that is not mirrored here fails the suite.

The library is $LETHE_LIBRARY when set, else the liblethe.so the package
was installed with (python/lethe_build.py copies build/liblethe.so, which
`make` builds, into the wheel)."""
import ctypes
import os
from ctypes import (CFUNCTYPE, POINTER, Structure, c_bool, c_char_p, c_double, c_float, c_int, c_int32, c_int64,
                    c_size_t, c_uint64, c_void_p)

MAX_STOP = 8
MAX_TOP_LOGPROBS = 20

# lethe_status
OK = 0
STATUS_NAMES = ["ok", "invalid", "io", "format", "unsupported", "nomem", "backend", "capacity", "not_found", "busy"]

# lethe_finish_reason
FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = range(5)
FINISH_NAMES = {FINISH_NONE: None, FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ABORT: "abort",
                FINISH_ERROR: "error"}

# lethe_grammar_kind
GRAMMAR_JSON_SCHEMA, GRAMMAR_JSON_OBJECT, GRAMMAR_EBNF, GRAMMAR_REGEX, GRAMMAR_STRUCTURAL_TAG = range(5)


class SamplingParamsC(Structure):
    _fields_ = [
        ("temperature", c_float),
        ("top_k", c_int32),
        ("top_p", c_float),
        ("min_p", c_float),
        ("repetition_penalty", c_float),
        ("presence_penalty", c_float),
        ("frequency_penalty", c_float),
        ("seed", c_uint64),
        ("has_seed", c_bool),
        ("max_tokens", c_int32),
        ("ignore_eos", c_bool),
        ("stop", c_char_p * MAX_STOP),
        ("stop_token_ids", c_int32 * MAX_STOP),
        ("n_stop_token_ids", c_int32),
        ("logprobs", c_int32),
    ]


class TopLogprobC(Structure):
    _fields_ = [("token", c_int32), ("logprob", c_float)]


class EventC(Structure):
    _fields_ = [
        ("request_id", c_uint64),
        ("n_tokens", c_int32),
        ("token", c_int32),
        ("text", c_char_p),
        ("logprob", c_float),
        ("n_top", c_int32),
        ("top", POINTER(TopLogprobC)),
        ("finished", c_bool),
        ("finish_reason", c_int),
        ("error", c_char_p),
        ("error_internal", c_bool),
        ("prompt_tokens", c_int32),
        ("completion_tokens", c_int32),
        ("cached_tokens", c_int32),
        ("ttft_s", c_double),
        ("logits", POINTER(c_float)),
        ("n_vocab", c_int32),
    ]


EVENT_CB = CFUNCTYPE(None, c_void_p, POINTER(EventC))


class RequestParamsC(Structure):
    _fields_ = [
        ("prompt", POINTER(c_int32)),
        ("n_prompt", c_int32),
        ("sampling", SamplingParamsC),
        ("cb", EVENT_CB),
        ("user", c_void_p),
        ("forced", POINTER(c_int32)),
        ("n_forced", c_int32),
        ("want_logits", c_bool),
        ("grammar", c_void_p),
    ]


class EngineParamsC(Structure):
    _fields_ = [
        ("model", c_char_p),
        ("load_format", c_char_p),
        ("seed", c_uint64),
        ("device", c_char_p),
        ("n_threads", c_int32),
        ("max_model_len", c_int32),
        ("max_num_seqs", c_int32),
        ("max_num_batched_tokens", c_int32),
        ("kv_cache_bytes", c_size_t),
        ("gpu_memory_utilization", c_float),
        ("enable_prefix_caching", c_bool),
        ("sparse_method", c_char_p),
        ("sparse_config", c_char_p),
        ("check_invariants", c_bool),
        ("progress", c_bool),
        ("split_prefill_decode", c_bool),
        ("prefix_cache_mode", c_char_p),
        ("tokenizer", c_char_p),
        ("enforce_eager", c_bool),
        ("pad_decode_batches", c_bool),
    ]


class ChatOptionsC(Structure):
    _fields_ = [
        ("add_generation_prompt", c_bool),
        ("tools_json", c_char_p),
        ("kwargs_json", c_char_p),
        ("preserve_thinking", c_bool),
    ]


class EngineStatsC(Structure):
    _fields_ = [
        ("n_running", c_int32),
        ("n_waiting", c_int32),
        ("kv_slots_total", c_int64),
        ("kv_slots_used", c_int64),
        ("kv_usage", c_double),
        ("prefix_queries_tokens", c_int64),
        ("prefix_hit_tokens", c_int64),
        ("prompt_tokens_total", c_int64),
        ("generation_tokens_total", c_int64),
        ("prefill_tokens_computed", c_int64),
        ("n_preemptions", c_int64),
        ("n_steps", c_int64),
        ("n_requests_finished", c_int64),
        ("graph_replays", c_int64),
        ("graph_captures", c_int64),
        ("eager_steps", c_int64),
        ("padded_seqs", c_int64),
        ("device_selections", c_int64),
    ]


class ChainStatsC(Structure):
    _fields_ = [
        ("n_chains", c_int32),
        ("n_active", c_int32),
        ("n_idle", c_int32),
        ("n_tombstones", c_int32),
        ("n_created", c_int64),
        ("n_resumed", c_int64),
        ("n_recreated", c_int64),
        ("n_reclaimed", c_int64),
        ("n_invalidated", c_int64),
        ("n_rejected", c_int64),
        ("n_capacity_rejected", c_int64),
        ("reused_tokens", c_int64),
        ("prompt_tokens", c_int64),
        ("resident_slots", c_int64),
    ]


class KvSpaceUseC(Structure):
    _fields_ = [("slots_total", c_int64), ("slots_used", c_int64), ("slots_cached", c_int64)]


class SparseStatsC(Structure):
    _fields_ = [("selected_slots", c_int64), ("resident_slots", c_int64), ("evicted_slots", c_int64),
                ("n_steps", c_int64)]


class ChainSummaryC(Structure):
    _fields_ = [
        ("chain_id", ctypes.c_char * 48),
        ("active", c_bool),
        ("logical_tokens", c_int32),
        ("processed_tokens", c_int32),
        ("resident_tokens", c_int32),
        ("resident_slots", c_int64),
    ]


# struct name in lethe.h -> mirror (for the layout test)
STRUCTS = {
    "lethe_sampling_params": SamplingParamsC,
    "lethe_top_logprob": TopLogprobC,
    "lethe_event": EventC,
    "lethe_request_params": RequestParamsC,
    "lethe_engine_params": EngineParamsC,
    "lethe_chat_options": ChatOptionsC,
    "lethe_engine_stats": EngineStatsC,
    "lethe_engine_chain_stats": ChainStatsC,
    "lethe_kv_space_use": KvSpaceUseC,
    "lethe_engine_sparse_stats": SparseStatsC,
    "lethe_chain_summary": ChainSummaryC,
}

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
    env = os.environ.get("LETHE_LIBRARY")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "liblethe.so")


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
