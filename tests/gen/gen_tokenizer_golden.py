#!/usr/bin/env python3
"""gen_tokenizer_golden.py - golden fixtures for tests/test_tokenizer.c and
tests/test_chat_template.c, produced by HF `tokenizers` / `transformers`.

Tokenizers:
  smollm2  built from models/SmolLM2-135M-Instruct.Q4_1.gguf (vocab, merges,
           control tokens) with SmolLM2's HF pipeline: pre_tokenizer
           Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=
           False, use_regex=True)], ByteLevel decoder, control tokens as special
           added tokens. (transformers' own GGUF->tokenizer conversion is compared
           too and reported, for information.)
  llama3   /work/shared/data/tokenizers/llama3/tokenizer.json (+ config)
  qwen3    /work/shared/data/tokenizers/qwen3/tokenizer.json (+ config)

Writes (all small):
  tests/data/tokenizer/texts.txt        the texts, shared by all tokenizers
  tests/data/tokenizer/<tok>.ids        per text: ids with and without
                                        special-token parsing, expected decode
  tests/data/tokenizer/chat_golden.txt  apply_chat_template outputs

Formats (lengths are byte counts, so any bytes survive):
  texts.txt:   "T <name> <nbytes>\\n" <bytes> "\\n"
  <tok>.ids:   "M n_vocab <n> bos <id> eos <id> adds_bos <0|1>\\n"
               "I <name> <parse_special 0|1> <n> <id> ...\\n"
               "D <name> <nbytes>\\n" <bytes> "\\n"   decode(ids) when != text
               "S <name> <nbytes>\\n" <bytes> "\\n"   decode(ids, skip_special)
  chat_golden: "C <tok> <case> <add_gen 0|1> <n_msgs>\\n" then per message
               "R <role> <nbytes>\\n" <bytes> "\\n", then "E <nbytes>\\n" <bytes> "\\n"

Run from the repo root: python3 tests/gen/gen_tokenizer_golden.py
"""
import os
import sys

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "data", "tokenizer")
SHARED = "/work/shared/data"
GGUF = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def read_gguf_tokenizer(path):
    import gguf
    r = gguf.GGUFReader(path)

    def arr(key):
        f = r.fields[key]
        return [f.parts[i] for i in f.data]

    def scalar(key):
        f = r.fields[key]
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v[0]

    tokens = [bytes(p).decode() for p in arr("tokenizer.ggml.tokens")]
    types = [int(p[0]) for p in arr("tokenizer.ggml.token_type")]
    merges = [bytes(p).decode() for p in arr("tokenizer.ggml.merges")]
    meta = {k: scalar(k) for k in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                   "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
                                   "tokenizer.ggml.pre")}
    return tokens, types, merges, meta


def smollm2_tokenizer():
    tokens, types, merges, meta = read_gguf_tokenizer(GGUF)
    assert meta["tokenizer.ggml.pre"] == "smollm"
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab, [tuple(m.split(" ")) for m in merges])
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, ty in enumerate(types) if ty == 3])
    return tk, meta


def slice_words(text, start, n_chars):
    """a slice of text starting and ending at whitespace"""
    s = text.find(" ", start) + 1
    e = text.find(" ", s + n_chars)
    return text[s:e if e > 0 else len(text)]


def sotu(name):
    with open(os.path.join(SHARED, "sotu", name), encoding="utf-8") as f:
        return f.read()


def make_texts():
    t = []
    w = sotu("1790_george_washington_n.txt")
    t.append(("sotu_washington_1790", w[:1500]))
    t.append(("sotu_lincoln_1862", slice_words(sotu("1862_abraham_lincoln_r.txt"), 3000, 1200)))
    t.append(("sotu_fdr_1941", slice_words(sotu("1941_franklin_d_roosevelt_d.txt"), 2000, 1200)))
    t.append(("sotu_lbj_1964_long", slice_words(sotu("1964_lyndon_b_johnson_d.txt"), 0, 14000)))
    t.append(("empty", ""))
    t.append(("one_space", " "))
    t.append(("one_char", "a"))
    t.append(("emoji", "Hello 👋🏽 world 🎉🎉! Family: 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, keycap 1️⃣, ❤️‍🔥 and 🤖."))
    t.append(("cjk", "你好，世界！这是一个测试。日本語のテキストも含まれています。한국어 텍스트도 있습니다. 混合Mixed文本123。"))
    t.append(("whitespace_runs", "a" + " " * 40 + "b\n\n\n\n   \t\t  c" + " " * 7 + "\n" + " " * 3 +
              "d   " + "\t" * 5 + "e" + " " * 17))
    t.append(("tabs_newlines", "line1\n\tline2\r\n\r\nline3\n\n\n  \n\tindented\t\ttabs\n \n"))
    t.append(("leading_trailing_ws", "   leading and trailing   "))
    t.append(("digits_numbers", "In 1776, 12345678 people paid $3.14159 for 1,000,000 items; the 2nd and 3rd "
              "were 0.5% off. Call 555-0123 or 007. Arabic-Indic ٣٤٥, roman ⅻ, fullwidth １２３, 10^10=1e10."))
    t.append(("code", "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
              "int main(void) {\n\tfor (int i = 0; i < 10; i++) printf(\"%d\\n\", i);\n\treturn 0;\n}\n"
              "x = {'a': [1, 2, 3], \"b\": None}  # comment\n// C++ comment && || != == <= >= -> :: ...\n"))
    t.append(("contractions", "I'm sure they'll say we've, you'd, she's, it's; don't won't can't. I'M LOUD, "
              "THEY'LL, WE'VE, 'S 'T 'Re ’s ’ll (curly)."))
    t.append(("special_chatml", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
              "<|im_start|>assistant\n"))
    t.append(("special_mixed", "text<|endoftext|>more <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
              "hey<|eot_id|> <think>hmm</think> <tool_call>{}</tool_call> <|im_end|><|im_end|>x<|im_start"))
    t.append(("mixed_scripts", "Ωmega ΑΒΓ δέλτα кириллица Привет عربي مرحبا עברית हिन्दी नमस्ते ไทย ສະບາຍດີ "
              "ქართული Ελληνικά Zalgo: Z̴̡a̷l̸g̵o̶ ZWJ‍join zero\u200bwidth BOM\ufeff NBSP\u00a0x em\u2003y "
              "ideo\u3000z line\u2028sep."))
    t.append(("nfd_accents", "Cafe\u0301 re\u0301sume\u0301 na\u0131\u0308ve A\u030angstro\u0308m "
              "\u1100\u1161\u11a8 (Hangul jamo) e\u0301\u0301 \u212b"))
    t.append(("punctuation", "Wait... what?! (yes) [no] {maybe} \"quoted\" 'single' --dash-- — – … «» „“ ¿¡ "
              "@user #tag $5 %20 ^_^ ~/path\\to\\file | a&b * + = < > ;:,."))
    t.append(("url_email", "See https://example.com/path?q=1&x=%20y#frag or mail john.doe+tag@mail.example.org."))
    t.append(("control_chars", "bell\x07 esc\x1b[0m nul-free \x01\x02\x7f del, form\x0cfeed, vt\x0b."))
    t.append(("mongolian_vs", " \u180e'm the\u180e'll x \u180e\u180e y\u180e \u180e"))
    # whole-word vocabulary entries that merges alone would split (Llama-3 ignore_merges)
    t.append(("ignore_merges_words", "Tôi làm việc ở Việt Nam; nhiều điều hợp lý, jeho dům, ایران ngoài tự nhiên."))
    t.append(("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis " * 3 + "a" * 300))
    return t


def write_block(f, tag, name, data):
    b = data.encode("utf-8")
    head = f"{tag} {name} {len(b)}\n" if name is not None else f"{tag} {len(b)}\n"
    f.write(head.encode())
    f.write(b)
    f.write(b"\n")


def encode(tk, text, parse_special):
    tk.encode_special_tokens = not parse_special
    try:
        return tk.encode(text, add_special_tokens=False).ids
    finally:
        tk.encode_special_tokens = False


def write_ids(name, tk, texts, bos, eos):
    probe = tk.encode("hi", add_special_tokens=True).ids
    adds_bos = int(bos is not None and len(probe) > 0 and probe[0] == bos)
    path = os.path.join(OUT, f"{name}.ids")
    n_ids = 0
    with open(path, "wb") as f:
        f.write(f"M n_vocab {tk.get_vocab_size(with_added_tokens=True)} bos {bos if bos is not None else -1} "
                f"eos {eos if eos is not None else -1} adds_bos {adds_bos}\n".encode())
        for tname, text in texts:
            for ps in (1, 0):
                ids = encode(tk, text, bool(ps))
                n_ids += len(ids)
                f.write(f"I {tname} {ps} {len(ids)} {' '.join(map(str, ids))}\n".encode())
                if ps == 1:
                    dec = tk.decode(ids, skip_special_tokens=False)
                    if dec != text:
                        write_block(f, "D", tname, dec)
                    sk = tk.decode(ids, skip_special_tokens=True)
                    if sk != dec:
                        write_block(f, "S", tname, sk)
    print(f"{path}: {os.path.getsize(path)} bytes, {n_ids} ids")


LLAMA3_OFFICIAL = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                   "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                   "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                   "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
                   "<|end_header_id|>\n\n' }}{% endif %}")


def chat_cases():
    u = lambda c: {"role": "user", "content": c}
    a = lambda c: {"role": "assistant", "content": c}
    s = lambda c: {"role": "system", "content": c}
    tool = lambda c: {"role": "tool", "content": c}
    return {
        "single_user": [u("Hello!")],
        "system_user": [s("You are terse."), u("What is 2+2?")],
        "multi_turn": [u("Hi"), a("Hello! How can I help?"), u("Tell me a joke.")],
        "ends_assistant": [u("Name a color."), a("Blue.")],
        "whitespace_unicode": [u("  héllo 👋 \n\n"), a("\n  Hi ☺  \t"), u("\u3000wide space\u00a0")],
        "think_middle": [u("2+2?"), a("<think>\nadd them\n</think>\n\n4"), u("and 3+3?")],
        "think_last": [u("2+2?"), a("<think>\nadd them\n</think>\n\n4")],
        "tools": [u("weather?"), a("Let me check."), tool("sunny"), tool("22C"), u("thanks")],
        "system_later": [u("a"), s("be nice"), a("b")],
    }


def write_chat(smollm_tmpl):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    sm_tk, _ = smollm2_tokenizer()
    sm = PreTrainedTokenizerFast(tokenizer_object=sm_tk, bos_token="<|im_start|>", eos_token="<|im_end|>")
    sm.chat_template = smollm_tmpl
    l3 = AutoTokenizer.from_pretrained(os.path.join(SHARED, "tokenizers", "llama3"))
    q3 = AutoTokenizer.from_pretrained(os.path.join(SHARED, "tokenizers", "qwen3"))
    path = os.path.join(OUT, "chat_golden.txt")
    n = 0
    with open(path, "wb") as f:
        for case, msgs in chat_cases().items():
            runs = [("smollm2", sm, None, (0, 1)), ("qwen3", q3, None, (0, 1)),
                    # the llama3 folder's template always appends the assistant header
                    ("llama3", l3, None, (1,)), ("llama3-official", l3, LLAMA3_OFFICIAL, (0, 1))]
            for tname, tk, tmpl, gens in runs:
                for gen in gens:
                    kw = {"chat_template": tmpl} if tmpl else {}
                    out = tk.apply_chat_template(msgs, tokenize=False, add_generation_prompt=bool(gen), **kw)
                    f.write(f"C {tname} {case} {gen} {len(msgs)}\n".encode())
                    for m in msgs:
                        write_block(f, "R", m["role"], m["content"])
                    write_block(f, "E", None, out)
                    n += 1
    print(f"{path}: {os.path.getsize(path)} bytes, {n} cases")


def compare_transformers_gguf(tk, texts):
    """information only: does transformers' GGUF conversion agree with the reference build?"""
    try:
        from transformers import AutoTokenizer
        ht = AutoTokenizer.from_pretrained(os.path.dirname(GGUF), gguf_file=os.path.basename(GGUF))
    except Exception as e:  # noqa: BLE001 - informational
        print(f"transformers GGUF tokenizer unavailable: {e}")
        return
    diff = [n for n, t in texts if ht.encode(t, add_special_tokens=False) != tk.encode(t, add_special_tokens=False).ids]
    print(f"transformers GGUF conversion differs from the SmolLM2 reference on: {diff or 'nothing'}")


def main():
    os.makedirs(OUT, exist_ok=True)
    texts = make_texts()
    with open(os.path.join(OUT, "texts.txt"), "wb") as f:
        for name, text in texts:
            write_block(f, "T", name, text)
    sm, meta = smollm2_tokenizer()
    write_ids("smollm2", sm, texts, int(meta["tokenizer.ggml.bos_token_id"]), int(meta["tokenizer.ggml.eos_token_id"]))
    for name in ("llama3", "qwen3"):
        d = os.path.join(SHARED, "tokenizers", name)
        tk = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        from transformers import AutoTokenizer
        ht = AutoTokenizer.from_pretrained(d)
        write_ids(name, tk, texts, ht.bos_token_id, ht.eos_token_id)
    write_chat(meta["tokenizer.chat_template"])
    if "--compare-gguf" in sys.argv:
        compare_transformers_gguf(sm, texts)


if __name__ == "__main__":
    main()
