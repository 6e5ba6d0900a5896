/* trace.h - multi-turn agent traces for `lethe bench replay`: the JSONL
 * format, a generator of synthetic coding-agent traces, and the text
 * materialization that turns token counts into chat messages.
 *
 * One JSONL line per turn:
 *   {"agent": "a0", "turn": 0,
 *    "messages": [{"role": "user", "content": "..."}],   appended this turn, or
 *    "append_tokens": 800,                              a count (materialized),
 *    "system_tokens": 200,                              turn 0 only, optional
 *    "output": "...",  or  "output_tokens": 40,         the assistant reply to force
 *    "wait_s": 1.25}                                    tool time before the NEXT turn
 * Turns of one agent are numbered 0..n-1 without gaps (any line order).
 *
 * Materialization: a count of N becomes N words drawn from the single-token
 * word list (lethe_bs_words) with a seeded PRNG keyed by (agent, turn, role),
 * so every configuration of a replay sends the same text. Tool outputs go in
 * "user" messages (every supported chat format has the role).
 *
 * Generator (coding-agent shape): a system prompt and a task on turn 0, then
 * per turn a long tool output (uniform in [tool_min, tool_max] tokens), a
 * short assistant reply (uniform in [out_min, out_max]) and a tool wait
 * uniform in [0, max_wait_s); 20-60 turns per agent by default; an agent
 * stops early when its context would exceed max_context tokens. */
#ifndef LETHE_BENCH_TRACE_H
#define LETHE_BENCH_TRACE_H

#include <stdint.h>

#include "core/status.h"

typedef struct lethe_trace_msg {
    char *role;
    char *content;
} lethe_trace_msg;

typedef struct lethe_trace_turn {
    int32_t agent;             /* index into lethe_trace.agent_names */
    int32_t turn;
    lethe_trace_msg *msgs;     /* explicit appended messages (n_msgs > 0), else counts */
    int32_t n_msgs;
    int32_t append_tokens;     /* count form: tool output / task words */
    int32_t system_tokens;     /* count form, turn 0: system prompt words (0 = none) */
    char *output;              /* forced reply text, or NULL (count form) */
    int32_t output_tokens;     /* count form: reply words */
    double wait_s;
} lethe_trace_turn;

typedef struct lethe_trace {
    lethe_trace_turn *turns;   /* sorted by (agent, turn) */
    int32_t n_turns;
    char **agent_names;
    int32_t n_agents;
    int32_t *agent_first;      /* [n_agents + 1]: turns of agent a are [first[a], first[a+1]) */
    bool shared_system;        /* count form: every agent's system prompt is the same words */
} lethe_trace;

lethe_status lethe_trace_load(const char *path, lethe_trace *out);
lethe_status lethe_trace_save(const lethe_trace *t, const char *path);
void lethe_trace_free(lethe_trace *t);

typedef struct lethe_trace_gen_params {
    int32_t n_agents;          /* 8 */
    int32_t min_turns, max_turns; /* 20, 60 */
    int32_t system_tokens;     /* 300 */
    int32_t task_tokens;       /* 200 */
    int32_t tool_min, tool_max; /* 200, 2000 */
    int32_t out_min, out_max;  /* 20, 120 */
    double max_wait_s;         /* 2.0 */
    int32_t max_context;       /* 0 = unbounded; else stop an agent before exceeding it */
    uint64_t seed;
    bool shared_system;        /* one system prompt for all agents (branching chains share it) */
} lethe_trace_gen_params;

void lethe_trace_gen_default(lethe_trace_gen_params *p);
lethe_status lethe_trace_generate(const lethe_trace_gen_params *p, lethe_trace *out);

/* Approximate context tokens of an agent after its turn k (counts; explicit
 * messages count as bytes / 4). Used by the generator's max_context bound. */
int64_t lethe_trace_context_after(const lethe_trace *t, int32_t agent, int32_t turn);

/* n words (each " word", single-token in SmolLM2/Llama-3/Qwen3) keyed by
 * (seed, agent, turn, salt); malloc'd. */
char *lethe_trace_words(uint64_t seed, int32_t agent, int32_t turn, int32_t salt, int32_t n);

/* The appended messages of one turn, explicit or materialized: a malloc'd
 * array of *n messages (free each with lethe_trace_msg_free, then the array). */
lethe_trace_msg *lethe_trace_turn_messages(const lethe_trace *t, const lethe_trace_turn *u, uint64_t seed,
                                           int32_t *n);
/* The forced reply text of one turn (malloc'd). */
char *lethe_trace_turn_output(const lethe_trace *t, const lethe_trace_turn *u, uint64_t seed);
void lethe_trace_msg_free(lethe_trace_msg *m);

#endif /* LETHE_BENCH_TRACE_H */
