/* cmd_bench.c - placeholder until its issue lands; replaced by the real command. */
#include <stdio.h>

#include "commands.h"

int lethe_cmd_bench(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "lethe bench: not built yet in this version\n");
    return 2;
}
