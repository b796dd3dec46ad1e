"""How long the write-back of two `pmstack serve` builds takes after the same load.

    python3 wb-ab.py PMSTACK FSLOAD DIR1 DIR2

DIR1 and DIR2: directories served by the two builds (each started beforehand, with its
varmail fileset made by `fsload --prepare-only` under `pmstack run`). Four times, in each:
wait until its log is written back, run 2 s of varmail (4 threads) under `pmstack run`,
wait again, and print the seconds its write-back passes took in between (`writeback_us`)
and the objects they fsynced one by one (`objects_synced`)."""
import json, subprocess, sys, time
P, F, DIRS = sys.argv[1], sys.argv[2], sys.argv[3:5]
def st(d):
    return json.loads(subprocess.run([P, "stat", "--json", d], capture_output=True, text=True).stdout)
def settle(d):
    time.sleep(0.6)
    while True:
        s = st(d)
        if s["lsn"] == s["checkpoint_lsn"]:
            return s
        time.sleep(0.2)
for rep in range(4):
    for b, d in zip(("1", "2"), DIRS):
        s0 = settle(d)
        out = subprocess.run([P, "run", "--require-daemon", "--root", d, "--", F, "--personality", "varmail", "--dir", d,
                              "--seconds", "2", "--threads", "4", "--seed", str(rep + 1)], capture_output=True, text=True).stdout
        ops = json.loads(out)["ops_per_s"]
        s1 = settle(d)
        wb = (s1["writeback_us"] - s0["writeback_us"]) / 1e6
        n = s1["objects_synced"] - s0["objects_synced"]
        passes = s1["writebacks"] - s0["writebacks"]
        print(b, round(ops), f"write-back {wb:.2f} s in {passes} passes for {n} objects", flush=True)
