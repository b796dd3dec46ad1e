// A descriptor the library opened for itself, closed by the program (a close of a number
// it does not own) and reused for another file, must not be read nor closed
// by the library as its own.
//
// usage: rfd_closed DIR
// DIR/f is written through a write-only descriptor, more than the library keeps a copy of,
// and synced: the library reads the bytes back through a descriptor of its own. The program
// makes that number a descriptor of DIR/g (dup2), writes f again (other bytes) and
// syncs it, then closes f and writes g through its descriptor. Prints "done" (or what went
// wrong) and waits for standard input to close: the test crashes the daemon meanwhile and
// checks f and g after recovery.
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "progs.h"

#define SIZE (256 * 1024)

static void fill(int fd, char c) {
    static char buf[SIZE];
    memset(buf, c, sizeof buf);
    if (pwrite(fd, buf, sizeof buf, 0) != sizeof buf)
        die("pwrite");
}

// A descriptor other than `mine` open on `path`, or -1.
static int other_on(const char *path, int mine) {
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        die("opendir");
    int found = -1;
    struct dirent *e;
    while ((e = readdir(d))) {
        char p[300], t[4096];
        int fd = atoi(e->d_name);
        if (e->d_name[0] == '.' || fd == mine || fd == dirfd(d))
            continue;
        snprintf(p, sizeof p, "/proc/self/fd/%s", e->d_name);
        ssize_t n = readlink(p, t, sizeof t - 1);
        if (n < 0)
            continue;
        t[n] = 0;
        if (strcmp(t, path) == 0)
            found = fd;
    }
    closedir(d);
    return found;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: rfd_closed DIR\n");
        return 2;
    }
    char f_path[4096], g_path[4096];
    snprintf(f_path, sizeof f_path, "%s/f", argv[1]);
    snprintf(g_path, sizeof g_path, "%s/g", argv[1]);
    int f = open(f_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (f < 0)
        die("open f");
    // The first syncs are real (the daemon looks for other writers first); then one is
    // absorbed and reads the bytes back.
    int theirs = -1;
    for (int i = 0; i < 500 && theirs < 0; i++) {
        fill(f, 'B');
        if (fsync(f) < 0)
            die("fsync");
        theirs = other_on(f_path, f);
        if (theirs < 0)
            usleep(10000);
    }
    if (theirs < 0) {
        printf("no descriptor of the library's own on f\n");
        return 1;
    }
    // Another file under that number, as a shell's `exec 7<>g` puts it there (a program
    // choosing a number it does not own).
    int opened = open(g_path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (opened < 0 || dup2(opened, theirs) != theirs)
        die("open g");
    close(opened);
    int g = theirs;
    fill(g, 'G');
    // A real sync (after a change the log does not hold: a chmod) expires f's entries, so
    // the next write is not logged at once but read back at the next sync.
    if (fchmod(f, 0644) < 0 || fsync(f) < 0)
        die("fchmod, fsync");
    fill(f, 'C');
    if (fsync(f) < 0)
        die("fsync");
    if (close(f) < 0)
        die("close f");
    if (pwrite(g, "g", 1, 0) != 1) {
        printf("g's descriptor was closed behind the program's back: %s\n", strerror(errno));
        return 1;
    }
    return done_then_wait();
}
