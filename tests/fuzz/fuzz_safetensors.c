/* fuzz_safetensors.c - the safetensors reader on arbitrary files: open fails
 * with an error or every tensor's bytes lie inside the mapping and match its
 * dtype and shape; small tensors are converted to f32. */
#include <stdint.h>

#include "core/status.h"
#include "fuzz_util.h"
#include "model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    char path[64];
    int fd = fuzz_memfile(data, n, path, sizeof(path));
    lethe_safetensors st;
    if (lethe_st_open_file(path, &st) == LETHE_OK) {
        for (size_t i = 0; i < st.n_tensors; i++) {
            const lethe_st_tensor *t = &st.tensors[i];
            const lethe_st_file *f = &st.files[t->file];
            const char *lo = f->map, *hi = lo + f->size;
            FUZZ_CHECK(t->n_bytes == 0 || ((const char *)t->data >= lo && (const char *)t->data + t->n_bytes <= hi));
            FUZZ_CHECK(lethe_st_find(&st, t->name) != NULL);
            if (t->n_elems <= 4096) {
                float *out = malloc((t->n_elems ? t->n_elems : 1) * sizeof(float));
                (void)lethe_st_to_f32(&st, t, out);
                free(out);
            }
        }
        lethe_st_close(&st);
    }
    close(fd);
    return 0;
}
