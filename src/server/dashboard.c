/* dashboard.c - GET / of `lethe serve`: the page and its /metrics series
 * (dashboard.h). The page is src/server/dashboard.html, assembled into
 * .rodata with .incbin (the Makefile makes this object depend on it), so the
 * binary serves it with no file next to it. */
#include "server/dashboard.h"

#include <stdint.h>
#include <string.h>

#include "core/util.h"

__asm__(".section .rodata\n"
        ".globl srv_dashboard_html_begin\n.hidden srv_dashboard_html_begin\n"
        ".globl srv_dashboard_html_end\n.hidden srv_dashboard_html_end\n"
        "srv_dashboard_html_begin:\n"
        ".incbin \"src/server/dashboard.html\"\n"
        "srv_dashboard_html_end:\n"
        ".byte 0\n"
        ".previous\n");
extern const char srv_dashboard_html_begin[], srv_dashboard_html_end[];

char *srv_dashboard_page(void) {
    size_t n = (size_t)(srv_dashboard_html_end - srv_dashboard_html_begin);
    char *p = lethe_xmalloc(n + 1);
    memcpy(p, srv_dashboard_html_begin, n);
    p[n] = '\0';
    return p;
}

/* a label value per the exposition format (\\, \", \n escaped) */
static void label(srv_buf *b, const char *v) {
    for (const char *p = v ? v : ""; *p; p++) {
        if (*p == '\\') srv_buf_puts(b, "\\\\");
        else if (*p == '"') srv_buf_puts(b, "\\\"");
        else if (*p == '\n') srv_buf_puts(b, "\\n");
        else srv_buf_add(b, p, 1);
    }
}

static void head(srv_buf *b, const char *name, const char *type, const char *help) {
    srv_buf_printf(b, "# HELP lethe:%s %s\n# TYPE lethe:%s %s\n", name, help, name, type);
}

/* lethe:NAME{model_name="M"EXTRA} V */
static void sample(srv_buf *b, const char *name, const char *model, const char *extra, double v) {
    srv_buf_printf(b, "lethe:%s{model_name=\"", name);
    label(b, model);
    srv_buf_printf(b, "\"%s} %.17g\n", extra ? extra : "", v);
}

/* chains listed by name in /metrics: the most recently used */
#define DASH_MAX_CHAINS 32
/* a chain's label: the first characters of its id only (the id resumes the
 * chain; /metrics may be open to anyone who can reach the port) */
#define DASH_CHAIN_LABEL 14

void srv_dashboard_metrics(lethe_engine *e, const char *model, const lethe_engine_params *p,
                           srv_buf *b) {
    head(b, "engine_info", "gauge", "The engine serving the model (labels); always 1.");
    srv_buf_printf(b, "lethe:engine_info{model_name=\"");
    label(b, model);
    srv_buf_puts(b, "\",method=\"");
    label(b, p->sparse_method ? p->sparse_method : "dense");
    srv_buf_puts(b, "\",sparse_config=\"");
    label(b, p->sparse_config);
    srv_buf_puts(b, "\",prefix_cache=\"");
    label(b, lethe_engine_prefix_cache_mode(e));
    srv_buf_puts(b, "\",device=\"");
    label(b, p->device ? p->device : "cpu");
    srv_buf_puts(b, "\"} 1\n");

    lethe_engine_stats st;
    lethe_engine_get_stats(e, &st);
    head(b, "engine_steps_total", "counter", "Engine steps run.");
    sample(b, "engine_steps_total", model, NULL, (double)st.n_steps);

    /* KV use per slot space (one per layer with per-layer rows) */
    int32_t n_sp = lethe_engine_get_kv_spaces(e, NULL, 0);
    lethe_kv_space_use *sp = lethe_xcalloc((size_t)LETHE_MAX(n_sp, 1), sizeof(*sp));
    n_sp = LETHE_MIN(n_sp, lethe_engine_get_kv_spaces(e, sp, n_sp));
    static const struct {
        const char *name, *help;
    } kv[] = {
        {"kv_space_used_slots", "KV slots held by requests and chains, per slot space."},
        {"kv_space_cached_slots",
         "KV slots held only by the prefix cache (evictable), per slot space."},
        {"kv_space_total_slots", "KV slots of the slot space."},
    };
    for (int k = 0; k < 3; k++) {
        head(b, kv[k].name, "gauge", kv[k].help);
        for (int32_t i = 0; i < n_sp; i++) {
            char extra[32];
            snprintf(extra, sizeof(extra), ",space=\"%d\"", (int)i);
            const lethe_kv_space_use *u = &sp[i];
            sample(b, kv[k].name, model, extra,
                   (double)(k == 0   ? u->slots_used
                            : k == 1 ? u->slots_cached
                                     : u->slots_total));
        }
    }
    free(sp);

    lethe_engine_sparse_stats ss;
    lethe_engine_get_sparse_stats(e, &ss);
    head(b, "attention_selected_slots_total", "counter",
         "KV entries attention read, summed over layers and sequences.");
    sample(b, "attention_selected_slots_total", model, NULL, (double)ss.selected_slots);
    head(b, "attention_resident_slots_total", "counter",
         "KV entries the rows held at those reads (selected <= resident).");
    sample(b, "attention_resident_slots_total", model, NULL, (double)ss.resident_slots);
    head(b, "sparse_evicted_slots_total", "counter",
         "KV row entries the sparse method dropped, summed over slot spaces.");
    sample(b, "sparse_evicted_slots_total", model, NULL, (double)ss.evicted_slots);

    /* chains: resident vs logical tokens */
    lethe_chain_summary *cs = lethe_xcalloc(DASH_MAX_CHAINS, sizeof(*cs));
    int32_t n_ch = LETHE_MIN(lethe_engine_list_chains(e, cs, DASH_MAX_CHAINS), DASH_MAX_CHAINS);
    static const struct {
        const char *name, *help;
    } ch[] = {
        {"chain_logical_tokens", "A chain's token history (the 32 most recently used chains)."},
        {"chain_resident_tokens", "A chain's resident KV entries, max over slot spaces."},
        {"chain_active", "1 while a chain's turn runs."},
    };
    for (int k = 0; k < 3; k++) {
        head(b, ch[k].name, "gauge", ch[k].help);
        for (int32_t i = 0; i < n_ch; i++) {
            char extra[64];
            snprintf(extra, sizeof(extra), ",chain=\"%.*s\"", DASH_CHAIN_LABEL, cs[i].chain_id);
            sample(b, ch[k].name, model, extra,
                   k == 0   ? cs[i].logical_tokens
                   : k == 1 ? cs[i].resident_tokens
                            : (double)cs[i].active);
        }
    }
    free(cs);
}
