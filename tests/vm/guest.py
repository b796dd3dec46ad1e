#!/usr/bin/env python3
"""The guest side of the VM power-cut rig (tests/vm/rig); runs at every boot of the guest.

It reads /payload/job.json, written by the host for this boot:
  {"boot": B, "first": bool, "write": bool, "seconds": S, "seeds": {cfg: seed},
   "check": {"boot": A, "seeds": {cfg: seed}, "acked": {cfg: n}} or null}
Writers of boot B write directory cB of each lower; the check is of the directories of boot A
(the last boot whose writers were cut), after recovery.

Hardware (from the host): three virtual NVDIMMs and two virtio disks besides the root and the
payload. NVDIMM regions 0 and 1 are devdax devices, region 2 is fsdax with ext4 -o dax on it;
/dev/vdc is the lower file system, /dev/vdd the control's.

Configurations, all running at once, so that one power cut hits all of them:
  m-devdax   pmstack mount (sync mode), region on devdax
  r-devdax   pmstack serve + pmstack run, region on devdax
  m-fsdax    pmstack mount (sync mode), region in a file on the fsdax mount (MAP_SYNC)
  s-fsdax    pmstack mount --mode strict, region in a file on the fsdax mount: its writers
             never sync (a write is durable when it returns; so is every namespace operation)
  r-fsdax    pmstack serve + pmstack run, region in a file on the fsdax mount; its two
             writers are threads of one process (the others' are a process each)
  control    the plain lower, no syncs at all (shows the cut loses what was not synced)

Everything it reports goes to the console as @@...@@ lines the host parses.
"""
import json
import os
import subprocess
import sys
import time
import traceback

PAYLOAD = "/payload"
PMSTACK = PAYLOAD + "/bin/pmstack"
WORKLOAD = PAYLOAD + "/workload.py"
CONSOLE = "/dev/ttyS0"
LOWER, CONTROL, PMFS = "/tmp/lower", "/tmp/control", "/tmp/pmfs"
CONFIGS = ["m-devdax", "r-devdax", "m-fsdax", "r-fsdax", "s-fsdax"]
# Writers per configuration, each in its own directory ("m-devdax.0" writes c<boot>w0): their
# operations interleave in one log.
WRITERS_PER_CONFIG = 2


# Configurations whose writers run as threads of one process (the others: a process each).
THREADED = {"r-fsdax"}


def writers(c):
    return [("%s.%d" % (c, i), "c%%dw%d" % i) for i in range(WRITERS_PER_CONFIG)]
# Size of the region files on the fsdax mount (the devdax regions are their whole device).
PM_FILE_SIZE = "64M"
# Write-back period: the devdax configurations write back rarely, so that a cut leaves the
# whole cycle in the log and recovery replays it; the fsdax ones use the default (5 s), so
# that cuts also land between and inside write-backs.
WRITEBACK_MS = {"m-devdax": "60000", "r-devdax": "60000", "m-fsdax": "5000", "r-fsdax": "5000", "s-fsdax": "5000"}


def is_mount(c):
    return c.startswith(("m-", "s-"))


def mount_mode(c):
    return "strict" if c.startswith("s-") else "sync"


def say(line):
    with open(CONSOLE, "w") as c:
        c.write("@@%s@@\n" % line)


def sh(*cmd, check=True, timeout=600):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and r.returncode != 0:
        dmesg = subprocess.run(["dmesg"], stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-5:]
        raise RuntimeError(
            "%s: exit %d: %s (dmesg: %s)" % (" ".join(cmd), r.returncode, r.stdout.strip()[-2000:], " | ".join(dmesg))
        )
    return r.stdout


def namespaces():
    out = sh("ndctl", "list", "-N")
    ns = json.loads(out) if out.strip() else []
    return ns if isinstance(ns, list) else [ns]


def setup_pm(first):
    for m in ("nfit", "nd_pmem", "dax_pmem", "device_dax", "fuse"):
        sh("modprobe", m, check=False)
    if first:
        for r, mode in ((0, "devdax"), (1, "devdax"), (2, "fsdax")):
            sh("ndctl", "create-namespace", "--force", "--reconfig=namespace%d.0" % r, "--mode=" + mode, "--map=mem")
    by_region = {}
    for n in namespaces():
        by_region[int(n["dev"].split(".")[0].replace("namespace", ""))] = n
    want = {0: "devdax", 1: "devdax", 2: "fsdax"}
    for r, mode in want.items():
        if by_region.get(r, {}).get("mode") != mode:
            raise RuntimeError("NVDIMM region %d is not %s: %s" % (r, mode, by_region.get(r)))
    dax = ["/dev/" + by_region[r]["chardev"] for r in (0, 1)]
    pmem = "/dev/" + by_region[2]["blockdev"]
    os.makedirs(PMFS, exist_ok=True)
    if first:
        # DAX needs blocks of the page size (mke2fs picks 1 KiB on a device this small).
        sh("mkfs.ext4", "-q", "-F", "-b", "4096", pmem)
    sh("mount", "-o", "dax", pmem, PMFS)
    domains = []
    for d in sorted(os.listdir("/sys/bus/nd/devices")):
        if d.startswith("region"):
            # Hidden when the platform declares no persistence domain.
            p = "/sys/bus/nd/devices/%s/persistence_domain" % d
            domains.append(open(p).read().strip() if os.path.exists(p) else "undeclared")
    say("PLATFORM persistence_domain=%s" % ",".join(domains))
    return {
        "m-devdax": dax[0],
        "r-devdax": dax[1],
        "m-fsdax": PMFS + "/m.pm",
        "r-fsdax": PMFS + "/r.pm",
        "s-fsdax": PMFS + "/s.pm",
    }


def setup_lowers():
    for d, dev in ((LOWER, "/dev/vdc"), (CONTROL, "/dev/vdd")):
        os.makedirs(d, exist_ok=True)
        sh("mount", dev, d)
    for c in CONFIGS:
        os.makedirs(os.path.join(LOWER, c), exist_ok=True)
    os.sync()


def mountpoint(c):
    return "/tmp/mnt-" + c


def recover(c, pm):
    """Recovery as a user of this front end gets it: the mount recovers before it serves
    (and a clean unmount then writes everything back); serve's programs use
    `pmstack recover` or the next serve."""
    lower = os.path.join(LOWER, c)
    t0 = time.monotonic()
    if is_mount(c):
        os.makedirs(mountpoint(c), exist_ok=True)
        sh(PMSTACK, "mount", lower, mountpoint(c), "--pm", pm, "--mode", mount_mode(c))
        sh(PMSTACK, "umount", mountpoint(c))
    else:
        sh(PMSTACK, "recover", "--pm", pm, lower)
    return time.monotonic() - t0


def pm_info(c, pm):
    info = json.loads(sh(PMSTACK, "check", "--pm", pm, "--json"))
    say(
        "PMINFO %s kind=%s flush=%s clean=%s live=%s"
        % (c, info.get("pm_kind"), info.get("flush"), json.dumps(info.get("clean")), info.get("live_entries"))
    )


def check(job, pms):
    chk = job["check"]
    k = chk["boot"]
    for c in CONFIGS:
        say("RECOVERING %s live=%s" % (c, json.loads(sh(PMSTACK, "check", "--pm", pms[c], "--json"))["live_entries"]))
        secs = recover(c, pms[c])
        pm_info(c, pms[c])
        for w, dname in writers(c):
            d = os.path.join(LOWER, c, dname % k)
            r = subprocess.run(
                ["python3", WORKLOAD, "check", d, str(chk["seeds"][w]), str(chk["acked"][w])],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            say("CHECK %s boot=%d recovery_s=%.1f %s" % (w, k, secs, r.stdout.strip().replace("@@", "")))
    d = os.path.join(CONTROL, "c%d" % k)
    if chk["acked"].get("control", 0) > 0 or os.path.exists(d):
        r = subprocess.run(
            ["python3", WORKLOAD, "check", d, str(chk["seeds"]["control"]), str(chk["acked"].get("control", 0))],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        say("CONTROL boot=%d %s" % (k, r.stdout.strip().replace("@@", "")))
    os.sync()


def wait_served(lower, proc, log_path):
    for _ in range(600):
        if subprocess.run([PMSTACK, "stat", lower], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
            return
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError("pmstack serve %s did not come up (exit %s): %s" % (lower, proc.poll(), open(log_path).read()[-1500:]))


def write(job, pms):
    k, secs = job["boot"], str(job["seconds"])
    if job["first"]:
        # A device is never taken over unasked: it is formatted once, bound to its lower.
        for c in ("m-devdax", "r-devdax"):
            sh(PMSTACK, "format", "--pm", pms[c], "--lower", os.path.join(LOWER, c))
    procs = []
    for c in CONFIGS:
        lower = os.path.join(LOWER, c)
        if is_mount(c):
            os.makedirs(mountpoint(c), exist_ok=True)
            sh(PMSTACK, "mount", lower, mountpoint(c), "--pm", pms[c], "--pm-size", PM_FILE_SIZE,
               "--flush-interval-ms", WRITEBACK_MS[c], "--mode", mount_mode(c))
            top, prefix = mountpoint(c), []
        else:
            log_path = "/tmp/serve-%s.log" % c
            log = open(log_path, "w")
            serve = subprocess.Popen(
                [PMSTACK, "serve", lower, "--pm", pms[c], "--pm-size", PM_FILE_SIZE, "--flush-interval-ms", WRITEBACK_MS[c]],
                stdout=log, stderr=log,
            )
            wait_served(lower, serve, log_path)
            top, prefix = lower, [PMSTACK, "run", "--require-daemon", "--root", lower, "--"]
        sync = "0" if mount_mode(c) == "strict" and is_mount(c) else "1"
        ws = [(w, os.path.join(top, dname % k), str(job["seeds"][w])) for w, dname in writers(c)]
        if c in THREADED:
            cmd = prefix + ["python3", WORKLOAD, "write-threads", sync, secs, CONSOLE]
            procs.append(subprocess.Popen(cmd + [x for w in ws for x in w]))
        else:
            for w, d, seed in ws:
                cmd = prefix + ["python3", WORKLOAD, "write", w, d, seed, sync, secs, CONSOLE]
                procs.append(subprocess.Popen(cmd))
        # What a running front end says about its region (the mount's stats, serve's).
        st = json.loads(sh(PMSTACK, "stat", mountpoint(c) if is_mount(c) else lower, "--json"))
        say("STAT %s kind=%s flush=%s" % (c, st.get("pm_kind"), st.get("flush")))
    d = os.path.join(CONTROL, "c%d" % k)
    procs.append(subprocess.Popen(["python3", WORKLOAD, "write", "control", d, str(job["seeds"]["control"]), "0", secs, CONSOLE]))
    for p in procs:
        p.wait()
    say("WRITERS-END")


# Benchmark configurations (`tests/vm/rig bench`, `bench/run --vm`): the lower alone, the
# mount and pmstack run on each kind of PM, and the mount on emulated PM in the guest's
# /dev/shm for comparison.
BENCH = {
    "vm-ext4": ("plain", None),
    "vm-ext4+pmstack-sync-devdax": ("mount", "m-devdax"),
    "vm-ext4+pmstack-sync-fsdax": ("mount", "m-fsdax"),
    "vm-ext4+pmstack-sync-emulated": ("mount", "emulated"),
    "vm-ext4+pmstack-run-devdax": ("run", "r-devdax"),
    "vm-ext4+pmstack-run-fsdax": ("run", "r-fsdax"),
}


def bench(spec, pms):
    pms = dict(pms, emulated="/dev/shm/emulated.pm")
    for c in ("m-devdax", "r-devdax"):
        sh(PMSTACK, "format", "--pm", pms[c], "--lower", os.path.join(LOWER, c))
    dirs, wrap, serves = {}, {}, []
    for cfg in spec["configs"]:
        how, c = BENCH[cfg]
        lower = os.path.join(LOWER, c or "plain")
        os.makedirs(lower, exist_ok=True)
        if how == "plain":
            dirs[cfg], wrap[cfg] = lower, []
        elif how == "mount":
            os.makedirs(mountpoint(c), exist_ok=True)
            sh(PMSTACK, "mount", lower, mountpoint(c), "--pm", pms[c], "--pm-size", PM_FILE_SIZE)
            dirs[cfg], wrap[cfg] = mountpoint(c), []
        else:
            log_path = "/tmp/serve-%s.log" % c
            serve = subprocess.Popen([PMSTACK, "serve", lower, "--pm", pms[c], "--pm-size", PM_FILE_SIZE],
                                     stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
            wait_served(lower, serve, log_path)
            serves.append(serve)
            dirs[cfg], wrap[cfg] = lower, [PMSTACK, "run", "--require-daemon", "--root", lower, "--"]
    for w, args in spec["workloads"].items():
        for cfg in spec["configs"]:
            os.makedirs(os.path.join(dirs[cfg], w), exist_ok=True)
        for rep in range(spec["reps"]):
            for cfg in spec["configs"]:  # interleaved
                cmd = wrap[cfg] + ["fio", "--name=job", "--directory=" + os.path.join(dirs[cfg], w),
                                   "--runtime=%dms" % int(spec["runtime"] * 1000), "--time_based",
                                   "--output-format=json", "--group_reporting"] + args
                out = sh(*cmd)
                j = json.loads(out[out.index("{"):])["jobs"][0]
                say("BENCH %s %s %d %.1f" % (w, cfg, rep, j["read"]["iops"] + j["write"]["iops"]))
        for cfg in spec["configs"]:
            sh("rm", "-rf", os.path.join(dirs[cfg], w))
    for cfg in spec["configs"]:
        if BENCH[cfg][0] == "mount":
            sh(PMSTACK, "umount", dirs[cfg])
    for serve in serves:
        serve.terminate()
        serve.wait()


def main():
    job = json.load(open(PAYLOAD + "/job.json"))
    say("BOOT %d" % job["boot"])
    pms = setup_pm(job["first"])
    setup_lowers()
    if job.get("bench"):
        bench(job["bench"], pms)
    if job["check"]:
        check(job, pms)
    if job["write"]:
        write(job, pms)
    else:
        for d in (LOWER, CONTROL, PMFS):
            sh("umount", d)
    say("GUEST-END")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        for line in traceback.format_exc().splitlines():
            say("GUEST-ERROR " + line)
        sys.exit(1)
