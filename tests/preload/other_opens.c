/* A second descriptor of a file, got by a call other than open(2)/openat(2): writes through
 * it must be covered by an fsync through the first, as the kernel's fsync covers them. Writes
 * page 1 through the second descriptor, fsyncs the first, prints whether page 1 is still dirty
 * (cachestat(2); then only the log can hold it), waits for a byte on standard input and exits.
 * usage: other_opens FILE HOW, HOW one of by_handle (open_by_handle_at(3)), by_handle_syscall
 * (through syscall(2)), openat2 (through syscall(2)), pidfd_getfd (a child's descriptor). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "progs.h"

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    const char *how = argv[2];
    int fd = open(argv[1], O_RDWR | O_CREAT, 0644);
    if (fd < 0) die("open");
    static char buf[4096];
    memset(buf, 'a', sizeof buf);
    for (int k = 0; k < 4; k++)
        if (pwrite(fd, buf, sizeof buf, 0) != (ssize_t)sizeof buf || fsync(fd)) die("pwrite+fsync");
    int g;
    if (!strcmp(how, "pidfd_getfd")) {
        /* A child opens the file and keeps it open; the parent takes its descriptor. */
        int p[2], q[2];
        if (pipe(p) || pipe(q)) die("pipe");
        pid_t child = fork();
        if (child < 0) die("fork");
        if (child == 0) {
            int c = open(argv[1], O_RDWR);
            if (c < 0 || write(p[1], &c, sizeof c) != sizeof c) die("child");
            char x;
            if (read(q[0], &x, 1) < 0) die("child wait");
            _exit(0);
        }
        int cfd;
        if (read(p[0], &cfd, sizeof cfd) != sizeof cfd) die("read child fd");
        int pidfd = (int)syscall(SYS_pidfd_open, child, 0);
        if (pidfd < 0) die("pidfd_open");
        g = pidfd_getfd(pidfd, cfd, 0);
        if (write(q[1], "x", 1) != 1) die("release child");
    } else if (!strcmp(how, "openat2")) {
        struct open_how oh;
        memset(&oh, 0, sizeof oh);
        oh.flags = O_RDWR;
        g = (int)syscall(SYS_openat2, AT_FDCWD, argv[1], &oh, sizeof oh);
    } else {
        struct file_handle *h = malloc(sizeof *h + MAX_HANDLE_SZ);
        h->handle_bytes = MAX_HANDLE_SZ;
        int mount_id;
        if (name_to_handle_at(AT_FDCWD, argv[1], h, &mount_id, 0)) die("name_to_handle_at");
        /* Any descriptor on the file system will do as the mount's. */
        if (!strcmp(how, "by_handle_syscall"))
            g = (int)syscall(SYS_open_by_handle_at, fd, h, O_RDWR);
        else
            g = open_by_handle_at(fd, h, O_RDWR);
    }
    if (g < 0) die(how);
    memset(buf, 'H', sizeof buf);
    if (pwrite(g, buf, sizeof buf, 4096) != (ssize_t)sizeof buf) die("pwrite");
    if (fsync(fd)) die("fsync");
    report_page_one_then_wait(fd);
    return 0;
}
