"""Workload for tests/preload.rs, run under `pmstack run`: threads appending records to their
own files with fdatasync (or through O_SYNC descriptors), and one thread overwriting a file
that existed before, in place. Prints "ready" after the first (real) sync of every file, waits
for a line on stdin, then prints "ack TAG T I" after each acknowledged record and
"ov TAG I" after each acknowledged overwrite. An optional fifth argument paces the records
(seconds of sleep after each)."""
import os
import sys
import threading
import time

d, tag, nthreads, maxrec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pace = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
REC = 8192
out_lock = threading.Lock()


def say(s):
    with out_lock:
        os.write(1, (s + "\n").encode())


def base(t):
    return bytes(((t * 131 + k * 7) % 251) + 1 for k in range(8192 + 256))


def rec_len(t, i):
    return 1 + (t * 7919 + i * 104729) % 6000


# Syncs are expected of a process that synced under the root: its directory's sync first, so
# that the files it opens are watched from the open (`Client::sync_expected`), as a
# database's files are once it synced.
dfd = os.open(d, os.O_RDONLY)
os.fsync(dfd)
os.close(dfd)
files = []
for t in range(nthreads):
    fl = os.O_RDWR | os.O_CREAT
    if t == 2:
        fl |= os.O_SYNC
    files.append(os.open(os.path.join(d, f"f-{tag}-{t}"), fl, 0o644))
ov = os.open(os.path.join(d, f"pre-{tag}"), os.O_RDWR)
# The daemon vets each newly tracked file (looks for writers outside `pmstack run` that
# opened it earlier); the first sync after that is real and the later ones are absorbed.
# PMSTACK_TEST_VETTED: how many marks (files tracked) the daemon must have vetted first (its stats file is
# PMSTACK_TEST_STATS).
want = int(os.environ.get("PMSTACK_TEST_VETTED", "0"))
while want:
    try:
        import json
        with open(os.environ["PMSTACK_TEST_STATS"]) as f:
            if json.load(f).get("marks_vetted", 0) >= want:
                break
    except (OSError, ValueError):
        pass
    time.sleep(0.05)
for fd in files + [ov]:
    os.fsync(fd)


def own_real_syncs():
    """This process's real syncs as the daemon's stats give them once rewritten twice (every
    500 ms) after now; None if it does not list this process."""
    path = os.environ["PMSTACK_TEST_STATS"]
    t0, seen, m0 = time.time(), 0, os.stat(path).st_mtime_ns
    while seen < 2:
        if time.time() - t0 > 60:
            sys.exit("the daemon's stats were not rewritten in 60 s")
        time.sleep(0.02)
        m = os.stat(path).st_mtime_ns
        if m != m0:
            seen, m0 = seen + 1, m
    import json
    for _ in range(100):
        try:
            with open(path) as f:
                v = json.load(f)
            break
        except ValueError:
            time.sleep(0.01)
    else:
        sys.exit("the daemon's stats never read whole")
    for p in v.get("attached", []):
        if p.get("pid") == os.getpid():
            return p.get("real_syncs", 0)
    return None


# The crash round needs every sync after "ready" absorbed: ready once a whole round of syncs
# was absorbed, as the process's own count of real syncs says. (Once in CI, and twice here
# beside another test, a program's syncs were real after "ready": the test's snapshot read
# its files while another thread of the test process was in a write open, and the daemon
# took the read for a write, the file for foreign. Events name the opening thread since
# 2026-12-03: `watch::OpenEvent::is_write`.)
if want:
    prev = own_real_syncs()
    for _ in range(60):
        for fd in files + [ov]:
            os.fsync(fd)
        now = own_real_syncs()
        if now is not None and now == prev:
            break
        prev = now
    else:
        sys.exit(f"syncs still real after 60 rounds: {prev}")
say("ready")
sys.stdin.readline()


def run(t):
    b = base(t)
    fd = files[t]
    for i in range(maxrec):
        n = rec_len(t, i)
        os.pwrite(fd, b[i % 256 : i % 256 + n], i * REC)
        if t != 2:
            os.fdatasync(fd)
        say(f"ack {tag} {t} {i}")
        if pace:
            time.sleep(pace)
        if t == 0 and i % 3 == 0:
            ob = base(7)
            os.pwrite(ov, ob[i % 256 : i % 256 + 5000], (i % 4) * 3000)
            os.fsync(ov)
            say(f"ov {tag} {i}")


ts = [threading.Thread(target=run, args=(t,)) for t in range(nthreads)]
for x in ts:
    x.start()
for x in ts:
    x.join()
say("done")
