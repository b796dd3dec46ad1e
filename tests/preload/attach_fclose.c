// An attach must not wait forever for a closing call that waits for the attaching thread.
//
// usage: attach_fclose ROOT
// A second thread fcloses a stream on a pipe whose buffer holds more than the pipe takes:
// the close blocks until the main thread drains the pipe. Meanwhile the main thread makes
// its first call under ROOT, which attaches the process; then it drains the pipe. Prints
// "done" when both threads finished.
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int pfd[2];
static volatile int flushing;

static void *writer(void *arg) {
    (void)arg;
    FILE *f = fdopen(pfd[1], "w");
    if (!f) {
        perror("fdopen");
        exit(1);
    }
    static char buf[1 << 20];
    setvbuf(f, buf, _IOFBF, sizeof buf);
    static char data[1 << 19];
    memset(data, 'p', sizeof data);
    fwrite(data, 1, sizeof data, f); // buffered: more than a pipe holds
    flushing = 1;
    fclose(f); // blocks until the main thread reads
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: attach_fclose ROOT\n");
        return 2;
    }
    if (pipe(pfd) != 0) {
        perror("pipe");
        return 1;
    }
    pthread_t t;
    pthread_create(&t, NULL, writer, NULL);
    while (!flushing) {
        usleep(1000);
    }
    usleep(50 * 1000); // the writer is inside fclose, blocked on the full pipe
    char p[4096];
    snprintf(p, sizeof p, "%s/first", argv[1]);
    int fd = open(p, O_CREAT | O_WRONLY | O_TRUNC, 0644);
    if (fd < 0) {
        perror("open under the root");
        return 1;
    }
    close(fd);
    static char sink[1 << 16];
    size_t got = 0;
    ssize_t n;
    while ((n = read(pfd[0], sink, sizeof sink)) > 0) {
        got += n;
    }
    pthread_join(t, NULL);
    // Attached by now (or at this call): a creation under the root.
    snprintf(p, sizeof p, "%s/second", argv[1]);
    fd = open(p, O_CREAT | O_WRONLY | O_TRUNC, 0644);
    if (fd < 0) {
        perror("open under the root");
        return 1;
    }
    close(fd);
    printf("done %zu\n", got);
    return 0;
}
