// Writes through a descriptor number that another thread keeps pointing at another file
// (dup2, as a program reopening its log file does) must be logged under the file they land
// in.
//
// usage: dup2_race DIR N
// Two pairs of files in DIR: a, b opened O_DSYNC (each write logged at once) and c, d opened
// plainly (each write followed by fdatasync). A writer thread writes N records to each pair,
// record i at offset 64 * i through one number per pair; a swapper thread meanwhile makes
// those numbers copies of a and c, then of b and d, over and over. Each record lands in
// exactly one file of its pair, the other file keeping a hole there. Prints "done" and waits
// for standard input to close (the test crashes the daemon meanwhile, then checks that
// recovery put no record into the file of its pair that did not get it).
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "progs.h"

static int n;
static int file[4];   // a, b (O_DSYNC), c, d
static int num[2];    // the numbers written through: a or b, c or d
static atomic_int stop;

static void *swapper(void *arg) {
    (void)arg;
    for (int k = 0; !atomic_load(&stop); k ^= 1) {
        if (dup2(file[k], num[0]) < 0 || dup2(file[2 + k], num[1]) < 0)
            die("dup2");
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: dup2_race DIR N\n");
        return 2;
    }
    n = atoi(argv[2]);
    const char *names[4] = {"a", "b", "c", "d"};
    for (int i = 0; i < 4; i++) {
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", argv[1], names[i]);
        file[i] = open(p, O_RDWR | O_CREAT | O_TRUNC | (i < 2 ? O_DSYNC : 0), 0644);
        if (file[i] < 0)
            die("open");
    }
    // The first sync of a file new to the daemon is real: get them past it.
    for (int i = 0; i < 4; i++)
        if (fsync(file[i]) < 0)
            die("fsync");
    num[0] = dup(file[0]);
    num[1] = dup(file[2]);
    if (num[0] < 0 || num[1] < 0)
        die("dup");
    pthread_t t;
    if (pthread_create(&t, NULL, swapper, NULL))
        die("pthread_create");
    for (int i = 0; i < n; i++) {
        for (int pair = 0; pair < 2; pair++) {
            char rec[64];
            memset(rec, '.', sizeof rec);
            snprintf(rec, sizeof rec, "pair %d record %d", pair, i);
            if (pwrite(num[pair], rec, sizeof rec, 64 * (off_t)i) != sizeof rec)
                die("pwrite");
            if (pair == 1 && fdatasync(num[pair]) < 0)
                die("fdatasync");
        }
    }
    atomic_store(&stop, 1);
    pthread_join(t, NULL);
    return done_then_wait();
}
