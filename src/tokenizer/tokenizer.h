/* tokenizer.h - byte-level BPE (GPT-2 / SmolLM2, Llama-3, Qwen2/3 flavours).
 *
 * Loaded from GGUF metadata (tokenizer.ggml.*) or from an HF tokenizer.json
 * (+ tokenizer_config.json). Pre-tokenization uses the family's regex through
 * PCRE2 (Unicode aware); merges are applied by rank; special / added tokens
 * are matched before pre-tokenization when parse_special is true. */
#ifndef LETHE_TOKENIZER_H
#define LETHE_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

typedef struct lethe_tokenizer lethe_tokenizer;
typedef struct lethe_gguf lethe_gguf;

lethe_status lethe_tokenizer_from_gguf(const lethe_gguf *g, lethe_tokenizer **out);
/* tokenizer_config_path may be NULL (then BOS/EOS/chat template come from tokenizer.json alone). */
lethe_status lethe_tokenizer_from_hf(const char *tokenizer_json_path,
                                     const char *tokenizer_config_path, lethe_tokenizer **out);
/* From a model path as given to --model: a .gguf file (its metadata), an HF
 * folder (tokenizer.json + tokenizer_config.json), or a config.json / folder
 * used with dummy weights (tokenizer.json beside it if present, else
 * LETHE_ERR_NOT_FOUND with a message saying dummy models take token ids). */
lethe_status lethe_tokenizer_load(const char *model_path, lethe_tokenizer **out);
void lethe_tokenizer_free(lethe_tokenizer *t); /* NULL-safe */

int32_t lethe_tokenizer_n_vocab(const lethe_tokenizer *t);
int32_t lethe_tokenizer_bos(const lethe_tokenizer *t);  /* -1 if none */
int32_t lethe_tokenizer_eos(const lethe_tokenizer *t);  /* -1 if none */
bool lethe_tokenizer_is_eog(const lethe_tokenizer *t, int32_t id); /* eos, eot, im_end, ... */
/* a control token (matched only with parse_special; skip_special drops it) */
bool lethe_tokenizer_is_special(const lethe_tokenizer *t, int32_t id);
/* true when the model's tokenizer adds BOS to a plain prompt (Llama-3: yes; SmolLM2/Qwen: no) */
bool lethe_tokenizer_adds_bos(const lethe_tokenizer *t);
/* the GGUF tokenizer.chat_template / tokenizer_config chat_template, or NULL */
const char *lethe_tokenizer_chat_template(const lethe_tokenizer *t);
int32_t lethe_tokenizer_find_token(const lethe_tokenizer *t, const char *piece); /* -1 if absent */

/* Encodes text. add_bos: prepend BOS if the tokenizer has one. parse_special:
 * recognise special tokens written in the text ("<|im_start|>"); non-special
 * added tokens (HF "special": false, GGUF user-defined, e.g. Qwen's
 * "<tool_call>") are always recognised, as HF does. Text that is not valid
 * UTF-8 is accepted: its bytes are encoded as they are.
 * *ids is malloc'd (caller frees). */
lethe_status lethe_tokenize(const lethe_tokenizer *t, const char *text, size_t len, bool add_bos,
                            bool parse_special, int32_t **ids, int32_t *n_ids);

/* Raw bytes of a token (byte-level decoded); *n_bytes set; NULL for out-of-range ids. */
const char *lethe_token_bytes(const lethe_tokenizer *t, int32_t id, size_t *n_bytes);

/* Longest lethe_token_bytes of any token:
 * lethe_detok_push never truncates when cap >= 3 * (this + 4) + 1. */
size_t lethe_tokenizer_max_token_bytes(const lethe_tokenizer *t);

/* Full decode of ids to a malloc'd NUL-terminated string (invalid UTF-8 kept as is). */
char *lethe_detokenize(const lethe_tokenizer *t, const int32_t *ids, int32_t n, bool skip_special);

/* Incremental, UTF-8-safe detokenization for streaming: push one token, get the
 * text that became complete (never a partial UTF-8 sequence; bytes are held
 * until the sequence completes or proves invalid, then emitted as U+FFFD). */
typedef struct lethe_detok {
    const lethe_tokenizer *t;
    bool skip_special;
    char pending[8];
    int n_pending;
} lethe_detok;
void lethe_detok_init(lethe_detok *d, const lethe_tokenizer *t, bool skip_special);
/* Writes the newly complete text to out (NUL-terminated, cap bytes); returns bytes written.
 * Characters that do not fit in cap are dropped (see lethe_tokenizer_max_token_bytes). */
size_t lethe_detok_push(lethe_detok *d, int32_t id, char *out, size_t cap);
size_t lethe_detok_flush(lethe_detok *d, char *out, size_t cap);

#endif /* LETHE_TOKENIZER_H */
