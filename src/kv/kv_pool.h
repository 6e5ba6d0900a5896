/* kv_pool.h - token-slot KV memory built for eviction.
 *
 * A slot holds ONE token's K and V for all KV heads of one layer. Every KV
 * layer l has two backend buffers, K[l] and V[l], each [n_slots, n_kv_heads,
 * head_dim], allocated once at start-up (be->ops->alloc) and never resized.
 *
 * Slot ids live in "slot spaces" (sp). Two layouts behind one interface:
 *   shared     one slot space for all layers: slot s means K[l][s] for every
 *              layer l; one row per request (dense, logical-selection methods).
 *   per-layer  one slot space per layer, each with its own free list and its
 *              own row per request, so each layer can keep different tokens
 *              (physical-eviction methods).
 * sp = lethe_kv_space_of(pool, layer) maps a layer to its slot space.
 *
 * A request owns a row id. In each slot space the row is an ordered list of
 * entries (slot, logical position), ascending by position; the last entries
 * are the newest tokens. Positions stay logical: after compaction a new token
 * keeps its true position (K is stored after RoPE, nothing is re-rotated).
 *
 * Ownership: each slot has a reference count = (row entries pointing at it) +
 * (references held by the prefix cache). 0 = on the free list. A slot is
 * returned to its free list when the count drops to 0. lethe_kv_check()
 * verifies all of this (kv_check.c).
 *
 * Optional per-page metadata (16-token pages of a row, for methods that score
 * pages): page_meta_floats floats per page per row per slot space, host
 * memory; "valid_pages" says how many leading pages are current. Appends and
 * compaction lower valid_pages to the first page they changed; the method
 * recomputes pages [valid_pages, n_pages) and raises it.
 *
 * Payload (backend.h lethe_kv_layout): per layer a list of planes, buffers
 * [n_slots][bytes] declared by the sparse method or the model (latents,
 * codes, norms); without a declared layout the storage format's planes K[l]
 * and V[l] below. Sized by real bytes (lethe_kv_layouts_token_bytes).
 *
 * Optional per-(layer, KV head) row lengths (head_masks, for per-head eviction:
 * KVzip's pair level, per-head SnapKV / Ada-KV): every row entry carries a
 * bit mask of the KV heads that still keep it (bit h = KV head h; all heads
 * when appended or attached). lethe_kv_keep_heads narrows the masks; an entry
 * no head keeps leaves the row and its slot is freed. A slot still holds all
 * KV heads' K/V, so memory is freed per token a whole layer dropped, while
 * attention reads per head only that head's entries (the engine builds
 * per-head selections: lethe_attn_args.head_sel_*). Head h's row length is
 * the number of entries with bit h (lethe_kv_head_len).
 *
 * Per-request states (hybrid models: linear-attention layers keep a fixed
 * recurrent + conv state per request instead of per-token KV): the pool's
 * n_layers are the KV (full-attention) layers only, numbered 0 .. n_layers-1
 * in model order (what slot spaces, methods and hooks call a layer); the
 * n_state_layers linear-attention layers take no token slots. Instead every
 * row owns one state slot for its whole life (taken by lethe_kv_row_alloc,
 * given back by lethe_kv_row_release, so finish, abort and preemption
 * release it with the row); state layer i keeps its buffers
 * lethe_kv_state_rec(i) [n_state_slots][state_k_bytes] and
 * lethe_kv_state_conv(i) [n_state_slots][state_v_bytes]. Admission asks
 * lethe_kv_state_n_free first. With scratch_slot the last state slot is
 * reserved the same way (padding sequences write it).
 *
 * Storage format (backend.h lethe_kv_format), chosen by the sparse method:
 * NATIVE stores the backend's kv type; FP8_E4M3 stores 1-byte codes in K[l] /
 * V[l] plus per-(slot, KV head) f32 scales (lethe_kv_quant_of). Bytes per
 * token over all layers (lethe_kv_token_bytes):
 *   NATIVE    2 * n_layers * n_kv_heads * head_dim * kv_size
 *   FP8_E4M3  2 * n_layers * n_kv_heads * (head_dim + 4)
 *   KIVI b/G  n_layers * KH hd (2 b / 8 + 16 / G) + 4   (codes, V group params,
 *             the slot's share of the K group table, host slot index; backend.h)
 *             plus a fixed full-precision residual of kivi_res_blocks * G tokens
 *             (lethe_kv_kivi_res_bytes), one block per running request
 *   TURBOQUANT b  2 * n_layers * n_kv_heads * (head_dim * b / 8 + 2)   (codes,
 *             fp16 norm; plus one copy of the rotation / codebook tables)
 * so the same memory budget holds kv_size * hd / (hd + 4) times the slots
 * (CUDA bf16, hd 128: 1.94x; CPU f32: 3.88x) with FP8, and with KIVI 2-bit,
 * G 32 at KH 8, hd 128: 4096 / 1028 = 3.98x against bf16. */
#ifndef LETHE_KV_POOL_H
#define LETHE_KV_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "core/status.h"

#define LETHE_KV_PAGE 16

typedef struct lethe_kv_pool lethe_kv_pool;

typedef struct lethe_kv_pool_params {
    int32_t n_layers;         /* KV (attention) layers */
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t n_slots;          /* slots per layer */
    bool per_layer;           /* one slot space + row per layer (eviction methods) */
    int32_t page_meta_floats; /* floats of metadata per 16-token page; 0 = none */
    lethe_backend *be;        /* NULL: bookkeeping only (fake-model tests), no K/V buffers */
    lethe_kv_format format;   /* NATIVE (0) unless the method declares another */
    /* Reserve one slot (the last id, n_slots - 1, in every slot space) that no
     * row ever owns: the pool holds its only reference, so it is never on a
     * free list and the checker counts it. Padding sequences of CUDA-graph
     * decode buckets store their K/V there and attend only to it
     * (engine_forward.c). n_slots includes it. */
    bool scratch_slot;
    int32_t kivi_res_blocks;  /* KIVI: residual blocks of G tokens (one per running row) */
    /* A payload of its own (backend.h lethe_kv_layout), [n_layers], copied:
     * the method's or the model's planes instead of the format's K / V (format
     * must then be NATIVE). NULL = the format's planes. */
    const lethe_kv_layout *layouts;
    bool head_masks;          /* per-entry KV-head masks (above); needs n_kv_heads <= 64 */
    /* per-request states (above): linear-attention layers besides the
     * n_layers KV layers; 0 = none */
    int32_t n_state_layers;
    size_t state_k_bytes, state_v_bytes; /* recurrent / conv bytes per state slot of one state layer */
    int32_t n_state_slots;    /* incl. the scratch one (scratch_slot) */
} lethe_kv_pool_params;

/* Bytes one token costs across all layers with payload layouts [n_layers]
 * (the sum of every layer's planes). */
size_t lethe_kv_layouts_token_bytes(const lethe_kv_layout *layouts, int32_t n_layers);
/* Bytes one token costs across all layers (K and V, with the format's side
 * arrays); kv_elem_size is the backend's native kv type size. */
size_t lethe_kv_token_bytes(int32_t n_layers, int32_t n_kv_heads, int32_t head_dim,
                            size_t kv_elem_size, lethe_kv_format format);
const char *lethe_kv_format_name(lethe_kv_format f);
/* KIVI's fixed residual (0 for other formats): res_blocks * G tokens, K and V, native type */
size_t lethe_kv_kivi_res_bytes(int32_t n_layers, int32_t n_kv_heads, int32_t head_dim,
                               size_t kv_elem_size, lethe_kv_format format, int32_t res_blocks);

lethe_status lethe_kv_pool_create(const lethe_kv_pool_params *p, lethe_kv_pool **out);
void lethe_kv_pool_destroy(lethe_kv_pool *pool); /* NULL-safe */

int32_t lethe_kv_n_layers(const lethe_kv_pool *pool);
int32_t lethe_kv_n_slots(const lethe_kv_pool *pool);  /* per slot space (incl. the scratch slot) */
/* The reserved scratch slot (same id in every slot space), or -1 without one. */
int32_t lethe_kv_scratch_slot(const lethe_kv_pool *pool);
int32_t lethe_kv_n_spaces(const lethe_kv_pool *pool); /* 1 (shared) or n_layers */
bool lethe_kv_per_layer(const lethe_kv_pool *pool);
static inline int32_t lethe_kv_space_of_(bool per_layer, int32_t layer) {
    return per_layer ? layer : 0;
}
int32_t lethe_kv_space_of(const lethe_kv_pool *pool, int32_t layer);
int32_t lethe_kv_n_free(const lethe_kv_pool *pool, int32_t sp);
int32_t lethe_kv_min_free(const lethe_kv_pool *pool); /* over slot spaces */
int64_t lethe_kv_total_free(const lethe_kv_pool *pool); /* summed over slot spaces */
int64_t lethe_kv_dropped(const lethe_kv_pool *pool);    /* entries lethe_kv_keep dropped, cumulative */
/* Host RAM of the pool's backend buffers (K/V planes and side arrays) when
 * the backend's memory is host memory (LETHE_BE_HOST_MEMORY): *allocated
 * bytes in all, of which *resident are in RAM now (mincore). The buffers are
 * allocated untouched, so their pages join the process RSS as slots are first
 * written: the resident part follows the highest number of slots ever in use,
 * never the pool's size. False (0, 0) for device memory. Any thread: only
 * reads the buffer list, fixed after create. */
bool lethe_kv_host_memory(const lethe_kv_pool *pool, int64_t *resident, int64_t *allocated);

/* Backend K/V buffers of one layer (NULL without a backend). */
void *lethe_kv_k(const lethe_kv_pool *pool, int32_t layer);
void *lethe_kv_v(const lethe_kv_pool *pool, int32_t layer);
lethe_kv_format lethe_kv_format_of(const lethe_kv_pool *pool);
/* Payload planes of one layer: the layout (the declared one, or the format's
 * K / V planes) and plane i's buffer [n_slots][slot_bytes] (NULL without a
 * backend). lethe_kv_k / lethe_kv_v are planes 0 / 1. */
bool lethe_kv_has_layout(const lethe_kv_pool *pool); /* a declared layout (params.layouts) */
const lethe_kv_layout *lethe_kv_layout_of(const lethe_kv_pool *pool, int32_t layer);
void *lethe_kv_plane_buf(const lethe_kv_pool *pool, int32_t layer, int32_t i);
/* The layer's quantized-format descriptor for kv_store_quant / attention;
 * NULL for NATIVE (and without a backend). */
const lethe_kv_quant *lethe_kv_quant_of(const lethe_kv_pool *pool, int32_t layer);
/* KIVI: the host plan every layer's lethe_kv_quant points at (slot_aux
 * [n_slots], INT32_MIN = never stored); NULL for other formats / no backend. */
lethe_kivi_plan *lethe_kv_kivi_plan(lethe_kv_pool *pool);

/* ---- per-request states ---- */
bool lethe_kv_has_states(const lethe_kv_pool *pool);
int32_t lethe_kv_n_state_layers(const lethe_kv_pool *pool);
/* state layer i's buffers (backend memory, NULL without a backend) */
void *lethe_kv_state_rec(const lethe_kv_pool *pool, int32_t i);
void *lethe_kv_state_conv(const lethe_kv_pool *pool, int32_t i);
int32_t lethe_kv_state_n_free(const lethe_kv_pool *pool); /* INT32_MAX without states */
int32_t lethe_kv_n_state_slots(const lethe_kv_pool *pool);
int32_t lethe_kv_row_state(const lethe_kv_pool *pool, int32_t row); /* -1 without states */
int32_t lethe_kv_scratch_state(const lethe_kv_pool *pool); /* -1 without states / scratch */
/* A free state slot held by the caller (snapshots, the auxiliary prefill's
 * copy) until lethe_kv_state_give; -1 when none is free. Held slots count
 * against admission like a row's. */
int32_t lethe_kv_state_take(lethe_kv_pool *pool);
void lethe_kv_state_give(lethe_kv_pool *pool, int32_t slot);
int32_t lethe_kv_state_n_held(const lethe_kv_pool *pool);
/* state slot dst := state slot src in every state layer (recurrent and conv;
 * ops->state_copy, stream-ordered on the device); nothing without a backend */
void lethe_kv_state_copy(lethe_kv_pool *pool, int32_t dst, int32_t src);

/* ---- rows ---- */
/* A fresh empty row id (with a state slot when the pool has states: the
 * caller checked lethe_kv_state_n_free > 0). */
int32_t lethe_kv_row_alloc(lethe_kv_pool *pool);
void lethe_kv_row_release(lethe_kv_pool *pool, int32_t row); /* drops every entry, frees the id */
bool lethe_kv_row_in_use(const lethe_kv_pool *pool, int32_t row);
int32_t lethe_kv_max_rows(const lethe_kv_pool *pool);         /* row ids are < this */

int32_t lethe_kv_row_len(const lethe_kv_pool *pool, int32_t sp, int32_t row);
const int32_t *lethe_kv_row_slots(const lethe_kv_pool *pool, int32_t sp, int32_t row);
const int32_t *lethe_kv_row_pos(const lethe_kv_pool *pool, int32_t sp, int32_t row);

/* Appends n new tokens at positions pos[0..n) (ascending, after the row's
 * last position) to the row in EVERY slot space, taking fresh slots from each
 * free list. All-or-nothing: returns false and changes nothing when some slot
 * space has fewer than n free slots. */
bool lethe_kv_row_append(lethe_kv_pool *pool, int32_t row, int32_t n, const int32_t *pos);

/* Appends already-owned slots (from the prefix cache) to the row: slots is
 * [n_spaces][n] (space-major), pos [n]; each slot's count goes up by one. */
void lethe_kv_row_attach(lethe_kv_pool *pool, int32_t row, const int32_t *slots,
                         const int32_t *pos, int32_t n);

/* The same for one slot space alone (a row whose spaces differ: a per-layer
 * compacted chain row restored from the host tier): slots [n], pos [n]. */
void lethe_kv_row_attach_space(lethe_kv_pool *pool, int32_t row, int32_t sp, const int32_t *slots,
                               const int32_t *pos, int32_t n);

/* Physical compaction of one layer's row: keeps entries keep[0..n) (strictly
 * ascending indices into the current row), drops the rest and returns their
 * slots to that slot space's free list when no one else holds them. In the
 * shared layout this changes the one row every layer reads. */
void lethe_kv_keep(lethe_kv_pool *pool, int32_t layer, int32_t row, const int32_t *keep,
                   int32_t n);

/* ---- per-(layer, KV head) row lengths (pool param head_masks) ---- */
#define LETHE_KV_MAX_HEAD_MASK_HEADS 64
bool lethe_kv_has_head_masks(const lethe_kv_pool *pool);
/* all KV heads' bits: (1 << n_kv_heads) - 1 */
uint64_t lethe_kv_full_head_mask(const lethe_kv_pool *pool);
/* [row_len] masks of the row's entries in slot space sp; NULL without head masks */
const uint64_t *lethe_kv_row_head_mask(const lethe_kv_pool *pool, int32_t sp, int32_t row);
/* entries of the row in sp that KV head h keeps (the row length without head masks) */
int32_t lethe_kv_head_len(const lethe_kv_pool *pool, int32_t sp, int32_t row, int32_t head);
/* Per-head compaction of one layer's row: entry i keeps the heads mask[i]
 * (mask[0..row_len), each a subset of the entry's current mask); entries with
 * mask 0 leave the row (lethe_kv_keep: their slots are freed when unreferenced). */
void lethe_kv_keep_heads(lethe_kv_pool *pool, int32_t layer, int32_t row, const uint64_t *mask);

/* ---- references held outside rows (the prefix cache) ---- */
void lethe_kv_ref(lethe_kv_pool *pool, int32_t sp, int32_t slot);
void lethe_kv_unref(lethe_kv_pool *pool, int32_t sp, int32_t slot);
int32_t lethe_kv_refcount(const lethe_kv_pool *pool, int32_t sp, int32_t slot);

/* ---- a slot's payload to / from host memory (the host KV tier; kv_host.c) ----
 * Host image of n slots of space sp: [layer of the space][plane][n][slot_bytes],
 * lethe_kv_space_slot_bytes(pool, sp) * n bytes. Copies are synchronous. */
/* LETHE_OK when slots can be copied (backend memory, native format, no head
 * masks, a backend with rows_to_host / rows_from_host or host memory) */
lethe_status lethe_kv_host_copy_check(const lethe_kv_pool *pool);
size_t lethe_kv_space_slot_bytes(const lethe_kv_pool *pool, int32_t sp);
void lethe_kv_slots_save(lethe_kv_pool *pool, int32_t sp, const int32_t *slots, int32_t n, void *dst);
void lethe_kv_slots_load(lethe_kv_pool *pool, int32_t sp, const int32_t *slots, int32_t n, const void *src);
/* A state slot's states to / from host memory (a hybrid model's state
 * snapshots in the host tier): host image [state layer][recurrent | conv],
 * lethe_kv_state_host_bytes bytes (0 without states); the slot must be held
 * (lethe_kv_state_take) or owned by a row. Same backend ops and counters as
 * the slot copies; synchronous, ordered after the stream's earlier work. */
size_t lethe_kv_state_host_bytes(const lethe_kv_pool *pool);
void lethe_kv_state_save(lethe_kv_pool *pool, int32_t slot, void *dst);
void lethe_kv_state_load(lethe_kv_pool *pool, int32_t slot, const void *src);
/* n free slots of space sp with one reference each, held by the caller (as
 * lethe_kv_ref; dropped with lethe_kv_unref); false (nothing taken) when
 * fewer are free */
bool lethe_kv_slots_take(lethe_kv_pool *pool, int32_t sp, int32_t n, int32_t *out);
/* cumulative bytes and wall seconds of the saves (demotions) and loads
 * (restores) above: the copies are synchronous, so bytes / seconds is the
 * tier's bandwidth as the engine sees it */
typedef struct lethe_kv_host_copies {
    int64_t saved_bytes, loaded_bytes;
    double save_s, load_s;
} lethe_kv_host_copies;
void lethe_kv_host_copy_stats(const lethe_kv_pool *pool, lethe_kv_host_copies *out);

/* ---- protected positions (retention pins; kv_protect.c) ----
 * Per row, logical positions no method, pruning or compaction may drop:
 * ranges[2 i], ranges[2 i + 1] = [start, end). They belong to the row (all
 * slot spaces), accumulate over protect calls and go with the row. */
void lethe_kv_row_protect(lethe_kv_pool *pool, int32_t row, const int32_t *ranges, int32_t n);
/* the row's merged ranges (sorted, disjoint); returns how many */
int32_t lethe_kv_row_protected(const lethe_kv_pool *pool, int32_t row, const int32_t **ranges);
bool lethe_kv_pos_protected(const lethe_kv_pool *pool, int32_t row, int32_t pos);
/* mask[i] = 1 when entry i of the row in slot space sp is protected ([row len]);
 * returns how many are */
int32_t lethe_kv_row_pin_mask(const lethe_kv_pool *pool, int32_t sp, int32_t row, uint8_t *mask);
/* the first protected position in [from, limit) missing from the row in some space, or -1 */
int32_t lethe_kv_row_missing_protected(const lethe_kv_pool *pool, int32_t row, int32_t from,
                                       int32_t limit);

/* ---- optional per-page metadata ---- */
int32_t lethe_kv_page_meta_floats(const lethe_kv_pool *pool);
/* metadata of page `page` of the row in slot space sp: [page_meta_floats] */
float *lethe_kv_page_meta(lethe_kv_pool *pool, int32_t sp, int32_t row, int32_t page);
int32_t lethe_kv_page_meta_valid(const lethe_kv_pool *pool, int32_t sp, int32_t row);
void lethe_kv_page_meta_set_valid(lethe_kv_pool *pool, int32_t sp, int32_t row, int32_t n_pages);

/* ---- ownership checker (kv_check.c) ---- */
/* Something outside the rows that holds slot references (the prefix cache):
 * for_each calls visit(visit_ctx, sp, slot) once per reference it holds;
 * for_each_state (may be NULL) visit(visit_ctx, state_slot) once per state
 * slot it holds (lethe_kv_state_take: the radix cache's snapshots). */
typedef struct lethe_kv_holder {
    void *ctx;
    void (*for_each)(void *ctx, void (*visit)(void *visit_ctx, int32_t sp, int32_t slot),
                     void *visit_ctx);
    void (*for_each_state)(void *ctx, void (*visit)(void *visit_ctx, int32_t state_slot),
                           void *visit_ctx);
} lethe_kv_holder;

/* Verifies: every slot is free (count 0, on its free list exactly once) or
 * referenced exactly `count` times by rows + holders (+ the pool's own
 * reference on the scratch slot); every state slot free exactly once or owned
 * by exactly one row in use (every row in use owns one), the scratch state by
 * none; when some holder lists state slots (for_each_state), the held ones
 * are exactly those the holders list, each once (nothing else holds one
 * between engine steps);
 * no row points at a free slot, at the
 * scratch slot or twice at the same slot; positions ascend; free-list sizes add up.
 * Returns LETHE_OK or LETHE_ERR_INVALID with a message naming the violation. */
lethe_status lethe_kv_check(const lethe_kv_pool *pool, const lethe_kv_holder *holders,
                            int32_t n_holders);

#endif /* LETHE_KV_POOL_H */
