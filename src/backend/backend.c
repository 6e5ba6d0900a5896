/* backend.c - picks a backend by name; the only place that knows whether
 * CUDA was compiled in (LETHE_HAVE_CUDA). */
#include "backend/backend.h"

#include <string.h>

lethe_status lethe_backend_create(const lethe_backend_params *p, lethe_backend **out) {
    const char *dev = p->device ? p->device : "cpu";
    if (!strcmp(dev, "cpu")) return lethe_backend_cpu_create(p, out);
    if (!strcmp(dev, "cuda")) {
#ifdef LETHE_HAVE_CUDA
        return lethe_backend_cuda_create(p, out);
#else
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "--device cuda: this lethe was built without CUDA (nvcc not found at "
                            "build time); rebuild on a machine with the CUDA toolkit");
#endif
    }
    return lethe_errorf(LETHE_ERR_INVALID, "--device %s: unknown device (expected cpu or cuda)", dev);
}

void lethe_backend_destroy(lethe_backend *be) {
    if (be && be->ops && be->ops->destroy) be->ops->destroy(be);
}
