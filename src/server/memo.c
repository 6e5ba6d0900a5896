/* memo.c - the reasoning memo of chain turns (agent.h).
 *
 * A chain's KV holds what the model generated, reasoning included; clients
 * send back the visible part only (content, tool_calls), and Qwen3's
 * template drops earlier reasoning anyway. To re-render a conversation to
 * the tokens the chain holds (so the turn resumes instead of recreating the
 * chain), the server remembers each chain turn's reasoning under (chain id,
 * content, each call's name and arguments text) and puts it back as
 * reasoning_content when it renders with preserve_thinking. Only the same
 * chain id finds an entry. A ring of SRV_MEMO_CAP entries, at most
 * SRV_MEMO_BYTES of text; the oldest go first. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "server/agent.h"

#define SRV_MEMO_CAP 4096
#define SRV_MEMO_BYTES ((size_t)32 << 20)

typedef struct memo_entry {
    uint64_t key;
    char *chain_id, *reasoning;
} memo_entry;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static memo_entry g_ring[SRV_MEMO_CAP];
static size_t g_next, g_bytes;

static uint64_t key_of(const char *chain_id, const char *content, const cJSON *calls) {
    uint64_t h = lethe_hash64(chain_id, strlen(chain_id), 0x6c657468u);
    h = lethe_hash64(content, strlen(content), h);
    const cJSON *c;
    cJSON_ArrayForEach(c, calls) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
        const char *ns = cJSON_IsString(name) ? name->valuestring : "";
        const char *as = cJSON_IsString(args) ? args->valuestring : "";
        h = lethe_hash64(ns, strlen(ns) + 1, h);
        h = lethe_hash64(as, strlen(as) + 1, h);
    }
    return h;
}

static void drop(memo_entry *e) {
    if (!e->chain_id) return;
    g_bytes -= strlen(e->chain_id) + strlen(e->reasoning);
    free(e->chain_id);
    free(e->reasoning);
    memset(e, 0, sizeof(*e));
}

void srv_memo_put(const char *chain_id, const char *content, const cJSON *tool_calls, const char *reasoning) {
    if (!chain_id || !chain_id[0] || !reasoning || !reasoning[0]) return;
    const size_t need = strlen(chain_id) + strlen(reasoning);
    if (need > SRV_MEMO_BYTES) return;
    const uint64_t key = key_of(chain_id, content ? content : "", tool_calls);
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < SRV_MEMO_CAP; i++) /* one entry per key */
        if (g_ring[i].chain_id && g_ring[i].key == key && !strcmp(g_ring[i].chain_id, chain_id)) drop(&g_ring[i]);
    for (size_t k = 0; g_bytes + need > SRV_MEMO_BYTES && k < SRV_MEMO_CAP; k++)
        drop(&g_ring[(g_next + k) % SRV_MEMO_CAP]);
    memo_entry *e = &g_ring[g_next];
    drop(e);
    e->key = key;
    e->chain_id = lethe_xstrdup(chain_id);
    e->reasoning = lethe_xstrdup(reasoning);
    g_bytes += need;
    g_next = (g_next + 1) % SRV_MEMO_CAP;
    pthread_mutex_unlock(&g_mu);
}

char *srv_memo_get(const char *chain_id, const char *content, const cJSON *tool_calls) {
    if (!chain_id || !chain_id[0]) return NULL;
    const uint64_t key = key_of(chain_id, content ? content : "", tool_calls);
    char *r = NULL;
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < SRV_MEMO_CAP && !r; i++)
        if (g_ring[i].chain_id && g_ring[i].key == key && !strcmp(g_ring[i].chain_id, chain_id))
            r = lethe_xstrdup(g_ring[i].reasoning);
    pthread_mutex_unlock(&g_mu);
    return r;
}
