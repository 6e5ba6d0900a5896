/* commands.h - the `lethe` subcommands, one file each (tools/cmd_<name>.c). */
#ifndef LETHE_TOOLS_COMMANDS_H
#define LETHE_TOOLS_COMMANDS_H

int lethe_cmd_generate(int argc, char **argv); /* cmd_generate.c: one-shot / chat / --input JSONL */
int lethe_cmd_serve(int argc, char **argv);    /* cmd_serve.c: OpenAI-compatible server */
int lethe_cmd_bench(int argc, char **argv);    /* cmd_bench.c: engine / replay / serve benchmarks */
int lethe_cmd_eval(int argc, char **argv);     /* cmd_eval.c: long-context quality suite */
int lethe_cmd_methods(int argc, char **argv);  /* cmd_methods.c: list sparse methods and knobs */
int lethe_cmd_fit(int argc, char **argv);      /* cmd_fit.c: fit a method's assets (palu factors) */

/* `lethe bench <kind>`: cmd_bench.c dispatches; one file per kind. */
int lethe_bench_engine(int argc, char **argv); /* bench_engine.c: offline throughput vs roofline */
int lethe_bench_serve(int argc, char **argv);  /* bench_serve.c: HTTP client, vllm bench serve style */
int lethe_bench_replay(int argc, char **argv); /* bench_replay.c: agent-trace replay */
int lethe_bench_sparse(int argc, char **argv); /* bench_sparse.c: sparse methods vs dense decode throughput */
int lethe_bench_prefill(int argc, char **argv); /* bench_prefill.c: prefill-axis methods vs dense prefill time */
int lethe_bench_prune(int argc,
                      char **argv); /* bench_prune.c: prefix-cache pruning quality (KL, top-1) */

#endif /* LETHE_TOOLS_COMMANDS_H */
