/* stack_paths DIR: namespace calls whose paths lie in stack buffers, the library reads
 * those in place (preload/src/abi.rs, on_my_stack): in the main thread and in a thread whose
 * stack the program mapped itself (pthread_attr_setstack), and paths without a NUL within
 * PATH_MAX; then paths in the break heap (also read in place), in an mmap'd page, and
 * pointers the kernel answers EFAULT for. Prints one line per call: its name, its
 * result and errno; the lines must be the same natively and under `pmstack run`. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *dir;

static void say(const char *what, int r) {
    printf("%s %d %d\n", what, r, r < 0 ? errno : 0);
}

static void calls(const char *tag) {
    char p[PATH_MAX], q[PATH_MAX];
    snprintf(p, sizeof p, "%s/%s-f", dir, tag);
    snprintf(q, sizeof q, "%s/%s-g", dir, tag);
    int fd = open(p, O_CREAT | O_WRONLY | O_EXCL, 0644);
    say("create", fd < 0 ? -1 : 0);
    if (fd >= 0)
        close(fd);
    say("rename", rename(p, q));
    say("link", link(q, p));
    say("unlink", unlink(q));
    snprintf(q, sizeof q, "%s/%s-d", dir, tag);
    say("mkdir", mkdir(q, 0755));
    say("rmdir", rmdir(q));
    /* No NUL within PATH_MAX: ENAMETOOLONG, from the kernel. */
    memset(q, 'a', sizeof q);
    say("unlink-unterminated", unlink(q));
    say("mkdir-unterminated", mkdir(q, 0755));
    /* Exactly PATH_MAX - 1 bytes and a NUL: the name is too long for the file system. */
    snprintf(q, sizeof q, "%s/", dir);
    memset(q + strlen(q), 'b', sizeof q - strlen(q) - 1);
    q[sizeof q - 1] = 0;
    say("unlink-long", unlink(q));
}

static void *in_own_stack(void *arg) {
    (void)arg;
    calls("thread");
    return NULL;
}

/* Paths elsewhere: in the break heap (read in place too), in an mmap'd page (copied, then
 * read in place once the library read its page whole, until it is unmapped), and pointers
 * the kernel answers EFAULT for. */
static void elsewhere(void) {
    char *h = malloc(256);
    snprintf(h, 256, "%s/heap-f", dir);
    int fd = open(h, O_CREAT | O_WRONLY | O_EXCL, 0644);
    say("create-heap", fd < 0 ? -1 : 0);
    if (fd >= 0)
        close(fd);
    say("unlink-heap", unlink(h));
    free(h);
    say("unlink-bad", unlink((const char *)8));
    long page = sysconf(_SC_PAGESIZE);
    char *two = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    munmap(two + page, page);
    memset(two, 'c', page);
    say("unlink-unterminated-at-unmapped", unlink(two + page - 10));
    snprintf(two, page, "%s/mapped-f", dir);
    fd = open(two, O_CREAT | O_WRONLY | O_EXCL, 0644);
    say("create-mapped", fd < 0 ? -1 : 0);
    if (fd >= 0)
        close(fd);
    say("unlink-mapped", unlink(two));
    /* Again: the library remembers the page it read whole, and reads it in place now. */
    fd = open(two, O_CREAT | O_WRONLY | O_EXCL, 0644);
    say("create-mapped-again", fd < 0 ? -1 : 0);
    if (fd >= 0)
        close(fd);
    say("unlink-mapped-again", unlink(two));
    munmap(two, page);
    /* Unmapped since: EFAULT, as natively (the library forgot the page at the munmap). */
    say("unlink-mapped-unmapped", unlink(two));
}

int main(int argc, char **argv) {
    if (argc != 2)
        return 2;
    dir = argv[1];
    calls("main");
    elsewhere();
    size_t size = 256 << 10;
    char *stack = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (stack == MAP_FAILED)
        return 3;
    /* A thread on a stack the program mapped itself (pthread_attr_setstack). */
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setstack(&a, stack, size);
    pthread_t t;
    if (pthread_create(&t, &a, in_own_stack, NULL))
        return 4;
    pthread_join(t, NULL);
    /* Then wait for standard input to close: the test reads this process's counters. */
    printf("end\n");
    fflush(stdout);
    char c;
    while (read(0, &c, 1) > 0)
        ;
    return 0;
}
