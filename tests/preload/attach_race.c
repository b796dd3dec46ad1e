// A descriptor closed while another thread attaches must not keep the attach's entry.
//
// usage: attach_race ROOT OTHER N
// ROOT holds r0 .. r{N-1} (made by the test). They are opened through the C library's own
// `open` (looked up in libc itself: the library does not see these calls). Then the main thread attaches (a creation under ROOT) while a
// second thread closes each of those descriptors and opens a file in OTHER (outside the
// root) in its place, under the same number. After the attach, each of the new descriptors
// is written: nothing under ROOT is written by this program, so the library must log
// nothing (a crash then replays nothing into ROOT's files).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "progs.h"

static int n;
static int *fds;
static char *other;
static atomic_int go;

static void *swapper(void *arg) {
    (void)arg;
    while (!atomic_load(&go)) {
    }
    usleep(500);
    for (int i = 0; i < n; i++) {
        char p[4096];
        snprintf(p, sizeof p, "%s/o%d", other, i);
        close(fds[i]);
        int fd = open(p, O_CREAT | O_WRONLY | O_TRUNC, 0644);
        if (fd < 0) {
            perror("open other");
            exit(1);
        }
        fds[i] = fd;
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: attach_race ROOT OTHER N\n");
        return 2;
    }
    char *root = argv[1];
    other = argv[2];
    n = atoi(argv[3]);
    fds = calloc(n, sizeof *fds);
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    int (*libc_open)(const char *, int, ...) = libc ? dlsym(libc, "open") : NULL;
    if (!libc_open) {
        fprintf(stderr, "cannot find the C library's open\n");
        return 1;
    }
    for (int i = 0; i < n; i++) {
        char p[4096];
        snprintf(p, sizeof p, "%s/r%d", root, i);
        fds[i] = libc_open(p, O_RDWR);
        if (fds[i] < 0) {
            perror("open root file");
            return 1;
        }
    }
    pthread_t t;
    pthread_create(&t, NULL, swapper, NULL);
    atomic_store(&go, 1);
    char p[4096];
    snprintf(p, sizeof p, "%s/trigger", root);
    int fd = open(p, O_CREAT | O_WRONLY | O_TRUNC, 0644);
    if (fd < 0) {
        perror("open trigger");
        return 1;
    }
    close(fd);
    pthread_join(t, NULL);
    // Long enough for the daemon to vet what the attach marked: a write it then logged
    // would be logged first.
    usleep(300 * 1000);
    for (int i = 0; i < n; i++) {
        const char msg[] = "OTHER-BYTES";
        if (pwrite(fds[i], msg, sizeof msg - 1, 0) != (ssize_t)(sizeof msg - 1)) {
            perror("write other");
            return 1;
        }
    }
    return done_then_wait();
}
