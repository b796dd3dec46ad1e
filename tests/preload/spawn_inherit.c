// Children that do not attach write through a descriptor they inherit: the parent's next
// sync of the file must be real (it covers their bytes), never absorbed.
//
// usage: spawn_inherit FILE
// FILE is opened for appending, inheritable (no O_CLOEXEC). Prints "pid N", then reads
// commands from standard input, one per line, and answers each with "ok" once done:
//   sync    append a line and fsync
//   fork    fork; the child execs `sh -c 'printf ... >&3'` without LD_PRELOAD (execl)
//   spawn   the same by posix_spawnp
//   system  the same by system()
//   popen   the same by popen()
//   vfork   the same by vfork and execve
//   vfork-close  vfork; before its exec the child appends its line itself, then closes the
//           inherited descriptor and every other from 3 up (close, close_range), then execs
//           /bin/true: none of that may change what the parent's library keeps (the child
//           borrows the parent's memory)
// Each child appends "FOREIGN <command>\n" through the inherited descriptor.
#define _GNU_SOURCE
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "progs.h"

extern char **environ;

// The environment without LD_PRELOAD: the child does not attach.
static char **bare_env(void) {
    static char *env[256];
    int n = 0;
    for (char **e = environ; *e && n < 255; e++)
        if (strncmp(*e, "LD_PRELOAD=", 11) != 0)
            env[n++] = *e;
    env[n] = NULL;
    return env;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: spawn_inherit FILE\n");
        return 2;
    }
    int fd = open(argv[1], O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0)
        die("open");
    printf("pid %d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    int n = 0;
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        char cmd[128];
        snprintf(cmd, sizeof cmd, "printf 'FOREIGN %s\\n' >&%d", line, fd);
        char *args[] = {"sh", "-c", cmd, NULL};
        if (strcmp(line, "sync") == 0) {
            char rec[32];
            int len = snprintf(rec, sizeof rec, "attached %d\n", n++);
            if (write(fd, rec, len) != len || fsync(fd) < 0)
                die("write, fsync");
        } else if (strcmp(line, "fork") == 0) {
            pid_t p = fork();
            if (p < 0)
                die("fork");
            if (p == 0) {
                unsetenv("LD_PRELOAD");
                execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
                _exit(127);
            }
            waitpid(p, NULL, 0);
        } else if (strcmp(line, "spawn") == 0) {
            pid_t p;
            if (posix_spawnp(&p, "sh", NULL, NULL, args, bare_env()) != 0)
                die("posix_spawnp");
            waitpid(p, NULL, 0);
        } else if (strcmp(line, "system") == 0 || strcmp(line, "popen") == 0) {
            char c2[256];
            snprintf(c2, sizeof c2, "env -u LD_PRELOAD sh -c \"%s\"", cmd);
            if (line[0] == 's') {
                if (system(c2) != 0)
                    die("system");
            } else {
                FILE *f = popen(c2, "r");
                if (!f || pclose(f) != 0)
                    die("popen");
            }
        } else if (strcmp(line, "vfork") == 0) {
            char **env = bare_env();
            pid_t p = vfork();
            if (p < 0)
                die("vfork");
            if (p == 0) {
                execve("/bin/sh", args, env);
                _exit(127);
            }
            waitpid(p, NULL, 0);
        } else if (strcmp(line, "vfork-close") == 0) {
            char **env = bare_env();
            char *targs[] = {"true", NULL};
            pid_t p = vfork();
            if (p < 0)
                die("vfork");
            if (p == 0) {
                static const char w[] = "FOREIGN vfork-close\n";
                if (write(fd, w, sizeof w - 1) != (ssize_t)(sizeof w - 1))
                    _exit(126);
                close(fd);
                syscall(SYS_close_range, 3, ~0U, 0);
                execve("/bin/true", targs, env);
                _exit(127);
            }
            int st;
            if (waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
                die("vfork-close child");
        } else {
            fprintf(stderr, "unknown command %s\n", line);
            return 2;
        }
        printf("ok\n");
        fflush(stdout);
    }
    return 0;
}
