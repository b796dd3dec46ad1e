/* A program exec'd in place without the library (its environment lost LD_PRELOAD) writes
 * through a descriptor it inherited: an fsync by another process of the file must cover that
 * write. The parent makes the file's syncs absorbable (syncs expected: it synced the file's
 * directory first, so the file is watched from its birth), forks a child that opens the file
 * and execs itself without LD_PRELOAD to write page 1, then fsyncs and prints whether page 1 is
 * still dirty (cachestat(2); then only the log can hold it), waits for a byte on standard
 * input and exits.
 * usage: exec_unseen FILE HOW, HOW one of execve, execl, execvp (the C library's), syscall
 * (execve through syscall(2)); exec_unseen FILE writer FD (the exec'd program). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <libgen.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "progs.h"

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    static char buf[4096];
    if (!strcmp(argv[2], "writer")) {
        if (argc < 4 || getenv("LD_PRELOAD")) return 3;
        memset(buf, 'W', sizeof buf);
        if (pwrite(atoi(argv[3]), buf, sizeof buf, 4096) != (ssize_t)sizeof buf) die("writer");
        return 0;
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", argv[1]);
    int d = open(dirname(dir), O_RDONLY | O_DIRECTORY);
    if (d < 0 || fsync(d)) die("directory");
    close(d);
    int fd = open(argv[1], O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) die("open");
    memset(buf, 'a', sizeof buf);
    for (int k = 0; k < 4; k++)
        if (pwrite(fd, buf, sizeof buf, 0) != (ssize_t)sizeof buf || fsync(fd)) die("pwrite+fsync");
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        int g = open(argv[1], O_RDWR);
        if (g < 0) die("child open");
        char gs[16];
        snprintf(gs, sizeof gs, "%d", g);
        unsetenv("LD_PRELOAD");
        char *args[] = { argv[0], argv[1], "writer", gs, NULL };
        extern char **environ;
        if (!strcmp(argv[2], "execl")) execl(argv[0], argv[0], argv[1], "writer", gs, (char *)NULL);
        else if (!strcmp(argv[2], "execvp")) execvp(argv[0], args);
        else if (!strcmp(argv[2], "syscall")) syscall(SYS_execve, argv[0], args, environ);
        else execve(argv[0], args, environ);
        die("exec");
    }
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st)) {
        fprintf(stderr, "writer failed\n");
        return 2;
    }
    if (fsync(fd)) die("fsync");
    report_page_one_then_wait(fd);
    return 0;
}
