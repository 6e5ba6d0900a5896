"""lethe.LLM: the engine in-process, in the style of vLLM's offline API.

    llm = LLM("models/SmolLM2-135M-Instruct.Q4_1.gguf", sparse_method="dense")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    outs[0].outputs[0].text

The engine runs in synchronous mode on the caller's thread (lethe.h, mode 1):
generate() submits every request and steps the engine until they finish;
stream() steps it and yields each request's new text as it comes. One LLM
is not thread-safe: call it from one thread at a time."""
import ctypes
import json
from collections import deque
from ctypes import POINTER, byref, c_int32, c_uint64, c_void_p
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from . import _ffi
from ._ffi import lib


class LetheError(RuntimeError):
    """A refusal from the engine: status is lethe_status' name ("invalid", "capacity", ...)."""

    def __init__(self, status: int, message: str):
        self.status = _ffi.STATUS_NAMES.get(status, str(status))
        super().__init__(message or self.status)


def _check(rc: int):
    if rc != _ffi.OK:
        raise LetheError(rc, _ffi.last_error())


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's StructuredOutputsParams): a JSON schema
    (dict or JSON text), any JSON object, a regular expression, an EBNF
    grammar (GBNF style, root rule "root") or an xgrammar structural tag."""
    json: Optional[Union[dict, str]] = None
    json_object: bool = False
    regex: Optional[str] = None
    grammar: Optional[str] = None
    structural_tag: Optional[Union[dict, str]] = None

    def spec(self):
        given = [(k, v) for k, v in (("json", self.json), ("regex", self.regex), ("grammar", self.grammar),
                                      ("structural_tag", self.structural_tag)) if v is not None]
        if self.json_object:
            given.append(("json_object", True))
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams: give exactly one of json, json_object, regex, grammar, "
                             f"structural_tag (got {[k for k, _ in given] or 'none'})")
        k, v = given[0]
        kind = _ffi.GRAMMAR[{"json": "json_schema", "grammar": "ebnf"}.get(k, k)]
        text = "" if k == "json_object" else (v if isinstance(v, str) else json.dumps(v))
        return kind, text


@dataclass
class SamplingParams:
    """vLLM's SamplingParams fields that lethe implements (same meaning and
    defaults: temperature 1.0, max_tokens 16). seed with n > 1: sample j uses
    seed + j. logprobs: None, 0 (the sampled token's) or k alternatives too."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None

    def _to_c(self, j: int, keep: list) -> _ffi.SamplingParamsC:
        if self.n < 1:
            raise ValueError("SamplingParams.n must be >= 1")
        c = _ffi.SamplingParamsC()
        lib.lethe_sampling_default_params(byref(c))
        c.temperature, c.top_p, c.top_k, c.min_p = self.temperature, self.top_p, self.top_k, self.min_p
        c.repetition_penalty = self.repetition_penalty
        c.presence_penalty, c.frequency_penalty = self.presence_penalty, self.frequency_penalty
        if self.seed is not None:
            c.seed, c.has_seed = (self.seed + j) & (2 ** 64 - 1), True
        c.max_tokens = -1 if self.max_tokens is None else self.max_tokens
        c.ignore_eos = self.ignore_eos
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > _ffi.MAX_STOP - 1:
            raise ValueError(f"SamplingParams.stop: at most {_ffi.MAX_STOP - 1} stop strings")
        for i, s in enumerate(stops):
            b = s.encode()
            keep.append(b)
            c.stop[i] = b
        ids = list(self.stop_token_ids or [])
        if len(ids) > _ffi.MAX_STOP:
            raise ValueError(f"SamplingParams.stop_token_ids: at most {_ffi.MAX_STOP} ids")
        for i, t in enumerate(ids):
            c.stop_token_ids[i] = t
        c.n_stop_token_ids = len(ids)
        c.logprobs = -1 if self.logprobs is None else self.logprobs
        return c


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, float]]]  # per token: {token id: logprob}, the sampled one first
    finish_reason: Optional[str]                # "stop" | "length" | "abort" | "error"
    error: Optional[str] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    ttft_s: Optional[float] = None


@dataclass
class StreamOutput:
    """One step's new output of one request (stream() / chat_stream())."""
    index: int               # the prompt's position in the call
    sample: int              # which of its n samples
    request_id: str
    text: str                # new text (UTF-8 complete; stop strings removed)
    token_ids: List[int]     # new tokens
    finished: bool
    finish_reason: Optional[str]


@dataclass
class _Req:
    index: int
    sample: int
    prompt: Optional[str]
    prompt_ids: List[int]
    want_lp: bool
    rid: int = 0
    events: deque = field(default_factory=deque)
    text: List[str] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)
    logprobs: List[Dict[int, float]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    cached: int = 0
    ttft: Optional[float] = None


_ENGINE_KEYS = {
    "load_format": "load_format", "seed": "seed", "device": "device", "threads": "n_threads",
    "max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens", "kv_cache_bytes": "kv_cache_bytes",
    "gpu_memory_utilization": "gpu_memory_utilization", "enable_prefix_caching": "enable_prefix_caching",
    "sparse_method": "sparse_method", "sparse_config": "sparse_config", "check_invariants": "check_invariants",
    "split_prefill_decode": "split_prefill_decode", "prefix_cache_mode": "prefix_cache_mode",
    "tokenizer": "tokenizer", "enforce_eager": "enforce_eager",
}


class LLM:
    """LLM(model, sparse_method="dense", sparse_config=None, device="cpu", ...)

    model: a .gguf file, an HF folder, or a config.json with
    load_format="dummy". Keyword arguments are lethe_engine_params' fields
    (vLLM's names where vLLM has one): load_format, seed, device ("cpu" |
    "cuda"), threads, max_model_len, max_num_seqs, max_num_batched_tokens,
    kv_cache_bytes, gpu_memory_utilization, enable_prefix_caching,
    sparse_method (`lethe methods` lists them), sparse_config ("k=v,k=v" or
    a dict of knobs), check_invariants, split_prefill_decode,
    prefix_cache_mode ("auto" | "radix" | "chain"), tokenizer,
    enforce_eager. A refusal raises LetheError with the engine's message."""

    def __init__(self, model: str, **kwargs):
        self._engine = None
        unknown = sorted(set(kwargs) - set(_ENGINE_KEYS))
        if unknown:
            raise TypeError(f"LLM: unknown argument(s) {unknown}; known: {sorted(_ENGINE_KEYS)}")
        p = _ffi.EngineParamsC()
        lib.lethe_engine_default_params(byref(p))
        self._keep = []  # bytes the params point at, alive until create returns
        cfg = kwargs.get("sparse_config")
        if isinstance(cfg, dict):
            kwargs["sparse_config"] = ",".join(f"{k}={v}" for k, v in cfg.items())
        for k, v in dict(kwargs, model=model).items():
            if v is None:
                continue
            name = _ENGINE_KEYS.get(k, k)
            if isinstance(v, str):
                v = v.encode()
                self._keep.append(v)
            setattr(p, name, v)
        e = c_void_p()
        _check(lib.lethe_engine_create(byref(p), byref(e)))
        self._keep = []
        self._engine = e
        self._reqs: Dict[int, _Req] = {}
        self._cb = _ffi.EVENT_CB(self._on_event)  # alive as long as the engine
        self.model = model

    # ---- life ----

    def close(self):
        if self._engine:
            lib.lethe_engine_destroy(self._engine)
            self._engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_engine", None):
            self.close()

    def _e(self):
        if not self._engine:
            raise LetheError(1, "LLM: the engine is closed")
        return self._engine

    # ---- tokenizer and chat template ----

    def tokenize(self, text: str, add_special_tokens: bool = True) -> List[int]:
        ids, n = POINTER(c_int32)(), c_int32()
        add_bos = add_special_tokens and bool(lib.lethe_engine_adds_bos(self._e()))
        _check(lib.lethe_engine_tokenize(self._e(), text.encode(), add_bos, True, byref(ids), byref(n)))
        try:
            return ids[:n.value]
        finally:
            _ffi.libc.free(ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        arr = (c_int32 * len(ids))(*ids)
        out = _ffi.take_string(lib.lethe_engine_detokenize(self._e(), arr, len(ids)))
        if out is None:
            raise LetheError(1, _ffi.last_error() or "detokenize failed")
        return out

    def apply_chat_template(self, messages: List[dict], *, tools: Optional[List[dict]] = None,
                            chat_template_kwargs: Optional[dict] = None, add_generation_prompt: bool = True,
                            preserve_thinking: bool = False) -> str:
        """The prompt text the model's template renders (OpenAI message shapes,
        tools, tool calls and results, reasoning_content)."""
        o = _ffi.ChatOptionsC(add_generation_prompt=add_generation_prompt, preserve_thinking=preserve_thinking)
        if tools is not None:
            o.tools_json = json.dumps(tools).encode()
        if chat_template_kwargs is not None:
            o.kwargs_json = json.dumps(chat_template_kwargs).encode()
        out = c_void_p()
        _check(lib.lethe_engine_apply_chat_json(self._e(), json.dumps(messages).encode(), byref(o), byref(out)))
        return _ffi.take_string(out.value)

    @property
    def chat_format(self) -> Optional[str]:
        f = lib.lethe_engine_chat_format(self._e())
        return f.decode() if f else None

    @property
    def max_model_len(self) -> int:
        return lib.lethe_engine_max_model_len(self._e())

    # ---- requests ----

    def _on_event(self, user, evp):
        ev = evp.contents
        q = self._reqs.get(ev.request_id)
        if q is None:
            return
        text = ev.text.decode("utf-8", errors="replace") if ev.text else ""
        lp = None
        if ev.n_tokens and q.want_lp:
            lp = {ev.token: ev.logprob}
            for i in range(ev.n_top):
                lp.setdefault(ev.top[i].token, ev.top[i].logprob)
        fin = _ffi.FINISH_NAMES.get(ev.finish_reason) if ev.finished else None
        err = ev.error.decode("utf-8", errors="replace") if ev.finished and ev.error else None
        q.cached = ev.cached_tokens
        if ev.ttft_s > 0:
            q.ttft = ev.ttft_s
        q.events.append((ev.token if ev.n_tokens else None, text, lp, ev.finished, fin, err))

    def _submit(self, prompts, params, keep):
        """Submits every (prompt, sample) pair; returns the _Req objects in order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        reqs = []
        try:
            for i, (pr, sp) in enumerate(zip(prompts, plist)):
                if isinstance(pr, dict):
                    if "prompt_token_ids" not in pr:
                        raise ValueError("a dict prompt needs prompt_token_ids")
                    text, ids = pr.get("prompt"), list(pr["prompt_token_ids"])
                elif isinstance(pr, str):
                    text, ids = pr, self.tokenize(pr)
                else:
                    raise TypeError(f"prompt {i}: a str or {{'prompt_token_ids': [...]}}, not {type(pr).__name__}")
                grammar = c_void_p()
                if sp.structured_outputs is not None:
                    kind, spec = sp.structured_outputs.spec()
                    _check(lib.lethe_engine_compile_grammar(self._e(), kind, spec.encode(), byref(grammar)))
                try:
                    for j in range(sp.n):
                        arr = (c_int32 * len(ids))(*ids)
                        r = _ffi.RequestParamsC(prompt=ctypes.cast(arr, POINTER(c_int32)), n_prompt=len(ids),
                                                sampling=sp._to_c(j, keep), cb=self._cb, grammar=grammar)
                        rid = c_uint64()
                        _check(lib.lethe_engine_add_request(self._e(), byref(r), byref(rid)))
                        q = _Req(index=i, sample=j, prompt=text, prompt_ids=ids, want_lp=sp.logprobs is not None,
                                 rid=rid.value)
                        self._reqs[rid.value] = q
                        reqs.append(q)
                finally:
                    lib.lethe_grammar_free(grammar)  # each request holds its own reference
        except BaseException:
            self._abort(reqs)
            raise
        return reqs

    def _abort(self, reqs):
        for q in reqs:
            if q.finish_reason is None and self._engine:
                lib.lethe_engine_abort(self._engine, q.rid)
            self._reqs.pop(q.rid, None)

    def _step(self):
        if not lib.lethe_engine_has_work(self._e()):  # every request gets its final event first
            raise LetheError(1, "LLM: unfinished requests but the engine has no work")
        _check(lib.lethe_engine_step(self._e()))

    def _drain(self, q):
        """Folds q's queued events into it; yields (text, tokens, finished) per event."""
        while q.events:
            tok, text, lp, finished, fin, err = q.events.popleft()
            if tok is not None:
                q.tokens.append(tok)
                if lp is not None:
                    q.logprobs.append(lp)
            q.text.append(text)
            if finished:
                q.finish_reason, q.error = fin, err
                self._reqs.pop(q.rid, None)
            yield text, [tok] if tok is not None else [], finished

    def _outputs(self, reqs) -> List[RequestOutput]:
        by_prompt: Dict[int, List[_Req]] = {}
        for q in reqs:
            by_prompt.setdefault(q.index, []).append(q)
        outs = []
        for i in sorted(by_prompt):
            qs = by_prompt[i]
            comps = []
            for q in qs:
                cum = sum(d[q.tokens[k]] for k, d in enumerate(q.logprobs)) if q.logprobs else None
                comps.append(CompletionOutput(index=q.sample, text="".join(q.text), token_ids=list(q.tokens),
                                              cumulative_logprob=cum, logprobs=q.logprobs if q.want_lp else None,
                                              finish_reason=q.finish_reason, error=q.error))
            outs.append(RequestOutput(request_id=str(qs[0].rid), prompt=qs[0].prompt,
                                      prompt_token_ids=list(qs[0].prompt_ids), outputs=comps,
                                      finished=all(q.finish_reason for q in qs), num_cached_tokens=qs[0].cached,
                                      ttft_s=qs[0].ttft))
        return outs

    def generate(self, prompts, sampling_params: Optional[Union[SamplingParams, List[SamplingParams]]] = None,
                 **_ignored) -> List[RequestOutput]:
        """prompts: a str, a {"prompt_token_ids": [...]} dict, or a list of them.
        Returns one RequestOutput per prompt, in order."""
        keep = []
        reqs = self._submit(prompts, sampling_params, keep)
        try:
            while any(q.finish_reason is None for q in reqs):
                self._step()
                for q in reqs:
                    for _ in self._drain(q):
                        pass
        except BaseException:
            self._abort(reqs)
            raise
        return self._outputs(reqs)

    def stream(self, prompts, sampling_params: Optional[Union[SamplingParams, List[SamplingParams]]] = None
               ) -> Iterator[StreamOutput]:
        """Like generate(), but yields each request's new text and tokens after
        every engine step. Leaving the loop early aborts the unfinished requests."""
        keep = []
        reqs = self._submit(prompts, sampling_params, keep)
        try:
            while any(q.finish_reason is None for q in reqs):
                self._step()
                for q in reqs:
                    text, toks, fin, any_ev = [], [], False, False
                    for t, tk, f in self._drain(q):
                        text.append(t)
                        toks += tk
                        fin, any_ev = fin or f, True
                    if any_ev:
                        yield StreamOutput(index=q.index, sample=q.sample, request_id=str(q.rid), text="".join(text),
                                           token_ids=toks, finished=fin, finish_reason=q.finish_reason)
        finally:
            self._abort(reqs)

    def _chat_prompts(self, messages, kw):
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        out = []
        for conv in convs:
            text = self.apply_chat_template(conv, **kw)
            ids = self._tokens_of_rendered(text)
            out.append({"prompt": text, "prompt_token_ids": ids})
        return out

    def _tokens_of_rendered(self, text):
        # the rendered text carries its own BOS text where the template has one
        ids, n = POINTER(c_int32)(), c_int32()
        _check(lib.lethe_engine_tokenize(self._e(), text.encode(), False, True, byref(ids), byref(n)))
        try:
            return ids[:n.value]
        finally:
            _ffi.libc.free(ids)

    def chat(self, messages, sampling_params=None, *, tools=None, chat_template_kwargs=None,
             add_generation_prompt=True, preserve_thinking=False, **_ignored) -> List[RequestOutput]:
        """messages: one conversation (a list of OpenAI-style message dicts) or a
        list of conversations; rendered by the model's chat template."""
        kw = dict(tools=tools, chat_template_kwargs=chat_template_kwargs,
                  add_generation_prompt=add_generation_prompt, preserve_thinking=preserve_thinking)
        return self.generate(self._chat_prompts(messages, kw), sampling_params)

    def chat_stream(self, messages, sampling_params=None, *, tools=None, chat_template_kwargs=None,
                    add_generation_prompt=True, preserve_thinking=False) -> Iterator[StreamOutput]:
        kw = dict(tools=tools, chat_template_kwargs=chat_template_kwargs,
                  add_generation_prompt=add_generation_prompt, preserve_thinking=preserve_thinking)
        return self.stream(self._chat_prompts(messages, kw), sampling_params)

    # ---- stats ----

    def stats(self) -> Dict[str, Any]:
        """lethe_engine_stats as a dict (updated at the end of every step), with
        the prefix-cache mode, "kv_spaces" (slots per slot space: one shared,
        or one per layer), "sparse" (KV entries attention read vs the rows
        held, entries the method evicted) and, in chain mode, "chain": the
        Chain Cache's counters and its chains (most recently used first)."""
        e = self._e()
        s = _ffi.EngineStatsC()
        lib.lethe_engine_get_stats(e, byref(s))
        d = _as_dict(s)
        mode = lib.lethe_engine_prefix_cache_mode(e)
        d["prefix_cache_mode"] = mode.decode() if mode else None
        n = lib.lethe_engine_get_kv_spaces(e, None, 0)
        sp = (_ffi.KvSpaceUseC * n)()
        n = min(n, lib.lethe_engine_get_kv_spaces(e, sp, n))
        d["kv_spaces"] = [_as_dict(x) for x in sp[:n]]
        ss = _ffi.SparseStatsC()
        lib.lethe_engine_get_sparse_stats(e, byref(ss))
        d["sparse"] = _as_dict(ss)
        if lib.lethe_engine_chain_mode(e):
            c = _ffi.ChainStatsC()
            lib.lethe_engine_get_chain_stats(e, byref(c))
            d["chain"] = _as_dict(c)
            n = lib.lethe_engine_list_chains(e, None, 0)
            cs = (_ffi.ChainSummaryC * n)()
            n = min(n, lib.lethe_engine_list_chains(e, cs, n))
            d["chain"]["chains"] = [dict(_as_dict(x), chain_id=x.chain_id.decode()) for x in cs[:n]]
        return d


def _as_dict(s):
    return {k: getattr(s, k) for k, _ in s._fields_}
