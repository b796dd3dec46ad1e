#!/usr/bin/env python3
"""The writer and the checker of the VM power-cut rig (tests/vm/rig).

The writer runs in the guest: one thread, one directory, an endless deterministic sequence of
operations (create, write + fsync or fdatasync, O_DSYNC/O_SYNC writes, truncate, rename,
unlink) drawn from a seed. After each operation is durable by the contract it prints
`@@ACK <name> <i>@@` on the console and waits until the line has left the guest (tcdrain):
what the host saw acknowledged, the guest had acknowledged.

The checker runs after the next boot's recovery. It regenerates the sequence from the seed and
accepts the directory only if it equals the state after some prefix of at least the
acknowledged operations, where the one operation after that prefix (the one in flight at the
cut) may be seen whole, not at all, or, for writes, page by page old or new. Every byte is
self-identifying (seed, operation, page), so a failure says whose bytes were found.
"""
import hashlib
import os
import random
import sys
import termios
import threading
import time

PAGE = 4096
NAMES = ["f%02d" % i for i in range(10)]
MAX_PAGES = 16
# Operations after the last acknowledgement the host saw that may be in the directory: the
# next one (acknowledged, its line not yet out) and the one in flight after it, plus slack.
LOOKAHEAD = 3


def page_bytes(seed, op, page):
    head = b"<pmstack-vm seed=%d op=%d page=%d>" % (seed, op, page)
    fill = hashlib.sha256(head).digest()
    return (head + fill * (PAGE // len(fill) + 1))[:PAGE]


def data(seed, op, off, length):
    """`length` bytes written by operation `op` at offset `off`; page p of the file carries
    the header of (seed, op, p)."""
    out = bytearray()
    pos = off
    while pos < off + length:
        p = pos // PAGE
        blk = page_bytes(seed, op, p)
        start = pos - p * PAGE
        end = min(PAGE, off + length - p * PAGE)
        out += blk[start:end]
        pos = p * PAGE + end
    return bytes(out)


DIR = ("dir",)  # a directory in the model (files are bytes, symlinks ("symlink", target))
SUBDIRS = ["d0", "d1", "d2"]


def is_file(v):
    return isinstance(v, bytes)


def operations(seed):
    """Yields (i, op) forever; op is a dict. The model it keeps is the tree after ops 0..i-1
    (relative paths: "f03", "d1/f00"), so every op is valid when performed in order."""
    rnd = random.Random(seed)
    model = {}
    i = 0
    while True:
        dirs = [""] + [d for d in SUBDIRS if model.get(d) == DIR]
        slots = [os.path.join(d, n) for d in dirs for n in NAMES]
        free = [n for n in slots if n not in model]
        files = sorted(n for n, v in model.items() if is_file(v))
        entries = sorted(n for n, v in model.items() if v != DIR)
        choices = []
        if free:
            choices += ["create"] * (6 if len(files) < 3 else 2) + ["symlink"]
        if files:
            choices += ["write"] * 4 + ["dsync"] * 2 + ["truncate", "fallocate"]
        if entries:
            choices += ["rename"] * 2 + (["unlink"] if len(entries) > 2 else [])
        if len(dirs) <= len(SUBDIRS):
            choices += ["mkdir"]
        empty = [d for d in dirs[1:] if not any(n.startswith(d + "/") for n in model)]
        if empty:
            choices += ["rmdir"] * 2
        kind = rnd.choice(choices)
        dir_sync = rnd.random() < 0.5
        if kind == "create":
            name = rnd.choice(free)
            length = rnd.randint(1, 3 * PAGE + 100)
            op = {"kind": kind, "name": name, "data": data(seed, i, 0, length)}
        elif kind == "symlink":
            op = {"kind": kind, "name": rnd.choice(free), "target": "target-%d-%d" % (seed, i)}
        elif kind in ("write", "dsync"):
            name = rnd.choice(files)
            size = len(model[name])
            off = rnd.randrange(0, size // PAGE + 1) * PAGE
            length = rnd.choice([PAGE, 2 * PAGE, rnd.randint(1, 3 * PAGE)])
            if off + length > MAX_PAGES * PAGE:
                off = 0
            op = {"kind": kind, "name": name, "off": off, "data": data(seed, i, off, length)}
            if kind == "write":
                op["sync"] = rnd.choice(["fsync", "fdatasync"])
            else:
                op["flag"] = rnd.choice(["O_DSYNC", "O_SYNC"])
        elif kind == "truncate":
            name = rnd.choice(files)
            op = {"kind": kind, "name": name, "size": rnd.randint(0, len(model[name]) + PAGE)}
        elif kind == "fallocate":
            name = rnd.choice(files)
            off = rnd.randint(0, min(len(model[name]) + PAGE, (MAX_PAGES - 2) * PAGE))
            op = {"kind": kind, "name": name, "off": off, "len": rnd.randint(1, 2 * PAGE)}
        elif kind == "rename":
            src = rnd.choice(entries)
            dst = rnd.choice([n for n in slots if n != src])
            op = {"kind": kind, "name": src, "to": dst}
        elif kind == "unlink":
            op = {"kind": kind, "name": rnd.choice(entries)}
        elif kind == "mkdir":
            op = {"kind": kind, "name": rnd.choice([d for d in SUBDIRS if d not in dirs])}
        else:
            op = {"kind": kind, "name": rnd.choice(empty)}
        op["dir_sync"] = dir_sync
        yield i, op
        apply(model, op)
        i += 1


def apply(model, op):
    k, n = op["kind"], op["name"]
    if k == "create":
        model[n] = op["data"]
    elif k == "symlink":
        model[n] = ("symlink", op["target"])
    elif k == "mkdir":
        model[n] = DIR
    elif k in ("rmdir", "unlink"):
        del model[n]
    elif k in ("write", "dsync"):
        b = bytearray(model[n])
        off, d = op["off"], op["data"]
        if len(b) < off + len(d):
            b += bytes(off + len(d) - len(b))
        b[off : off + len(d)] = d
        model[n] = bytes(b)
    elif k == "truncate":
        b = model[n][: op["size"]]
        model[n] = b + bytes(op["size"] - len(b))
    elif k == "fallocate":
        end = op["off"] + op["len"]
        model[n] = model[n] + bytes(max(0, end - len(model[n])))
    elif k == "rename":
        model[op["to"]] = model.pop(n)


def touched(op):
    return {op["name"], op["to"]} if op["kind"] == "rename" else {op["name"]}


# ---------------------------------------------------------------- the writer


def write_all(fd, buf, off=None):
    done = 0
    while done < len(buf):
        if off is None:
            n = os.write(fd, buf[done:])
        else:
            n = os.pwrite(fd, buf[done:], off + done)
        done += n


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def perform(dirpath, op, sync):
    k, path = op["kind"], os.path.join(dirpath, op["name"])
    if k == "create":
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        write_all(fd, op["data"])
        if sync:
            os.fsync(fd)
        os.close(fd)
    elif k == "symlink":
        os.symlink(op["target"], path)
    elif k == "mkdir":
        os.mkdir(path)
    elif k == "rmdir":
        os.rmdir(path)
    elif k == "write":
        fd = os.open(path, os.O_WRONLY)
        write_all(fd, op["data"], op["off"])
        if sync:
            (os.fsync if op["sync"] == "fsync" else os.fdatasync)(fd)
        os.close(fd)
    elif k == "dsync":
        flag = getattr(os, op["flag"]) if sync else 0
        fd = os.open(path, os.O_WRONLY | flag)
        write_all(fd, op["data"], op["off"])
        os.close(fd)
    elif k in ("truncate", "fallocate"):
        fd = os.open(path, os.O_WRONLY)
        if k == "truncate":
            os.ftruncate(fd, op["size"])
        else:
            os.posix_fallocate(fd, op["off"], op["len"])
        if sync:
            os.fsync(fd)
        os.close(fd)
    elif k == "rename":
        os.rename(path, os.path.join(dirpath, op["to"]))
    elif k == "unlink":
        os.unlink(path)
    # Namespace operations are durable when they return (docs/contract.md); half of them
    # are followed by a directory fsync anyway, as portable programs do.
    if sync and op["dir_sync"] and k in ("create", "symlink", "mkdir", "rmdir", "rename", "unlink"):
        for n in touched(op):
            fsync_dir(os.path.dirname(os.path.join(dirpath, n)))


def say(console, line):
    os.write(console, ("@@%s@@\n" % line).encode())
    try:
        termios.tcdrain(console)
    except termios.error:
        pass  # not a terminal (a test writing to a file)


def writer(name, dirpath, seed, sync, seconds, console_path):
    console = os.open(console_path, os.O_WRONLY | os.O_NOCTTY | os.O_APPEND | os.O_CREAT, 0o644)
    os.mkdir(dirpath)
    parent = os.open(os.path.dirname(dirpath), os.O_RDONLY | os.O_DIRECTORY)
    if sync:
        os.fsync(parent)
    say(console, "READY %s" % name)
    deadline = time.monotonic() + seconds
    for i, op in operations(seed):
        if time.monotonic() > deadline:
            break
        perform(dirpath, op, sync)
        say(console, "ACK %s %d" % (name, i))
    say(console, "WRITER-END %s" % name)


# ---------------------------------------------------------------- the checker


def read_dir(dirpath):
    """The tree under dirpath as the model has it, and entries the model cannot hold."""
    state, odd = {}, []
    for top, dirs, files in os.walk(dirpath):
        rel = os.path.relpath(top, dirpath)
        for n in sorted(dirs + files):
            r = n if rel == "." else os.path.join(rel, n)
            p = os.path.join(top, n)
            if os.path.islink(p):
                state[r] = ("symlink", os.readlink(p))
            elif os.path.isdir(p):
                state[r] = DIR
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    state[r] = f.read()
            else:
                odd.append(r)
    return state, odd


def page_mix(actual, old, new):
    """`actual` shows an unacknowledged write (of `old` into `new`, never shorter) whole, not
    at all, or per page old or new; a page's bytes past the old end of the file may also be
    absent, reading as zeros, and the size may stop at a page boundary between the old and the
    new one. The lower file system itself leaves that after a power cut inside its write-back
    of a growing file: ext4 (unwritten extents, the default since Linux 5.6) commits the size
    of the pages it is writing back before their bytes reach the disk, and a page whose bytes
    never did reads as zeros. Never bytes nobody wrote, never old bytes lost below the old
    end."""
    if actual is None:
        return False
    n = len(actual)
    if n not in (len(old), len(new)) and not (len(old) < n < len(new) and n % PAGE == 0):
        return False
    for start in range(0, n, PAGE):
        end = min(start + PAGE, n)
        seg = actual[start:end]
        if len(old) >= end and seg == old[start:end]:
            continue
        if len(new) >= end and seg == new[start:end]:
            continue
        # Absent: the old bytes up to the old end, zeros past it.
        cut = max(start, min(end, len(old)))
        if seg[: cut - start] == old[start:cut] and seg[cut - start :].strip(b"\0") == b"" and cut < end:
            continue
        return False
    return True


def in_flight_ok(op, before, after, actual):
    k = op["kind"]
    n = op["name"]
    a = actual.get(n)
    if k == "create":
        return a is None or page_mix(a, b"", after[n])
    if k in ("write", "dsync"):
        return page_mix(a, before[n], after[n])
    if k in ("truncate", "fallocate"):
        return a in (before[n], after[n])
    if k in ("unlink", "rmdir"):
        return a in (None, before[n])
    if k in ("mkdir", "symlink"):
        return a in (None, after[n])
    if k == "rename":
        d = actual.get(op["to"])
        return (a == before[n] and d == before.get(op["to"])) or (a is None and d == before[n])
    return False


def matches(prefix_state, op, actual):
    """The directory is prefix_state with `op` (the next operation) in flight."""
    after = dict(prefix_state)
    apply(after, op)
    t = touched(op)
    for n in set(prefix_state) | set(actual):
        if n not in t and prefix_state.get(n) != actual.get(n):
            return False
    return in_flight_ok(op, prefix_state, after, actual)


def whose(b):
    """The header of the first page of b, or a description of what it holds."""
    if b == DIR:
        return "a directory"
    if isinstance(b, tuple):
        return "a symlink to %s" % b[1]
    if not b:
        return "empty"
    s = b[:80]
    if s.startswith(b"<pmstack-vm"):
        return s[: s.index(b">") + 1].decode(errors="replace")
    if s.strip(b"\0") == b"":
        return "zeros"
    return "unknown bytes %r" % s[:24]


def pages_of(b):
    """A file's length and what each of its pages holds, in short: `4718 bytes [op171 p0, zeros]`
    (the header of the write that filled the page, `zeros`, or `other` for anything else)."""
    if not is_file(b):
        return whose(b)
    out = []
    for start in range(0, len(b), PAGE):
        seg = b[start : start + PAGE]
        if seg.startswith(b"<pmstack-vm") and b">" in seg[:80]:
            head = seg[: seg.index(b">")].decode(errors="replace").split()
            kv = dict(f.split("=", 1) for f in head[1:] if "=" in f)
            out.append("op%s p%s" % (kv.get("op", "?"), kv.get("page", "?")))
        elif seg.strip(b"\0") == b"":
            out.append("zeros")
        else:
            out.append("other")
    if len(out) > 8:
        out = out[:8] + ["..."]
    return "%d bytes [%s]" % (len(b), ", ".join(out))


def check(dirpath, seed, acked):
    """Returns (ok, message)."""
    if not os.path.isdir(dirpath):
        return False, "%s is missing (it was made durable before the first operation)" % dirpath
    actual, odd = read_dir(dirpath)
    if odd:
        return False, "entries that are neither files, directories nor symlinks: %s" % odd
    model = {}
    gen = operations(seed)
    states = []
    for i, op in gen:
        if i >= acked:
            states.append((i, dict(model), op))
        if i >= acked + LOOKAHEAD:
            break
        apply(model, op)
    for j, state, op in states:
        if matches(state, op, actual):
            nbytes = sum(len(v) for v in actual.values() if is_file(v))
            return True, "prefix %d (acked %d), %d entries, %d bytes" % (j, acked, len(actual), nbytes)
    # Explain against the acknowledged state.
    _, state, _ = states[0]
    diffs = []
    for n in sorted(set(state) | set(actual)):
        want, got = state.get(n), actual.get(n)
        if want == got:
            continue
        if got is None:
            diffs.append("%s missing (want %s)" % (n, whose(want)))
        elif want is None:
            diffs.append("%s present (%s) but the acknowledged operations removed it or never made it" % (n, pages_of(got)))
        elif not (is_file(want) and is_file(got)):
            diffs.append("%s is %s, want %s" % (n, whose(got), whose(want)))
        else:
            first = next((p for p in range(0, max(len(want), len(got)), PAGE) if want[p : p + PAGE] != got[p : p + PAGE]), 0)
            # The first byte that differs, and what the page holds from there (a page whose
            # header is right can still differ later in it: a zeroed tail, another write).
            at = next((b for b in range(first, min(len(want), len(got))) if want[b] != got[b]), min(len(want), len(got)))
            diffs.append(
                "%s differs: %d bytes, want %d; page %d has %s, want %s; first difference at byte %d: %s, want %s; pages %s, want %s"
                % (n, len(got), len(want), first // PAGE, whose(got[first:]), whose(want[first:]), at, whose(got[at:at + 64]) if at < len(got) else "the end", whose(want[at:at + 64]) if at < len(want) else "the end", pages_of(got), pages_of(want))
            )
    return False, "acked %d, matches no prefix %d..%d: %s" % (acked, acked, acked + LOOKAHEAD, "; ".join(diffs[:6]))


def main(argv):
    if len(argv) >= 2 and argv[1] == "write":
        # workload.py write NAME DIR SEED SYNC(0|1) SECONDS CONSOLE
        name, d, seed, sync, secs, console = argv[2:8]
        writer(name, d, int(seed), sync == "1", float(secs), console)
        return 0
    if len(argv) >= 2 and argv[1] == "write-threads":
        # workload.py write-threads SYNC(0|1) SECONDS CONSOLE NAME DIR SEED [NAME DIR SEED ...]:
        # the writers as threads of one process, whose system calls run at once (Python lets
        # go of its lock around each): the library's and the daemon's concurrency within a
        # process, under power cuts.
        sync, secs, console = argv[2:5]
        rest = argv[5:]
        if not rest or len(rest) % 3:
            print("usage: workload.py write-threads SYNC SECONDS CONSOLE NAME DIR SEED [...]", file=sys.stderr)
            return 2
        failed = []

        def run(name, d, seed):
            try:
                writer(name, d, int(seed), sync == "1", float(secs), console)
            except BaseException as e:
                failed.append("%s: %r" % (name, e))
                raise

        ts = [threading.Thread(target=run, args=w) for w in zip(rest[0::3], rest[1::3], rest[2::3])]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if failed:
            print("writers failed: %s" % "; ".join(failed), file=sys.stderr)
            return 1
        return 0
    if len(argv) >= 2 and argv[1] == "check":
        # workload.py check DIR SEED ACKED
        ok, msg = check(argv[2], int(argv[3]), int(argv[4]))
        print(("ok " if ok else "FAIL ") + msg)
        return 0 if ok else 1
    print("usage: workload.py write NAME DIR SEED SYNC SECONDS CONSOLE | write-threads SYNC SECONDS CONSOLE NAME DIR SEED [...] | check DIR SEED ACKED", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
