#!/usr/bin/env python3
"""A/B of unsynced writes under pmstack run before (OLD build) and after (NEW build) on one
ext4 loop image: the lower alone, OLD serve+run, NEW serve+run (default write-back period,
5 s); fio 4 KiB random writes without syncs, interleaved, order rotated, medians."""
import json, os, statistics, subprocess, sys, time
OLD, NEW = sys.argv[1], sys.argv[2]          # repository checkouts with release builds
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 5
SECS = int(sys.argv[4]) if len(sys.argv) > 4 else 8
SIZE = sys.argv[5] if len(sys.argv) > 5 else "256M"
W = "/var/tmp/ablazy"
def sh(*a, **k): return subprocess.run(list(a), check=True, **k)
os.makedirs(W, exist_ok=True)
img = f"{W}/img"
sh("fallocate", "-l", "3G", img); sh("mkfs.ext4", "-q", "-F", img)
mnt = f"{W}/m"; os.makedirs(mnt, exist_ok=True); sh("mount", "-o", "loop", img, mnt)
servers = []
try:
    dirs = {"ext4": f"{mnt}/plain", "old": f"{mnt}/old", "new": f"{mnt}/new"}
    for d in dirs.values(): os.makedirs(d)
    def pm(c): return f"{OLD if c == 'old' else NEW}/target/release/pmstack"
    for c in ("old", "new"):
        servers.append(subprocess.Popen([pm(c), "serve", dirs[c], "--pm", f"/dev/shm/ablazy-{c}.pm", "--pm-size", "1G"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.5)
    def wrap(c, cmd): return cmd if c == "ext4" else [pm(c), "run", "--root", dirs[c], "--"] + cmd
    def fio(d): return ["fio", "--name=a", "--ioengine=psync", f"--size={SIZE}", "--randrepeat=1", "--rw=randwrite",
                        "--bs=4k", f"--runtime={SECS}", "--time_based", f"--filename={d}/f", "--output-format=json"]
    res = {c: [] for c in dirs}
    order = list(dirs)
    for r in range(REPS):
        for c in order[r % 3:] + order[:r % 3]:
            out = subprocess.run(wrap(c, fio(dirs[c])), check=True, capture_output=True, text=True).stdout
            res[c].append(json.loads(out[out.index("{"):])["jobs"][0]["write"]["iops"])
    wbs = {}
    for c in ("old", "new"):
        st = subprocess.run([pm(c), "stat", "--json", dirs[c]], capture_output=True, text=True).stdout
        wbs[c] = json.loads(st).get("writebacks")
    print(f"{REPS} interleaved repetitions of {SECS} s, fio 4 KiB random writes to a {SIZE} file, no syncs, order rotated;")
    print("IOPS median (min-max), ratio to ext4 alone; daemon write-backs over the whole run")
    print("| ext4 | run before | run after | before/ext4 | after/ext4 | write-backs before | after |")
    print("|---|---|---|---|---|---|---|")
    m = {c: statistics.median(v) for c, v in res.items()}
    rng = {c: f"{min(v):.0f}-{max(v):.0f}" for c, v in res.items()}
    print(f"| {m['ext4']:.0f} ({rng['ext4']}) | {m['old']:.0f} ({rng['old']}) | {m['new']:.0f} ({rng['new']}) | "
          f"{m['old']/m['ext4']:.2f}x | {m['new']/m['ext4']:.2f}x | {wbs['old']} | {wbs['new']} |")
finally:
    for s in servers: s.terminate()
    for s in servers: s.wait()
    subprocess.run(["umount", mnt]); os.remove(img)
    for c in ("old", "new"):
        try: os.remove(f"/dev/shm/ablazy-{c}.pm")
        except FileNotFoundError: pass
