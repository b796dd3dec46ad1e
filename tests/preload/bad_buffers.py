"""Write calls given memory the program cannot read, through the C library (ctypes), on an
O_SYNC file and on a plain one with synced data: natively the kernel answers EFAULT (or a
short write up to the first unreadable page); under `pmstack run` the answers and the files
must be the same, and the program must not die. Run in the directory to write; prints one
line per call."""
import ctypes
import mmap
import os

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


page = mmap.PAGESIZE
# Two pages, the second unmapped: a buffer across the boundary is readable only in part.
two = libc.mmap(None, 2 * page, mmap.PROT_READ | mmap.PROT_WRITE,
                mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
ctypes.memset(two, ord("z"), page)
libc.munmap(two + page, page)
edge = two + page - 10
good = ctypes.create_string_buffer(b"y" * 10)
BAD = 8  # never mapped


def iovs(*pairs):
    return (iovec * len(pairs))(*[iovec(b, n) for b, n in pairs])


for flags, name in [(os.O_SYNC, "osync"), (0, "plain")]:
    path = "f-" + name
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | flags, 0o644)
    os.write(fd, b"x" * 100)
    os.fsync(fd)
    calls = [
        ("write", lambda: libc.write(fd, ctypes.c_void_p(BAD), 10)),
        ("write-edge", lambda: libc.write(fd, ctypes.c_void_p(edge), 20)),
        ("pwrite", lambda: libc.pwrite(fd, ctypes.c_void_p(BAD), 10, ctypes.c_long(0))),
        ("pwrite-edge", lambda: libc.pwrite(fd, ctypes.c_void_p(edge), 20, ctypes.c_long(3))),
        ("writev-array", lambda: libc.writev(fd, ctypes.c_void_p(BAD), 1)),
        ("writev-second", lambda: libc.writev(
            fd, iovs((ctypes.cast(good, ctypes.c_void_p).value, 10), (BAD, 10)), 2)),
        ("pwritev-negative", lambda: libc.pwritev(
            fd, iovs((ctypes.cast(good, ctypes.c_void_p).value, 10)), 1, ctypes.c_long(-1))),
        ("pwritev2-array", lambda: libc.pwritev2(
            fd, ctypes.c_void_p(BAD), 1, ctypes.c_long(0), 0)),
        ("pwritev2-dsync", lambda: libc.pwritev2(
            fd, iovs((BAD, 10)), 1, ctypes.c_long(0), os.RWF_DSYNC)),
    ]
    for cname, call in calls:
        ctypes.set_errno(0)
        r = call()
        print(name, cname, r, os.strerror(ctypes.get_errno()) if r < 0 else "", flush=True)
    os.fsync(fd)
    os.close(fd)
    with open(path, "rb") as f:
        data = f.read()
    print(name, "size", len(data), "bytes", sorted(set(data)), flush=True)

# Memory the library may read in place, without the kernel (the break heap, below the
# break): writes from it, logged before the kernel sees them, must put its bytes in the
# file; then a page below the break the program made unreadable (mprotect) must give
# EFAULT as natively, not kill the program. Last: the break moves under the C library's
# malloc, which copes with that.
libc.malloc.restype = ctypes.c_void_p
libc.sbrk.restype = ctypes.c_void_p
libc.sbrk.argtypes = [ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
heap = libc.malloc(64)
ctypes.memset(heap, ord("h"), 64)
fd = os.open("f-heap", os.O_CREAT | os.O_WRONLY | os.O_SYNC, 0o644)
n = 0
for i in range(40):
    ctypes.memset(heap, ord("a") + i % 26, 64)
    n += libc.write(fd, ctypes.c_void_p(heap), 64)
print("heap writes", n, flush=True)
top = libc.sbrk(0)
if libc.sbrk(3 * page) == top:
    start = (top + page - 1) // page * page
    ctypes.memset(start, ord("q"), page)
    print("heap page", libc.write(fd, ctypes.c_void_p(start), 10), flush=True)
    libc.mprotect(start, page, 0)  # PROT_NONE
    ctypes.set_errno(0)
    r = libc.write(fd, ctypes.c_void_p(start), 10)
    print("heap unreadable", r, os.strerror(ctypes.get_errno()) if r < 0 else "", flush=True)
    libc.mprotect(start, page, mmap.PROT_READ | mmap.PROT_WRITE)
else:
    print("heap page: the break did not move where asked", flush=True)
os.close(fd)
with open("f-heap", "rb") as f:
    data = f.read()
print("heap size", len(data), "bytes", sorted(set(data)), flush=True)

# A mapping the program writes from again and again (read through the kernel once, then
# from memory: the library remembers pages it read whole), then unmaps, then names again:
# EFAULT as natively; the same after taking read access away from a second one.
fd = os.open("f-mapped", os.O_CREAT | os.O_WRONLY | os.O_SYNC, 0o644)
for how in ["munmap", "mprotect"]:
    m = libc.mmap(None, page, mmap.PROT_READ | mmap.PROT_WRITE,
                  mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    n = 0
    for i in range(20):
        ctypes.memset(m, ord("A") + i, 100)
        n += libc.write(fd, ctypes.c_void_p(m), 100)
    print(how, "writes", n, flush=True)
    if how == "munmap":
        libc.munmap(m, page)
    else:
        libc.mprotect(m, page, 0)  # PROT_NONE
    ctypes.set_errno(0)
    r = libc.write(fd, ctypes.c_void_p(m), 100)
    print(how, "then", r, os.strerror(ctypes.get_errno()) if r < 0 else "", flush=True)
os.close(fd)
with open("f-mapped", "rb") as f:
    data = f.read()
print("mapped size", len(data), "bytes", sorted(set(data)), flush=True)
