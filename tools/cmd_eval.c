/* cmd_eval.c - placeholder until its issue lands; replaced by the real command. */
#include <stdio.h>

#include "commands.h"

int lethe_cmd_eval(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "lethe eval: not built yet in this version\n");
    return 2;
}
