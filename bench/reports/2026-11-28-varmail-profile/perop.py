#!/usr/bin/env python3
"""Where a workload's time goes, per operation: CPU microseconds per operation of a
`perf record -a -g` profile, split by process and, for the benchmark's own process, by the
system call it was in (or its user-space time: the library's, or anything else).

    perf record -a -g -o P.data -- CMD      # CMD prints its operation count
    python3 perop.py P.data OPS [COMM]      # COMM: the benchmark's process name (fsload)

Samples are taken at perf's default 4,000 Hz (250 µs of CPU each)."""
import collections, subprocess, sys

data, ops = sys.argv[1], float(sys.argv[2])
comm = sys.argv[3] if len(sys.argv) > 3 else "fsload"
out = subprocess.run(["perf", "script", "-i", data, "-F", "comm,ip,sym"],
                     capture_output=True, text=True, check=True).stdout
by_comm, by_call = collections.Counter(), collections.Counter()
for s in out.split("\n\n"):
    lines = [l.strip() for l in s.strip().split("\n") if l.strip()]
    if not lines:
        continue
    c = lines[0].split()[0]
    frames = [l.split(None, 1)[1] for l in lines[1:] if len(l.split(None, 1)) > 1]
    by_comm[c] += 1
    if c != comm:
        continue
    sc = [i for i, f in enumerate(frames) if f.startswith("do_syscall_64")]
    if sc and sc[-1] > 0:
        by_call[frames[sc[-1] - 1].split(" (")[0]] += 1
    elif any("pmstack" in f for f in frames):
        by_call["user: pmstack library"] += 1
    else:
        by_call["user: other"] += 1
us = lambda n: n * 250 / ops
print("µs of CPU per operation, by process:")
for c, n in by_comm.most_common(8):
    print(f"  {us(n):7.2f}  {c}")
print(f"{comm}, by system call (kernel time) or user space:")
for c, n in by_call.most_common(20):
    print(f"  {us(n):7.2f}  {c}")
