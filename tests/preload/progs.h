// What the C programs of the preload tests share.
#ifndef PMSTACK_TEST_PROGS_H
#define PMSTACK_TEST_PROGS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
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

// Whether the page at `off` of `fd` is dirty or under write-back: not yet synced
// (cachestat(2), Linux 6.5).
static inline int page_unsynced(int fd, uint64_t off) {
    struct { uint64_t off, len; } r = { off, 4096 };
    struct { uint64_t cache, dirty, writeback, evicted, recently_evicted; } s = { 0, 0, 0, 0, 0 };
    if (syscall(451, fd, &r, &s, 0)) die("cachestat");
    return s.dirty || s.writeback;
}

// After an fsync of `fd`: print whether page 1 is still unsynced ("dirty": then only the log
// can hold it durably) or "clean", then wait for a byte on standard input (the test stops the
// daemon first). The protocol of `page_one_survives_the_fsync` in tests/preload.rs.
static inline void report_page_one_then_wait(int fd) {
    printf("%s\n", page_unsynced(fd, 4096) ? "dirty" : "clean");
    fflush(stdout);
    char go;
    if (read(0, &go, 1) < 0) die("read stdin");
}

#endif
