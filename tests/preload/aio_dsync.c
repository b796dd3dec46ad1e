/* O_DSYNC writes through POSIX AIO (glibc writes them from its own threads, through calls
 * the preload library does not interpose). Each acknowledged write must be durable: after
 * its completion the written range has no dirty or under-write-back page (cachestat(2)).
 * Page 0 first gets an absorbed write+fsync (a live log entry); the AIO writes then
 * overwrite it, and replay after a crash must not roll them back.
 * usage: aio_dsync FILE [exit]; prints "acked N" after each completion, then "done", then waits
 * (for a kill) unless a second argument is given. */
#define _GNU_SOURCE
#include <aio.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

struct cs_range { uint64_t off, len; };
struct cs { uint64_t cache, dirty, writeback, evicted, recently_evicted; };

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    int fd = open(argv[1], O_RDWR | O_CREAT | O_DSYNC, 0644);
    if (fd < 0) { perror("open"); return 2; }
    static char buf[4096];
    memset(buf, 'o', sizeof buf);
    for (int k = 0; k < 2; k++) {
        if (pwrite(fd, buf, sizeof buf, 0) != sizeof buf || fsync(fd)) { perror("pwrite"); return 2; }
    }
    for (int i = 0; i < 16; i++) {
        memset(buf, 'a' + i, sizeof buf);
        struct aiocb cb;
        memset(&cb, 0, sizeof cb);
        cb.aio_fildes = fd;
        cb.aio_buf = buf;
        cb.aio_nbytes = sizeof buf;
        cb.aio_offset = (off_t)(i % 4) * 4096;
        if (aio_write(&cb)) { perror("aio_write"); return 2; }
        const struct aiocb *l[1] = { &cb };
        while (aio_error(&cb) == EINPROGRESS) aio_suspend(l, 1, NULL);
        if (aio_return(&cb) != (ssize_t)sizeof buf) { fprintf(stderr, "aio failed\n"); return 2; }
        struct cs_range r = { (uint64_t)(i % 4) * 4096, 4096 };
        struct cs s;
        memset(&s, 0, sizeof s);
        if (syscall(451, fd, &r, &s, 0)) { perror("cachestat"); return 2; }
        if (s.dirty || s.writeback) {
            printf("dirty after acknowledged write %d\n", i);
            fflush(stdout);
            return 1;
        }
        printf("acked %d\n", i);
        fflush(stdout);
    }
    printf("done\n");
    fflush(stdout);
    if (argc < 3) pause();
    return 0;
}
