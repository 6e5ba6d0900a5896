/* bench_engine.c - placeholder until its issue lands; replaced by the real benchmark. */
#include <stdio.h>

#include "commands.h"

int lethe_bench_engine(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "lethe bench engine: not built yet in this version\n");
    return 2;
}
