/* Writes through the kernel's asynchronous I/O, then fsync(2) through the C library: the
 * library cannot see such writes, so the sync must be the lower file system's own. After each
 * acknowledged fsync the written page has no dirty or under-write-back page (cachestat(2)).
 * First the file gets ordinary write+fsync rounds, which are absorbed (the harness checks
 * that they were), so a sync absorbed by mistake later leaves the page dirty.
 *
 * usage: kernel_aio HOW FILE, HOW one of
 *   io_submit   Linux AIO through syscall(2) (libaio's own way)
 *   libaio      Linux AIO through libaio's io_submit (libaio.so.1, loaded at run time)
 *   uring       io_uring through liburing
 *   uring-exec  a ring set up through liburing and kept open over an exec; the new program
 *               image writes with write(2): a process holding a ring is blind
 * Prints "absorbed-rounds done", then "synced N" per round, then "done"; "dirty ..." and exit
 * 1 on a violation. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <liburing.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "progs.h"

#define PAGE 4096
#define ROUNDS 8

static char buf[PAGE];

/* The page at `off` is clean after an acknowledged fsync, or the program fails. */
static void check_clean(int fd, off_t off, int round) {
    if (page_unsynced(fd, (uint64_t)off)) {
        printf("dirty after acknowledged fsync %d\n", round);
        fflush(stdout);
        exit(1);
    }
    printf("synced %d\n", round);
    fflush(stdout);
}

/* Ordinary writes and syncs, absorbed once the file's first sync was real. */
static void absorbed_rounds(int fd) {
    memset(buf, 'o', PAGE);
    for (int k = 0; k < 4; k++)
        if (pwrite(fd, buf, PAGE, 0) != PAGE || fsync(fd)) die("pwrite+fsync");
    printf("absorbed-rounds done\n");
    fflush(stdout);
    /* The harness answers once it has looked at the counters. */
    char c;
    if (read(0, &c, 1) != 1) die("read stdin");
}

typedef int (*setup_fn)(unsigned, aio_context_t *);
typedef int (*submit_fn)(aio_context_t, long, struct iocb **);
typedef int (*getevents_fn)(aio_context_t, long, long, struct io_event *, struct timespec *);

static void linux_aio(int fd, int through_libaio) {
    setup_fn setup = NULL;
    submit_fn submit = NULL;
    getevents_fn getevents = NULL;
    if (through_libaio) {
        if (!dlopen("libaio.so.1", RTLD_NOW | RTLD_GLOBAL)) {
            fprintf(stderr, "libaio.so.1: %s\n", dlerror());
            exit(3);
        }
        /* As a program linked with -laio finds them: the first definition in the process. */
        setup = (setup_fn)dlsym(RTLD_DEFAULT, "io_setup");
        submit = (submit_fn)dlsym(RTLD_DEFAULT, "io_submit");
        getevents = (getevents_fn)dlsym(RTLD_DEFAULT, "io_getevents");
        if (!setup || !submit || !getevents) die("dlsym libaio");
    }
    aio_context_t ctx = 0;
    int r = setup ? setup(8, &ctx) : (int)syscall(SYS_io_setup, 8, &ctx);
    if (r) { errno = r < 0 ? -r : errno; die("io_setup"); }
    for (int i = 0; i < ROUNDS; i++) {
        memset(buf, 'a' + i, PAGE);
        struct iocb cb;
        memset(&cb, 0, sizeof cb);
        cb.aio_lio_opcode = IOCB_CMD_PWRITE;
        cb.aio_fildes = fd;
        cb.aio_buf = (uint64_t)(uintptr_t)buf;
        cb.aio_nbytes = PAGE;
        cb.aio_offset = (int64_t)(i % 4) * PAGE;
        struct iocb *l[1] = { &cb };
        r = submit ? submit(ctx, 1, l) : (int)syscall(SYS_io_submit, ctx, 1, l);
        if (r != 1) { errno = r < 0 ? -r : errno; die("io_submit"); }
        struct io_event ev;
        r = getevents ? getevents(ctx, 1, 1, &ev, NULL)
                      : (int)syscall(SYS_io_getevents, ctx, 1, 1, &ev, NULL);
        if (r != 1 || ev.res != PAGE) die("io_getevents");
        if (fsync(fd)) die("fsync");
        check_clean(fd, (off_t)(i % 4) * PAGE, i);
    }
}

static void uring(int fd) {
    struct io_uring ring;
    int r = io_uring_queue_init(8, &ring, 0);
    if (r < 0) { errno = -r; die("io_uring_queue_init"); }
    for (int i = 0; i < ROUNDS; i++) {
        memset(buf, 'a' + i, PAGE);
        struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
        io_uring_prep_write(sqe, fd, buf, PAGE, (off_t)(i % 4) * PAGE);
        if (io_uring_submit(&ring) != 1) die("io_uring_submit");
        struct io_uring_cqe *cqe;
        if (io_uring_wait_cqe(&ring, &cqe) || cqe->res != PAGE) die("io_uring_wait_cqe");
        io_uring_cqe_seen(&ring, cqe);
        if (fsync(fd)) die("fsync");
        check_clean(fd, (off_t)(i % 4) * PAGE, i);
    }
}

/* The program image after the exec: it holds the ring it inherited, and writes with write(2). */
static void exec_child(int fd) {
    for (int i = 0; i < ROUNDS; i++) {
        memset(buf, 'a' + i, PAGE);
        if (pwrite(fd, buf, PAGE, (off_t)(i % 4) * PAGE) != PAGE) die("pwrite");
        if (fsync(fd)) die("fsync");
        check_clean(fd, (off_t)(i % 4) * PAGE, i);
    }
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    const char *how = argv[1];
    if (!strcmp(how, "uring-exec")) {
        /* A ring kept over the exec (ring fds are close-on-exec by default). */
        struct io_uring ring;
        int r = io_uring_queue_init(8, &ring, 0);
        if (r < 0) { errno = -r; die("io_uring_queue_init"); }
        if (fcntl(ring.ring_fd, F_SETFD, 0)) die("fcntl");
        char *args[] = { argv[0], "exec-child", argv[2], NULL };
        execv(argv[0], args);
        die("execv");
    }
    int fd = open(argv[2], O_RDWR | O_CREAT, 0644);
    if (fd < 0) die("open");
    absorbed_rounds(fd);
    if (!strcmp(how, "io_submit")) linux_aio(fd, 0);
    else if (!strcmp(how, "libaio")) linux_aio(fd, 1);
    else if (!strcmp(how, "uring")) uring(fd);
    else if (!strcmp(how, "exec-child")) exec_child(fd);
    else return 2;
    printf("done\n");
    fflush(stdout);
    return 0;
}
