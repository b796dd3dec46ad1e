/* Open and close a file this process wrote and synced, N times: prints microseconds per
 * open+close. Usage: oc DIR N (under `pmstack run --root DIR --` for pmstack). */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    char p[4096];
    if (argc < 3) { fprintf(stderr, "usage: oc DIR N\n"); return 2; }
    snprintf(p, sizeof p, "%s/ocfile", argv[1]);
    int n = atoi(argv[2]);
    int fd = open(p, O_CREAT | O_RDWR, 0644);
    if (fd < 0 || write(fd, "hello", 5) != 5 || fsync(fd)) { perror("setup"); return 1; }
    close(fd);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < n; i++) {
        int f = open(p, (i & 1) ? O_RDONLY : O_RDWR);
        if (f < 0) { perror("open"); return 1; }
        close(f);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.2f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / 1e3 / n);
    return 0;
}
