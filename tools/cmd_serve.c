/* cmd_serve.c - `lethe serve`: the OpenAI-compatible HTTP server.
 *
 * Flags follow `vllm serve`: the engine flags come from lethe_opts_engine()
 * (--model, --device, --max-model-len, --gpu-memory-utilization,
 * --max-num-seqs, --sparse-method, ...) and the server adds --host, --port,
 * --api-key, --served-model-name, --tool-call-parser and the connection limits. The model may also be given as the one
 * positional argument (`lethe serve MODEL`). Without a model the default
 * models/SmolLM2-135M-Instruct.Q4_1.gguf is served. The server itself lives
 * in src/server (see server.h). */
#include <stdio.h>
#include <string.h>

#include "commands.h"
#include "options.h"
#include "server/server.h"

int lethe_cmd_serve(int argc, char **argv) {
    lethe_server_config cfg;
    lethe_server_default_config(&cfg);
    lethe_opt rows[LETHE_OPTS_MAX];
    int n = lethe_opts_engine(rows, &cfg.engine);
    rows[n++] = (lethe_opt){"--host", NULL, LETHE_OPT_STR, &cfg.host, "ADDR",
                            "address to listen on (0.0.0.0 for all interfaces)", 1, 0};
    rows[n++] = (lethe_opt){"--port", "-p", LETHE_OPT_INT, &cfg.port, "N",
                            "TCP port (0 = any free port, printed at startup)", 0, 65535};
    rows[n++] = (lethe_opt){"--api-key", NULL, LETHE_OPT_STRLIST, cfg.api_keys, "KEY",
                            "require 'Authorization: Bearer KEY' on /v1 routes (repeatable: one key per "
                            "tenant)", 1, 0};
    rows[n++] = (lethe_opt){"--api-key-file", NULL, LETHE_OPT_STR, &cfg.api_key_file, "PATH",
                            "more API keys, one a line ('#' comments)", 1, 0};
    rows[n++] = (lethe_opt){"--tenant-header", NULL, LETHE_OPT_STR, &cfg.tenant_header, "NAME",
                            "without API keys: this request header names the tenant that owns chains "
                            "(only behind a proxy that authenticates and sets it)", 1, 0};
    rows[n++] = (lethe_opt){"--metrics-require-key", NULL, LETHE_OPT_BOOL, &cfg.metrics_require_key, NULL,
                            "/metrics needs an API key too", 0, 0};
    rows[n++] = (lethe_opt){
        "--replica",
        NULL,
        LETHE_OPT_BOOL,
        &cfg.replica,
        NULL,
        "one replica of several behind a load balancer (docs/deploy.md): a chain id "
        "this server does not hold answers 410 chain_gone, so clients recreate it",
        0,
        0};
    rows[n++] = (lethe_opt){"--max-connections", NULL, LETHE_OPT_INT, &cfg.max_connections, "N",
                            "open HTTP connections in all; more get 503", 16, 1 << 20};
    rows[n++] = (lethe_opt){"--max-connections-per-client", NULL, LETHE_OPT_INT,
                            &cfg.max_connections_per_client, "N",
                            "open connections per client address; more get 429 (0 = no limit; behind a "
                            "proxy every client has its address)", 0, 1 << 20};
    rows[n++] = (lethe_opt){"--http-workers", NULL, LETHE_OPT_INT, &cfg.http_workers, "N",
                            "threads that parse, tokenize and submit requests", 1, 256};
    rows[n++] = (lethe_opt){"--header-timeout", NULL, LETHE_OPT_FLOAT, &cfg.header_timeout_s, "S",
                            "seconds to send the request line and headers (408 after)", 0.1, 3600};
    rows[n++] = (lethe_opt){"--body-timeout", NULL, LETHE_OPT_FLOAT, &cfg.body_timeout_s, "S",
                            "seconds to send the body after the headers (408 after)", 0.1, 3600};
    rows[n++] = (lethe_opt){"--idle-timeout", NULL, LETHE_OPT_FLOAT, &cfg.idle_timeout_s, "S",
                            "seconds an idle keep-alive connection stays open", 0.1, 3600};
    rows[n++] = (lethe_opt){"--write-timeout", NULL, LETHE_OPT_FLOAT, &cfg.write_timeout_s, "S",
                            "seconds a client may read nothing of its response before it is dropped", 0.1,
                            3600};
    rows[n++] = (lethe_opt){"--served-model-name", NULL, LETHE_OPT_STR, &cfg.served_model_name,
                            "NAME", "model id in the API (default: the model file's name)", 1, 0};
    rows[n++] = (lethe_opt){"--max-queued-requests", NULL, LETHE_OPT_INT,
                            &cfg.max_queued_requests, "N",
                            "requests allowed to wait beyond --max-num-seqs before 503", 0,
                            1 << 20};
    rows[n++] = (lethe_opt){"--max-request-bytes", NULL, LETHE_OPT_BYTES, &cfg.max_body_bytes,
                            "SIZE", "larger request bodies are refused with 413", 1, 0};
    rows[n++] = (lethe_opt){"--tool-call-parser", NULL, LETHE_OPT_STR, &cfg.tool_call_parser, "NAME",
                            "how tool calls are read from the output: auto (the chat template's format), "
                            "hermes, llama3_json, glm45", 1, 0};
    rows[n++] = (lethe_opt){"--no-ui", NULL, LETHE_OPT_BOOL, &cfg.no_ui, NULL,
                            "no dashboard at GET / (chat playground + live panels from /metrics)", 0, 0};
    rows[n++] = (lethe_opt){"--load-delay-ms", NULL, LETHE_OPT_INT, &cfg.load_delay_ms, "MS",
                            "testing: wait before loading the model (/health stays 503)", 0,
                            600000};
    const char *pos[1];
    int n_pos = 0;
    int rc = lethe_opts_parse(rows, n, argc, argv, "lethe serve [MODEL] [options]",
                              "Serves a model over an OpenAI-compatible HTTP API: /v1/completions, "
                              "/v1/chat/completions,\n/v1/models, /tokenize, /detokenize, /health, "
                              "/metrics (Prometheus), /v1/worker/load,\n/v1/prefix_cache/{prune, match, "
                              "inspect, delete_subtree, set_eviction_priority} (radix\ncache pruning and "
                              "control), and a dashboard at / (--no-ui: off).\n\n"
                              "Request fields besides OpenAI's (docs/serving.md has each with examples):\n"
                              "  sampling     top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids\n"
                              "  chat         tools, tool_choice (auto|none|required|{function}), "
                              "parallel_tool_calls,\n"
                              "               chat_template_kwargs {enable_thinking, date_string, "
                              "tools_in_user_message},\n"
                              "               enable_thinking, preserve_thinking, add_generation_prompt;\n"
                              "               per message: retention (pin|normal|{prunable: keep_ratio})\n"
                              "  output       response_format {text|json_object|json_schema|grammar} "
                              "(enforced while sampling);\n"
                              "               reasoning_content and tool_calls in messages and stream deltas\n"
                              "  chain cache  chain_id, chain_append_start (--prefix-cache-mode chain); "
                              "responses carry\n"
                              "               chain_id and chain_status (created|resumed|recreated);\n"
                              "               branching: chain_share_prefix (tokens) or chain_share_messages\n"
                              "               (chat: the first k messages) shared with other chains, held once\n"
                              "  replay       forced_token_ids\n"
                              "  sparse       none per request: the method and its knobs are the server's "
                              "(--sparse-method,\n"
                              "               --sparse-config); unknown fields are ignored",
                              pos, &n_pos, 1);
    if (rc != 0) return rc > 0 ? 0 : 2;
    if (n_pos == 1) cfg.engine.model = pos[0];
    if (cfg.tool_call_parser && strcmp(cfg.tool_call_parser, "auto") && strcmp(cfg.tool_call_parser, "hermes") &&
        strcmp(cfg.tool_call_parser, "llama3_json") && strcmp(cfg.tool_call_parser, "glm45")) {
        fprintf(stderr, "lethe serve: --tool-call-parser must be auto, hermes, llama3_json or glm45 (got '%s')\n",
                cfg.tool_call_parser);
        return 2;
    }
    if (cfg.max_body_bytes == 0) {
        fprintf(stderr, "lethe serve: --max-request-bytes must be positive\n");
        return 2;
    }
    return lethe_server_run(&cfg);
}
