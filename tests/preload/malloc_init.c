/* malloc_init: a program with an allocator of its own that, like jemalloc's first call
 * (pages_boot), makes system calls by number (open, openat, read, close of files in /proc)
 * while it holds its initialization lock, a plain mutex. Anything the library does inside
 * those calls that allocates comes back into this allocator and waits for that lock for
 * ever (rustc, which links jemalloc, hung at start under `pmstack run`). Prints "ok". */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int ready;
static char arena[256 << 20] __attribute__((aligned(64)));
static atomic_size_t used;

static void boot(void) {
    pthread_mutex_lock(&init_lock);
    if (!atomic_load(&ready)) {
        char buf[256];
        long fd = syscall(SYS_open, "/proc/self/stat", O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            syscall(SYS_read, fd, buf, sizeof buf);
            syscall(SYS_close, fd);
        }
        fd = syscall(SYS_openat, AT_FDCWD, "/proc/self/statm", O_RDONLY | O_CLOEXEC);
        if (fd >= 0)
            syscall(SYS_close, fd);
        atomic_store(&ready, 1);
    }
    pthread_mutex_unlock(&init_lock);
}

/* A bump allocator: each block's size in the 8 bytes before it; nothing is reused. */
static void *take(size_t n, size_t align) {
    if (!atomic_load(&ready))
        boot();
    if (align < 16)
        align = 16;
    size_t start = atomic_load(&used), off;
    do {
        off = (start + 16 + align - 1) & ~(align - 1);
    } while (!atomic_compare_exchange_weak(&used, &start, off + n));
    if (off + n > sizeof arena)
        return NULL;
    ((size_t *)(arena + off))[-1] = n;
    return arena + off;
}

void *malloc(size_t n) { return take(n, 16); }
void free(void *p) { (void)p; }
void *calloc(size_t a, size_t b) {
    void *p = take(a * b, 16);
    if (p)
        memset(p, 0, a * b);
    return p;
}
void *realloc(void *p, size_t n) {
    void *q = take(n, 16);
    if (p && q) {
        size_t old = ((size_t *)p)[-1];
        memcpy(q, p, old < n ? old : n);
    }
    return q;
}
int posix_memalign(void **r, size_t a, size_t n) {
    *r = take(n, a);
    return *r ? 0 : 12;
}
void *aligned_alloc(size_t a, size_t n) { return take(n, a); }
void *memalign(size_t a, size_t n) { return take(n, a); }
size_t malloc_usable_size(void *p) { return p ? ((size_t *)p)[-1] : 0; }

int main(void) {
    char *p = malloc(64);
    if (!p)
        return 1;
    strcpy(p, "ok");
    puts(p);
    return 0;
}
