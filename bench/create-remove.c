// Threads creating, writing (4 KiB) and closing files in one directory, each removing the
// file it made 100 files earlier: microseconds per file and thread (wall time / files per
// thread). The namespace-lock microbenchmark of bench/reports/2026-11-24-lock-spin/.
//
//     cc -O2 -pthread -o /tmp/create-remove bench/create-remove.c
//     /tmp/create-remove DIR FILES THREADS                       # the lower alone
//     pmstack run --root ROOT -- /tmp/create-remove ROOT/DIR FILES THREADS
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static char *dir;
static int files;
static char buf[4096];

static void name(char *p, size_t n, long t, int i) {
    snprintf(p, n, "%s/t%ld_%d", dir, t, i);
}

static void *run(void *arg) {
    long t = (long)arg;
    char p[4096];
    for (int i = 0; i < files; i++) {
        name(p, sizeof p, t, i);
        int fd = open(p, O_CREAT | O_WRONLY | O_TRUNC, 0644);
        if (fd < 0 || write(fd, buf, sizeof buf) != (ssize_t)sizeof buf || close(fd) != 0) {
            perror(p);
            exit(1);
        }
        if (i >= 100) {
            name(p, sizeof p, t, i - 100);
            if (unlink(p) != 0) {
                perror(p);
                exit(1);
            }
        }
    }
    for (int i = files > 100 ? files - 100 : 0; i < files; i++) {
        name(p, sizeof p, t, i);
        unlink(p);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: create-remove DIR FILES THREADS\n");
        return 2;
    }
    dir = argv[1];
    files = atoi(argv[2]);
    int threads = atoi(argv[3]);
    if (files <= 0 || threads <= 0 || threads > 64) {
        fprintf(stderr, "create-remove: FILES > 0 and 0 < THREADS <= 64\n");
        return 2;
    }
    pthread_t th[64];
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long t = 0; t < threads; t++) {
        pthread_create(&th[t], NULL, run, (void *)t);
    }
    for (int t = 0; t < threads; t++) {
        pthread_join(th[t], NULL);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double us = ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / 1e3;
    printf("%.2f us/file\n", us / files);
    return 0;
}
