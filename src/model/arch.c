/* arch.c - the registry of model families.
 *
 * lethe_arch_find() maps a config's architecture name (GGUF spelling, which
 * matches HF model_type for the families served) to the family that runs it.
 * One entry per arch_<family>.c; adding a family = one line here. Any other
 * name gets an error that lists what is supported. */
#include <string.h>

#include "core/util.h"
#include "model/model.h"

extern const lethe_arch lethe_arch_llama; /* arch_llama.c: llama, qwen2, qwen3, qwen3_moe */
extern const lethe_arch lethe_arch_mla;   /* arch_mla.c: glm4_moe_lite (deepseek2) */
extern const lethe_arch lethe_arch_hybrid; /* arch_hybrid.c: qwen3_5 (Gated DeltaNet hybrid) */

static const lethe_arch *const g_archs[] = {&lethe_arch_llama, &lethe_arch_mla,
                                            &lethe_arch_hybrid};

const lethe_arch *lethe_arch_find(const char *arch) {
    if (!arch || !arch[0]) {
        lethe_errorf(LETHE_ERR_FORMAT, "model config: architecture name is missing");
        return NULL;
    }
    char known[256] = "";
    for (size_t i = 0; i < LETHE_ARRAY_LEN(g_archs); i++)
        for (int k = 0; k < 8 && g_archs[i]->names[k]; k++) {
            if (!strcmp(arch, g_archs[i]->names[k])) return g_archs[i];
            if (known[0]) strncat(known, ", ", sizeof(known) - strlen(known) - 1);
            strncat(known, g_archs[i]->names[k], sizeof(known) - strlen(known) - 1);
        }
    lethe_errorf(LETHE_ERR_UNSUPPORTED,
                 "model architecture '%s' is not supported by lethe (supported: %s)", arch, known);
    return NULL;
}
