/* A reflink clone into a file whose syncs are absorbed, then fsync(2): the kernel gave the file
 * another file's blocks, which the library did not see, so that sync must be the lower's own.
 * usage: clone_sync SRC DST HOW, HOW one of ficlone, ficlonerange (through ioctl(3)), syscall
 * (ioctl through syscall(2)). Prints "ready" after ordinary write+fsync rounds of DST and waits
 * for a byte on standard input; then clones SRC into DST, fsyncs it, prints "cloned" and waits
 * again (the harness reads the process's counters at each stop). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/fs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "progs.h"

/* Wait for one byte on standard input (or its end). */
static void wait_line(void) {
    char c;
    if (read(0, &c, 1) < 0) die("read stdin");
}

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    int src = open(argv[1], O_RDONLY);
    int dst = open(argv[2], O_RDWR | O_CREAT, 0644);
    if (src < 0 || dst < 0) die("open");
    char buf[4096];
    memset(buf, 'o', sizeof buf);
    for (int k = 0; k < 4; k++)
        if (pwrite(dst, buf, sizeof buf, 0) != (ssize_t)sizeof buf || fsync(dst)) die("pwrite+fsync");
    printf("ready\n");
    fflush(stdout);
    wait_line();
    int r;
    if (!strcmp(argv[3], "ficlone")) {
        r = ioctl(dst, FICLONE, src);
    } else if (!strcmp(argv[3], "ficlonerange")) {
        struct file_clone_range fcr = { .src_fd = src, .src_offset = 0, .src_length = 0, .dest_offset = 0 };
        r = ioctl(dst, FICLONERANGE, &fcr);
    } else if (!strcmp(argv[3], "syscall")) {
        r = (int)syscall(SYS_ioctl, dst, FICLONE, src);
    } else {
        return 2;
    }
    if (r) die("clone");
    if (fsync(dst)) die("fsync");
    printf("cloned\n");
    fflush(stdout);
    wait_line();
    return 0;
}
