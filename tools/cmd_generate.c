/* cmd_generate.c - placeholder until its issue lands; replaced by the real command. */
#include <stdio.h>

#include "commands.h"

int lethe_cmd_generate(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "lethe generate: not built yet in this version\n");
    return 2;
}
