"""Namespace workload for tests/preload.rs, run under `pmstack run`: creates, atomic replaces
(write a temporary file, fsync, rename over the target), unlinks, renames and mkdirs, each
acknowledged after the fsync of the file and of its directories.

Arguments: DIR SEED TAG. Several may run at once on one DIR: each works on names carrying its
TAG (in directories they share, and in its own). It primes the directories (so they are
watched and clean), prints "ready", waits for a line on stdin, then runs operations until it
is killed. Before each
operation it prints "begin SEQ NAME..." (the names the operation may change); after its
durability point "ack SEQ NAME=STATE ..." where STATE is a content id ("SEQ" of the write, or
"old:NAME" for a file that existed at the start), "dir", or "-" (absent). The names
"shared0".."shared2" are replaced by every process; their acks name only the temporary."""
import os
import random
import sys

d, seed, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = random.Random(seed)


def say(s):
    os.write(1, (s + "\n").encode())


def content(cid):
    return (f"{cid}:".encode() * (2 + cid % 1500))[: 1 + (cid * 37) % 9000]


def p(name):
    return os.path.join(d, name) if name else d


dirs = {"": os.open(d, os.O_RDONLY | os.O_DIRECTORY)}
state = {}
for n in sorted(os.listdir(d)):
    if os.path.isfile(p(n)) and n.startswith(f"old{tag}-"):
        state[n] = f"old:{n}"

# Priming: the first logged change of a directory writes everything back once; afterwards
# every change is logged and the directories are clean.
sub = f"sub{tag}"
fd = os.open(p(f"prime{tag}"), os.O_CREAT | os.O_WRONLY, 0o644)
os.close(fd)
os.unlink(p(f"prime{tag}"))
os.mkdir(p(sub))
os.fsync(dirs[""])
dirs[sub] = os.open(p(sub), os.O_RDONLY | os.O_DIRECTORY)
fd = os.open(p(f"{sub}/prime"), os.O_CREAT | os.O_WRONLY, 0o644)
os.close(fd)
os.unlink(p(f"{sub}/prime"))
os.fsync(dirs[sub])
say("ready")
sys.stdin.readline()


def dir_of(name):
    return name.rsplit("/", 1)[0] if "/" in name else ""


def write_new(name, cid):
    fd = os.open(p(name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.write(fd, content(cid))
    os.fsync(fd)
    os.close(fd)


seq = 0
while True:
    seq += 1
    files = sorted(state)
    op = rng.choice(["create", "create", "replace", "replace", "unlink", "rename", "mkdir", "shared"])
    if op in ("replace", "unlink", "rename") and not files:
        op = "create"
    if op == "mkdir" and len(dirs) >= 6:
        op = "create"
    if op == "create":
        dn = rng.choice(sorted(dirs))
        name = f"{dn}/n{tag}-{seq}" if dn else f"n{tag}-{seq}"
        say(f"begin {seq} {name}")
        write_new(name, seq)
        os.fsync(dirs[dn])
        state[name] = str(seq)
        say(f"ack {seq} {name}={seq}")
    elif op == "replace":
        target = rng.choice(files)
        dn = dir_of(target)
        tmp = f"{dn}/t{tag}-{seq}" if dn else f"t{tag}-{seq}"
        say(f"begin {seq} {tmp} {target}")
        write_new(tmp, seq)
        os.rename(p(tmp), p(target))
        os.fsync(dirs[dn])
        state[target] = str(seq)
        say(f"ack {seq} {tmp}=- {target}={seq}")
    elif op == "unlink":
        target = rng.choice(files)
        say(f"begin {seq} {target}")
        os.unlink(p(target))
        os.fsync(dirs[dir_of(target)])
        del state[target]
        say(f"ack {seq} {target}=-")
    elif op == "rename":
        src = rng.choice(files)
        dn = rng.choice(sorted(dirs))
        dst = f"{dn}/m{tag}-{seq}" if dn else f"m{tag}-{seq}"
        say(f"begin {seq} {src} {dst}")
        os.rename(p(src), p(dst))
        os.fsync(dirs[dir_of(src)])
        os.fsync(dirs[dn])
        state[dst] = state.pop(src)
        say(f"ack {seq} {src}=- {dst}={state[dst]}")
    elif op == "shared":
        # Every process replaces the same few names, unsynchronized: which replace wins is
        # the order the lower applied them in, and recovery must agree.
        target = f"shared{rng.randrange(3)}"
        tmp = f"t{tag}-{seq}"
        say(f"begin {seq} {tmp} {target}")
        write_new(tmp, seq)
        os.rename(p(tmp), p(target))
        os.fsync(dirs[""])
        say(f"ack {seq} {tmp}=-")
    else:
        name = f"d{tag}-{seq}"
        say(f"begin {seq} {name}")
        os.mkdir(p(name))
        os.fsync(dirs[""])
        dirs[name] = os.open(p(name), os.O_RDONLY | os.O_DIRECTORY)
        say(f"ack {seq} {name}=dir")
