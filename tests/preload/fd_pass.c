/* A descriptor passed to another attached process over a Unix socket (SCM_RIGHTS): its
 * writes through it must be covered by the sender's next fsync, as the kernel's fsync covers
 * every writer's: the receiver writes page 1, the sender fsyncs. Prints whether page 1 is still
 * dirty after that fsync (cachestat(2); then only the log can hold it), then waits for a byte
 * on standard input (the harness stops the daemon first) and exits.
 * usage: fd_pass FILE HOW, HOW one of recvmsg, recvmmsg (through the C library), syscall
 * (recvmsg through syscall(2)). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "progs.h"

/* Room for one descriptor's control message. */
union cbuf {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
};

/* A message of the one byte at `byte`, with `u` as its control buffer. */
static void one_byte_msg(struct msghdr *m, struct iovec *iov, char *byte, union cbuf *u) {
    iov->iov_base = byte;
    iov->iov_len = 1;
    memset(m, 0, sizeof *m);
    m->msg_iov = iov;
    m->msg_iovlen = 1;
    m->msg_control = u->buf;
    m->msg_controllen = sizeof u->buf;
}

static int receive_fd(int sock, const char *how) {
    char byte;
    struct iovec iov;
    union cbuf u;
    struct msghdr m;
    one_byte_msg(&m, &iov, &byte, &u);
    long r;
    if (!strcmp(how, "recvmmsg")) {
        struct mmsghdr mm;
        memset(&mm, 0, sizeof mm);
        mm.msg_hdr = m;
        r = recvmmsg(sock, &mm, 1, 0, NULL);
        m = mm.msg_hdr;
    } else if (!strcmp(how, "syscall")) {
        r = syscall(SYS_recvmsg, sock, &m, 0);
    } else {
        r = recvmsg(sock, &m, 0);
    }
    if (r < 0) die("receive");
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (!c || c->cmsg_type != SCM_RIGHTS) { fprintf(stderr, "no descriptor\n"); exit(2); }
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

static void send_fd(int sock, int fd) {
    char byte = 'f';
    struct iovec iov;
    union cbuf u;
    struct msghdr m;
    one_byte_msg(&m, &iov, &byte, &u);
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    if (sendmsg(sock, &m, 0) != 1) die("sendmsg");
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    char other[4096];
    snprintf(other, sizeof other, "%s.other", argv[1]);
    /* Attached before the fork: the child is an attached process of its own. */
    int o = open(other, O_RDWR | O_CREAT, 0644);
    if (o < 0 || write(o, "o", 1) != 1 || fsync(o)) die("other");
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) die("socketpair");
    static char buf[4096];
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        close(sv[0]);
        int fd = receive_fd(sv[1], argv[2]);
        memset(buf, 'B', sizeof buf);
        if (pwrite(fd, buf, sizeof buf, 4096) != (ssize_t)sizeof buf) die("child pwrite");
        if (write(sv[1], "w", 1) != 1) die("ack");
        char q;
        if (read(sv[1], &q, 1) < 0) die("wait");
        _exit(0);
    }
    close(sv[1]);
    int fd = open(argv[1], O_RDWR | O_CREAT, 0644);
    if (fd < 0) die("open");
    memset(buf, 'a', sizeof buf);
    for (int k = 0; k < 4; k++)
        if (pwrite(fd, buf, sizeof buf, 0) != (ssize_t)sizeof buf || fsync(fd)) die("pwrite+fsync");
    send_fd(sv[0], fd);
    char ack;
    if (read(sv[0], &ack, 1) != 1) die("read ack");
    if (fsync(fd)) die("fsync");
    report_page_one_then_wait(fd);
    if (write(sv[0], "q", 1) != 1) die("quit");
    waitpid(pid, NULL, 0);
    return 0;
}
