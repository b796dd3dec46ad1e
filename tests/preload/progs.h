// What the C programs of the preload tests share.
#ifndef PMSTACK_TEST_PROGS_H
#define PMSTACK_TEST_PROGS_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

// perror, then exit 1.
static inline void die(const char *what) {
    perror(what);
    exit(1);
}

// Print "done", then stay alive (attached, its records live) until standard input closes:
// the test crashes the daemon meanwhile.
static inline int done_then_wait(void) {
    printf("done\n");
    fflush(stdout);
    char c;
    while (read(0, &c, 1) > 0) {
    }
    return 0;
}

#endif
