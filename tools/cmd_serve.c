/* cmd_serve.c - `lethe serve`: the OpenAI-compatible HTTP server.
 *
 * Flags follow `vllm serve`: the engine flags come from lethe_opts_engine()
 * (--model, --device, --max-model-len, --gpu-memory-utilization,
 * --max-num-seqs, --sparse-method, ...) and the server adds --host, --port,
 * --api-key and --served-model-name. The model may also be given as the one
 * positional argument (`lethe serve MODEL`). Without a model the default
 * models/SmolLM2-135M-Instruct.Q4_1.gguf is served. The server itself lives
 * in src/server (see server.h). */
#include <stdio.h>

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
    rows[n++] = (lethe_opt){"--api-key", NULL, LETHE_OPT_STR, &cfg.api_key, "KEY",
                            "require 'Authorization: Bearer KEY' on /v1 routes", 1, 0};
    rows[n++] = (lethe_opt){"--served-model-name", NULL, LETHE_OPT_STR, &cfg.served_model_name,
                            "NAME", "model id in the API (default: the model file's name)", 1, 0};
    rows[n++] = (lethe_opt){"--max-queued-requests", NULL, LETHE_OPT_INT,
                            &cfg.max_queued_requests, "N",
                            "requests allowed to wait beyond --max-num-seqs before 503", 0,
                            1 << 20};
    rows[n++] = (lethe_opt){"--max-request-bytes", NULL, LETHE_OPT_BYTES, &cfg.max_body_bytes,
                            "SIZE", "larger request bodies are refused with 413", 1, 0};
    rows[n++] = (lethe_opt){"--load-delay-ms", NULL, LETHE_OPT_INT, &cfg.load_delay_ms, "MS",
                            "testing: wait before loading the model (/health stays 503)", 0,
                            600000};
    const char *pos[1];
    int n_pos = 0;
    int rc = lethe_opts_parse(rows, n, argc, argv, "lethe serve [MODEL] [options]",
                              "Serves a model over an OpenAI-compatible HTTP API: /v1/completions, "
                              "/v1/chat/completions,\n/v1/models, /health, /metrics (Prometheus).",
                              pos, &n_pos, 1);
    if (rc != 0) return rc > 0 ? 0 : 2;
    if (n_pos == 1) cfg.engine.model = pos[0];
    if (cfg.max_body_bytes == 0) {
        fprintf(stderr, "lethe serve: --max-request-bytes must be positive\n");
        return 2;
    }
    return lethe_server_run(&cfg);
}
