#!/usr/bin/env python3
"""A/B of pmstack run before (OLD build) and after (NEW build) on one ext4 loop image:
the lower alone, OLD serve+run, NEW serve+run; interleaved, order rotated, medians."""
import json, os, statistics, subprocess, sys, time
OLD, NEW = sys.argv[1], sys.argv[2]          # repository checkouts with release builds
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 5
W = "/var/tmp/abtree/w"
def sh(*a, **k): return subprocess.run(list(a), check=True, **k)
os.makedirs(W, exist_ok=True)
img = f"{W}/img"
sh("fallocate", "-l", "2G", img); sh("mkfs.ext4", "-q", "-F", img)
mnt = f"{W}/m"; os.makedirs(mnt, exist_ok=True); sh("mount", "-o", "loop", img, mnt)
servers = []
try:
    dirs = {"ext4": f"{mnt}/plain", "old": f"{mnt}/old", "new": f"{mnt}/new"}
    for d in dirs.values(): os.makedirs(d)
    def pm(c): return f"{OLD if c == 'old' else NEW}/target/release/pmstack"
    for c in ("old", "new"):
        servers.append(subprocess.Popen([pm(c), "serve", dirs[c], "--pm", f"/dev/shm/abtree-{c}.pm", "--pm-size", "1G"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.5)
    def wrap(c, cmd): return cmd if c == "ext4" else [pm(c), "run", "--root", dirs[c], "--"] + cmd
    FS = f"{NEW}/target/release/examples/fsload"
    work = {
        "varmail": lambda c, d, r: [FS, "--personality", "varmail", "--dir", d, "--threads", "4", "--seconds", "2", "--seed", str(r + 1)],
        "fileserver": lambda c, d, r: [FS, "--personality", "fileserver", "--dir", d, "--threads", "4", "--seconds", "2", "--seed", str(r + 1)],
        "webserver": lambda c, d, r: [FS, "--personality", "webserver", "--dir", d, "--threads", "4", "--seconds", "2", "--seed", str(r + 1)],
    }
    for w in work:
        for c, d in dirs.items():
            os.makedirs(f"{d}/{w}", exist_ok=True)
            sh(*wrap(c, [FS, "--personality", w, "--dir", f"{d}/{w}", "--prepare-only"]), stdout=subprocess.DEVNULL)
    sh("sync")
    res = {w: {c: [] for c in dirs} for w in work}
    order = list(dirs)
    for r in range(REPS):
        for w, f in work.items():
            for c in order[r % 3:] + order[:r % 3]:
                out = subprocess.run(wrap(c, f(c, f"{dirs[c]}/{w}", r)), check=True, capture_output=True, text=True).stdout
                res[w][c].append(json.loads(out)["ops_per_s"])
    print(f"{REPS} interleaved repetitions of 2 s, 4 threads, order rotated; ops/s median (min-max), ratio to ext4 alone")
    print("| workload | ext4 | run before | run after | before/ext4 | after/ext4 | after/before |")
    print("|---|---|---|---|---|---|---|")
    for w in work:
        m = {c: statistics.median(v) for c, v in res[w].items()}
        rng = {c: f"{min(v):.0f}-{max(v):.0f}" for c, v in res[w].items()}
        print(f"| {w} | {m['ext4']:.0f} ({rng['ext4']}) | {m['old']:.0f} ({rng['old']}) | {m['new']:.0f} ({rng['new']}) | "
              f"{m['old']/m['ext4']:.2f}x | {m['new']/m['ext4']:.2f}x | {m['new']/m['old']:.2f}x |")
finally:
    for s in servers: s.terminate()
    for s in servers: s.wait()
    subprocess.run(["umount", mnt]); os.remove(img)
    for c in ("old", "new"):
        try: os.remove(f"/dev/shm/abtree-{c}.pm")
        except FileNotFoundError: pass
