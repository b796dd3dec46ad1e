#!/usr/bin/env python3
"""The guest side of the VM power-cut rig (tests/vm/rig); runs at every boot of the guest.

It reads /payload/job.json, written by the host for this boot:
  {"cycle": K, "first": bool, "write": bool, "seconds": S, "seeds": {cfg: seed},
   "check": {"cycle": K-1, "seeds": {cfg: seed}, "acked": {cfg: n}} or null}

Hardware (from the host): three virtual NVDIMMs and two virtio disks besides the root and the
payload. NVDIMM regions 0 and 1 are devdax devices, region 2 is fsdax with ext4 -o dax on it;
/dev/vdc is the lower file system, /dev/vdd the control's.

Configurations, all running at once, so that one power cut hits all of them:
  m-devdax   pmstack mount (sync mode), region on devdax
  r-devdax   pmstack serve + pmstack run, region on devdax
  m-fsdax    pmstack mount (sync mode), region in a file on the fsdax mount (MAP_SYNC)
  r-fsdax    pmstack serve + pmstack run, region in a file on the fsdax mount
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
CONFIGS = ["m-devdax", "r-devdax", "m-fsdax", "r-fsdax"]
# Size of the region files on the fsdax mount (the devdax regions are their whole device).
PM_FILE_SIZE = "128M"


def say(line):
    with open(CONSOLE, "w") as c:
        c.write("@@%s@@\n" % line)


def sh(*cmd, check=True, timeout=600):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError("%s: exit %d: %s" % (" ".join(cmd), r.returncode, r.stdout.strip()[-2000:]))
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
        sh("mkfs.ext4", "-q", "-F", pmem)
    sh("mount", "-o", "dax", pmem, PMFS)
    domains = sorted(
        open("/sys/bus/nd/devices/%s/persistence_domain" % d).read().strip()
        for d in os.listdir("/sys/bus/nd/devices")
        if d.startswith("region")
    )
    say("PLATFORM persistence_domain=%s" % ",".join(domains))
    return {
        "m-devdax": dax[0],
        "r-devdax": dax[1],
        "m-fsdax": PMFS + "/m.pm",
        "r-fsdax": PMFS + "/r.pm",
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
    if c.startswith("m-"):
        os.makedirs(mountpoint(c), exist_ok=True)
        sh(PMSTACK, "mount", lower, mountpoint(c), "--pm", pm)
        sh(PMSTACK, "umount", mountpoint(c))
    else:
        sh(PMSTACK, "recover", "--pm", pm, lower)
    return time.monotonic() - t0


def pm_info(c, pm):
    info = json.loads(sh(PMSTACK, "check", "--pm", pm, "--json"))
    say(
        "PMINFO %s kind=%s flush=%s clean=%s live=%s"
        % (c, info.get("pm_kind"), info.get("flush"), info.get("clean"), info.get("live_entries"))
    )


def check(job, pms):
    chk = job["check"]
    k = chk["cycle"]
    for c in CONFIGS:
        secs = recover(c, pms[c])
        pm_info(c, pms[c])
        d = os.path.join(LOWER, c, "c%d" % k)
        r = subprocess.run(
            ["python3", WORKLOAD, "check", d, str(chk["seeds"][c]), str(chk["acked"][c])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        say("CHECK %s cycle=%d recovery_s=%.1f %s" % (c, k, secs, r.stdout.strip().replace("@@", "")))
    d = os.path.join(CONTROL, "c%d" % k)
    if chk["acked"].get("control", 0) > 0 or os.path.exists(d):
        r = subprocess.run(
            ["python3", WORKLOAD, "check", d, str(chk["seeds"]["control"]), str(chk["acked"].get("control", 0))],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        say("CONTROL cycle=%d %s" % (k, r.stdout.strip().replace("@@", "")))
    os.sync()


def wait_served(lower):
    for _ in range(600):
        if subprocess.run([PMSTACK, "stat", lower], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
            return
        time.sleep(0.5)
    raise RuntimeError("pmstack serve %s did not come up" % lower)


def write(job, pms):
    k, secs = job["cycle"], str(job["seconds"])
    procs = []
    for c in CONFIGS:
        lower = os.path.join(LOWER, c)
        name = "c%d" % k
        seed = str(job["seeds"][c])
        if c.startswith("m-"):
            os.makedirs(mountpoint(c), exist_ok=True)
            sh(PMSTACK, "mount", lower, mountpoint(c), "--pm", pms[c], "--pm-size", PM_FILE_SIZE)
            d = os.path.join(mountpoint(c), name)
            cmd = ["python3", WORKLOAD, "write", c, d, seed, "1", secs, CONSOLE]
        else:
            log = open("/tmp/serve-%s.log" % c, "w")
            subprocess.Popen([PMSTACK, "serve", lower, "--pm", pms[c], "--pm-size", PM_FILE_SIZE], stdout=log, stderr=log)
            wait_served(lower)
            d = os.path.join(lower, name)
            cmd = [PMSTACK, "run", "--require-daemon", "--root", lower, "--", "python3", WORKLOAD, "write", c, d, seed, "1", secs, CONSOLE]
        procs.append(subprocess.Popen(cmd))
    d = os.path.join(CONTROL, "c%d" % k)
    procs.append(subprocess.Popen(["python3", WORKLOAD, "write", "control", d, str(job["seeds"]["control"]), "0", secs, CONSOLE]))
    for p in procs:
        p.wait()
    say("WRITERS-END")


def main():
    job = json.load(open(PAYLOAD + "/job.json"))
    say("BOOT cycle=%d" % job["cycle"])
    pms = setup_pm(job["first"])
    setup_lowers()
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
