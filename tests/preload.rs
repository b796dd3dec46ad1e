//! The zero-round-trip front end against real programs: `pmstack serve` owning the region,
//! programs under `pmstack run` (LD_PRELOAD) working directly on the lower directory.
//!
//! - kill -9 of the programs and of the daemon under a multi-threaded, multi-process fsync
//!   load, a power-loss model applied to the lower (nothing the lower made durable since the
//!   programs' first syncs survives except by chance), then recovery: every acknowledged
//!   record and overwrite is present, nothing is garbage;
//! - the daemon dying under load: programs fall back to the real fsync and finish;
//! - every fallback case (shared writable mapping, copy_file_range, sendfile, a stdio stream,
//!   another process's unsynced writes) is a real sync, and replay never rolls it back;
//! - real programs (SQLite with both journal modes, cp/mv/tar, fio, db_bench) give the same
//!   results as without the library.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{power_cut, snapshot, LoopFs};
use rand::{Rng, SeedableRng};

fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

fn have(tool: &str) -> bool {
    let ok = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok && ci() {
        panic!("CI: {tool} is required by tests/preload.rs (installed by .ci/run)");
    }
    ok
}

/// Syncs counted in a set of counters (a process's record, or the daemon's `totals`):
/// absorbed and the lower's own.
fn fsyncs(c: &serde_json::Value) -> u64 {
    c["absorbed_fsync"].as_u64().unwrap_or(0) + c["real_syncs"].as_u64().unwrap_or(0)
}

/// Opens the daemon's watch answered (`watched_opens` in its stats).
fn watched_opens(v: &serde_json::Value) -> u64 {
    v["watched_opens"].as_u64().unwrap_or(0)
}

/// The record of attached process `pid` in the daemon's stats `v`.
fn proc_stats(v: &serde_json::Value, pid: u64) -> Option<serde_json::Value> {
    v["attached"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["pid"] == pid).cloned())
}

/// A PM region path in /dev/shm for test `name` of this process, with nothing there yet.
fn shm_region(name: &str) -> PathBuf {
    let pm = PathBuf::from(format!(
        "/dev/shm/pmstack-test-{name}-{}.pm",
        std::process::id()
    ));
    let _ = fs::remove_file(&pm);
    pm
}

struct Serve {
    child: Option<Child>,
    dir: PathBuf,
    pm: PathBuf,
}

impl Serve {
    /// With `--no-settle`: what the tests count of namespace write-backs does not depend on
    /// whether the lower is a journaled ext4 (where write-backs of the whole file system
    /// settle directories: `start_settling`). With `--log-unsynced-names`: the namespace
    /// operations of a test's program that has synced nothing are logged as any other's
    /// (`start_unsynced` tests what the daemon does by default).
    fn start(dir: &Path, pm: &Path, extra: &[&str]) -> Serve {
        let mut args = extra.to_vec();
        args.push("--no-settle");
        args.push("--log-unsynced-names");
        Serve::start_settling(dir, pm, &args)
    }

    /// With `--no-settle` only: the namespace operations of programs that synced nothing
    /// are the lower's own, as by default.
    fn start_unsynced(dir: &Path, pm: &Path, extra: &[&str]) -> Serve {
        let mut args = extra.to_vec();
        args.push("--no-settle");
        Serve::start_settling(dir, pm, &args)
    }

    /// As the daemon starts by default (settling where the lower allows).
    fn start_settling(dir: &Path, pm: &Path, extra: &[&str]) -> Serve {
        let dir = fs::canonicalize(dir).unwrap();
        let child = common::start_serve(&dir, pm, extra);
        Serve {
            child: Some(child),
            dir,
            pm: pm.to_owned(),
        }
    }

    /// Stop the daemon (SIGSTOP) so it does nothing more until killed: programs killed now
    /// die before the daemon as far as the region and the lower can tell, without the
    /// daemon writing back (it does so when it sees an attached process die), which would
    /// make durable what a power cut after the snapshot must be free to lose.
    fn freeze(&self) {
        if let Some(c) = &self.child {
            // SAFETY: signalling our own child, not yet reaped.
            unsafe { libc::kill(c.id() as i32, libc::SIGSTOP) };
        }
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait: the final write-back leaves the lower complete.
    fn stop(&mut self) {
        if let Some(c) = self.child.take() {
            common::stop_serve(c);
        }
    }

    fn stats(&self) -> serde_json::Value {
        common::served_stats(&self.dir)
    }

    /// Wait until the daemon's stats show `f` true (they are written every 500 ms).
    fn wait_stats(&self, what: &str, f: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
        let t0 = Instant::now();
        loop {
            let s = self.stats();
            if f(&s) {
                return s;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "{what}: stats {s}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The stats of attached process `pid`, once its real syncs reach `min_real`.
    fn wait_real_syncs(
        &self,
        what: &str,
        pid: u64,
        min_real: u64,
    ) -> (serde_json::Value, serde_json::Value) {
        let st = self.wait_stats(what, |v| {
            proc_stats(v, pid).is_some_and(|p| p["real_syncs"].as_u64() >= Some(min_real))
        });
        (proc_stats(&st, pid).expect("found above"), st)
    }

    fn run(&self) -> Command {
        let mut c = Command::new(common::bin());
        c.arg("run").arg("--root").arg(&self.dir).arg("--");
        c.env("PMSTACK_TEST_STATS", pmstack::front::paths(&self.dir).2);
        c
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill9();
        let _ = fs::remove_file(&self.pm);
        // A killed daemon leaves its table in /dev/shm (a clean stop removes it); every
        // daemon leaves its last stats for the operator.
        let (_, table, _) = pmstack::front::paths(&self.dir);
        let _ = fs::remove_file(table);
        common::remove_runtime_files(&self.dir, None);
    }
}

fn base(t: u64) -> Vec<u8> {
    (0..8192 + 256)
        .map(|k| ((t * 131 + k * 7) % 251) as u8 + 1)
        .collect()
}

fn rec_len(t: u64, i: u64) -> usize {
    1 + ((t * 7919 + i * 104729) % 6000) as usize
}

const REC: u64 = 8192;
const THREADS: u64 = 3;

/// Acknowledgements: (tag, thread) -> last record; tag -> last overwrite.
#[derive(Default, Debug)]
struct Acks {
    rec: BTreeMap<(String, u64), i64>,
    ov: BTreeMap<String, i64>,
    ready: usize,
    done: usize,
}

/// Start the load; the reader thread ends when the program's stdout closes (join it before
/// reading the acknowledgements: a line still in the pipe is an acknowledgement too).
fn spawn_load(
    s: &Serve,
    tag: &str,
    maxrec: u64,
    pace: f64,
    acks: &Arc<Mutex<Acks>>,
    vetted: usize,
) -> (Child, std::thread::JoinHandle<()>) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/preload/load.py");
    let mut c = s
        .run()
        .arg("python3")
        .arg(script)
        .arg(&s.dir)
        .arg(tag)
        .arg(THREADS.to_string())
        .arg(maxrec.to_string())
        .arg(pace.to_string())
        .env("PMSTACK_TEST_VETTED", vetted.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = c.stdout.take().unwrap();
    let acks = acks.clone();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            let w: Vec<&str> = line.split_whitespace().collect();
            let mut a = acks.lock().unwrap();
            match w.as_slice() {
                ["ready"] => a.ready += 1,
                ["done"] => a.done += 1,
                ["ack", tag, t, i] => {
                    a.rec
                        .insert((tag.to_string(), t.parse().unwrap()), i.parse().unwrap());
                }
                ["ov", tag, i] => {
                    a.ov.insert(tag.to_string(), i.parse().unwrap());
                }
                _ => {}
            }
        }
    });
    (c, reader)
}

/// The contract after recovery, read from the lower directly.
fn verify(dir: &Path, acks: &Acks, tags: &[&str], seed: u64) {
    for tag in tags {
        for t in 0..THREADS {
            let acked = acks.rec.get(&(tag.to_string(), t)).copied().unwrap_or(-1);
            let data = fs::read(dir.join(format!("f-{tag}-{t}"))).unwrap_or_default();
            let b = base(t);
            let mut i = 0u64;
            while i * REC < data.len() as u64 || (i as i64) <= acked {
                let n = rec_len(t, i);
                let want = &b[(i % 256) as usize..(i % 256) as usize + n];
                let s = (i * REC) as usize;
                let got = data.get(s..(s + n).min(data.len())).unwrap_or(&[]);
                if (i as i64) <= acked {
                    assert!(
                        got == want,
                        "seed {seed}: {tag} thread {t} record {i} acknowledged (up to {acked}) but not intact"
                    );
                } else {
                    for (k, x) in got.iter().enumerate() {
                        assert!(
                            *x == 0 || *x == want[k],
                            "seed {seed}: {tag} thread {t} record {i} byte {k} is garbage"
                        );
                    }
                }
                i += 1;
            }
        }
        // The last acknowledged overwrite is present (at most one more was in flight, at a
        // different offset of the rotation only if it could not overlap: check the bytes no
        // later overwrite could have touched).
        if let Some(&last) = acks.ov.get(*tag) {
            let data = fs::read(dir.join(format!("pre-{tag}"))).unwrap();
            let i = last as u64;
            let off = ((i % 4) * 3000) as usize;
            let b = base(7);
            let want = &b[(i % 256) as usize..(i % 256) as usize + 5000];
            let next = ((i + 3) % 4 * 3000) as usize;
            for (k, w) in want.iter().enumerate() {
                let p = off + k;
                if p >= next && p < next + 5000 {
                    continue; // the next overwrite (unacknowledged) may have landed here
                }
                if data[p] != *w {
                    // Which overwrite's bytes are there instead?
                    let who: Vec<u64> = (0..=i + 3)
                        .filter(|j| {
                            j % 3 == 0
                                && (j % 4) * 3000 <= p as u64
                                && p as u64 - (j % 4) * 3000 < 5000
                        })
                        .filter(|j| {
                            data[p] == b[((j % 256) as usize) + p - ((j % 4) * 3000) as usize]
                        })
                        .collect();
                    panic!(
                        "seed {seed}: acknowledged overwrite {i} of pre-{tag} lost at byte {p} (found {}, matching overwrites {who:?})",
                        data[p]
                    );
                }
            }
        }
    }
}

/// After a clean stop the region holds no live entry.
fn assert_log_empty(pm: &Path) {
    let chk = Command::new(common::bin())
        .args(["check", "--json", "--pm"])
        .arg(pm)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&chk.stdout).unwrap();
    assert_eq!(v["live_entries"], 0, "{v}");
}

/// Run `round(root, seed)` PMSTACK_CRASH_ROUNDS times (default `rounds`) on a loop-mounted
/// ext4 (or a plain directory where loop devices are missing outside CI).
fn crash_rounds(prefix: &str, rounds: u64, round: impl Fn(&Path, u64)) {
    let base_dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/var/tmp")
        .unwrap();
    let lfs = LoopFs::new(base_dir.path());
    let root = lfs
        .as_ref()
        .map_or(base_dir.path().to_owned(), |l| l.dir.clone());
    let rounds: u64 = std::env::var("PMSTACK_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(rounds);
    let seed0: u64 = rand::random::<u32>() as u64;
    for r in 0..rounds {
        round(&root, seed0 + r);
    }
}

/// The counters of attached process `pid` in the daemon's table.
fn proc_counters(
    tab: &pmstack::front::table::Table,
    pid: u64,
) -> [u64; pmstack::front::table::PROC_WORDS] {
    tab.counters_of(pid).expect("the workload is attached")
}

/// One round: load, kill -9 (programs and daemon, in a random order), power cut, recover.
fn crash_round(base_dir: &Path, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = base_dir.join(format!("r{seed}"));
    fs::create_dir_all(&dir).unwrap();
    let tags = ["A", "B"];
    for t in &tags {
        fs::write(dir.join(format!("pre-{t}")), vec![b'p'; 20000]).unwrap();
    }
    Command::new("sync").status().unwrap();
    let pm = PathBuf::from(format!("/dev/shm/pmstack-test-preload-{seed}.pm"));
    let _ = fs::remove_file(&pm);
    // No write-back during the round: the lower is never made durable by pmstack after the
    // programs' first syncs, so rewinding it to the snapshot below is a possible power cut.
    // Settling as by default: over the loop-mounted ext4, write-backs of the whole file
    // system settle directories (`front::settle`).
    let mut s = Serve::start_settling(
        &dir,
        &pm,
        &["--flush-interval-ms", "3600000", "--pm-size", "4G"],
    );
    let acks = Arc::new(Mutex::new(Acks::default()));
    let (kids, readers): (Vec<Child>, Vec<_>) = tags
        .iter()
        .map(|t| {
            spawn_load(
                &s,
                t,
                20000,
                0.0,
                &acks,
                tags.len() * (THREADS as usize + 1),
            )
        })
        .unzip();
    // Killed and reaped however the round ends (a failed assertion left them waiting on
    // their stdin forever).
    let mut kids = common::Reaped(kids);
    let t0 = Instant::now();
    while acks.lock().unwrap().ready < tags.len() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "load never got ready"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Every file had its first (real) sync: this is the durable state a power cut may keep.
    Command::new("sync").status().unwrap();
    let old = snapshot(&dir);
    let tab = pmstack::front::table::Table::open(&pmstack::front::paths(&s.dir).1).unwrap();
    // Syncs the lower made durable: real ones, and operations that found no daemon.
    let real = |pid: u64| {
        use pmstack::front::table::*;
        let w = proc_counters(&tab, pid);
        (w[P_FALLBACKS], w[P_UNSERVED])
    };
    let before: Vec<_> = kids.iter().map(|k| real(k.id() as u64)).collect();
    for k in kids.0.iter_mut() {
        writeln!(k.stdin.as_mut().unwrap(), "go").unwrap();
    }
    // The kernel drops its inode and dentry caches while the load runs.
    let dropping = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let dropper = {
        let dropping = dropping.clone();
        std::thread::spawn(move || {
            while dropping.load(std::sync::atomic::Ordering::Relaxed) {
                fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
                std::thread::sleep(Duration::from_millis(30));
            }
        })
    };
    // Kill at a random point of the load, counted in acknowledged records (not in time: on a
    // busy machine the load may be slow).
    let target = rng.gen_range(12i64..400);
    let t0 = Instant::now();
    while acks.lock().unwrap().rec.values().all(|&i| i < target) {
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "seed {seed}: no thread acknowledged {target} records in 300 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    dropping.store(false, std::sync::atomic::Ordering::Relaxed);
    dropper.join().unwrap();
    let daemon_first = rng.gen_bool(0.5);
    if daemon_first {
        s.kill9();
        // Programs keep absorbing into the region for a moment (well under the heartbeat
        // timeout, so none of their syncs turned real).
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..300)));
    }
    s.freeze();
    for k in kids.0.iter_mut() {
        let _ = k.kill();
        let _ = k.wait();
    }
    s.kill9();
    for r in readers {
        r.join().unwrap();
    }
    let after: Vec<_> = kids.iter().map(|k| real(k.id() as u64)).collect();
    if after != before {
        // What the daemon last reported, and each program's counters, for the diagnosis.
        eprintln!("seed {seed}: stats {}", s.stats());
        for k in kids.iter() {
            let w = proc_counters(&tab, k.id() as u64);
            eprintln!("seed {seed}: program {} counters {w:?}", k.id());
        }
    }
    // Otherwise the power cut below, which keeps only the snapshot, would not be a possible
    // one.
    assert_eq!(
        after, before,
        "seed {seed}: (real syncs, unserved operations) per program changed after the snapshot"
    );
    let acks = std::mem::take(&mut *acks.lock().unwrap());
    assert!(
        acks.rec.values().any(|&i| i > 10),
        "seed {seed}: the load acknowledged almost nothing: {acks:?}"
    );
    power_cut(&dir, &old, &mut rng);
    // Restart: recovery replays the log; then a clean stop leaves the lower complete.
    let mut s2 = Serve::start(&dir, &pm, &[]);
    s2.stop();
    verify(&dir, &acks, &tags, seed);
    assert_log_empty(&pm);
    drop(s2);
    drop(s);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn kill9_of_programs_and_daemon_with_power_loss_keeps_every_acknowledged_write() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    crash_rounds("pmstack-preload-", 6, crash_round);
}

/// After the daemon died, a program goes on on the lower file system alone: an unlink, a
/// rename, an rmdir, an overwrite and a truncate it makes then must never be undone by the
/// recovery of the log from before (a create replayed over the unlink, old pages over the
/// overwrite). The daemon's death is made visible to the program by ageing its heartbeat in
/// the table, as the 2 s timeout would.
/// A daemon over a fresh directory in /var/tmp (its region inside) that never writes back by
/// itself and takes every writer for attached: the log keeps what a test puts in it.
fn quiet_serve() -> (tempfile::TempDir, PathBuf, PathBuf, Serve) {
    serve_with(&["--flush-interval-ms", "3600000", "--all-writers-attached"])
}

/// A daemon started with `args` on a fresh directory under /var/tmp (removed on drop): the
/// directory, the root (its canonical path) and the region file in it.
fn serve_with(args: &[&str]) -> (tempfile::TempDir, PathBuf, PathBuf, Serve) {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = root.join("region.pm");
    let s = Serve::start(&root, &pm, args);
    (d, root, pm, s)
}

#[test]
fn after_the_daemons_death_nothing_the_program_did_is_undone_by_recovery() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    use pmstack::front::table::*;
    use std::sync::atomic::Ordering::Relaxed;
    let (_d, root, pm, mut s) = quiet_serve();
    let mut a = Py::spawn(s.run(), &root);
    let pid = a.pid();
    a.exec(concat!(
        "dfd = os.open(d, os.O_RDONLY)\n",
        "open(os.path.join(d, 'prime'), 'w').close()\n",
        "os.fsync(dfd)\n",
        "def put(name, data):\n",
        "    fd = os.open(os.path.join(d, name), os.O_CREAT | os.O_WRONLY, 0o644)\n",
        "    os.write(fd, data)\n",
        "    os.fsync(fd)\n",
        "    os.close(fd)\n",
        "put('gone', b'g' * 100)\n",
        "put('old', b'1' * 8192)\n",
        "put('cut', b'c' * 8192)\n",
        "put('from', b'f' * 10)\n",
        "os.mkdir(os.path.join(d, 'sub'))\n",
        "os.fsync(dfd)\n",
        "put('old', b'1' * 8192)\n",
        "put('cut', b'c' * 8192)",
    ));
    let tab = Table::open(&pmstack::front::paths(&root).1).unwrap();
    let c = proc_counters(&tab, pid);
    assert!(
        c[P_NS_OPS] >= 5 && c[P_ABSORBED_FSYNC] >= 2 && c[P_UNSERVED] == 0,
        "the changes before the daemon's death were not logged: {c:?}"
    );
    s.kill9();
    tab.w(H_HEARTBEAT).store(0, Relaxed);
    a.exec(concat!(
        "os.unlink(os.path.join(d, 'gone'))\n",
        "os.rename(os.path.join(d, 'from'), os.path.join(d, 'to'))\n",
        "os.rmdir(os.path.join(d, 'sub'))\n",
        "os.fsync(dfd)\n",
        "fd = os.open(os.path.join(d, 'old'), os.O_WRONLY)\n",
        "os.write(fd, b'2' * 8192)\n",
        "os.close(fd)\n",
        "fd = os.open(os.path.join(d, 'cut'), os.O_WRONLY)\n",
        "os.ftruncate(fd, 100)\n",
        "os.close(fd)",
    ));
    assert!(proc_counters(&tab, pid)[P_UNSERVED] > 0);
    drop(a);
    // Recovery of the log from before the death.
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    assert!(!root.join("gone").exists(), "the unlinked file is back");
    assert!(
        !root.join("from").exists(),
        "the renamed file is back at its old name"
    );
    assert_eq!(fs::read(root.join("to")).unwrap(), vec![b'f'; 10]);
    assert!(!root.join("sub").exists(), "the removed directory is back");
    assert_eq!(
        fs::read(root.join("old")).unwrap(),
        vec![b'2'; 8192],
        "the overwrite was undone"
    );
    assert_eq!(
        fs::metadata(root.join("cut")).unwrap().len(),
        100,
        "the truncate was undone"
    );
    drop(s);
}

/// A truncate into a block of a file with no live entries: ext4 -o dax zeroes the tail of the
/// new last block in place before its journal commits the new size, so a power cut in between
/// leaves the old size with a zeroed tail (`tests/vm/rig` saw it under `pmstack run`: an
/// in-flight truncate to 2,503 bytes left a 20,480-byte file whose first page ended in
/// zeros). The truncate is logged before it reaches the lower, and recovery completes it. The
/// lower's torn state is made here by hand, after a kill -9 of the program and the daemon. A
/// truncate to a block boundary is one transaction of the lower's journal and is not logged:
/// the lower keeps it whole or not at all.
#[test]
fn a_truncate_into_a_block_that_the_lower_tore_is_completed_by_recovery() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let (_d, root, old) = truncates_cut(
        &["--all-writers-attached"],
        concat!(
            "fd = os.open(os.path.join(d, 'torn'), os.O_WRONLY)\n",
            "os.ftruncate(fd, 2503)\n",
            "fd2 = os.open(os.path.join(d, 'aligned'), os.O_WRONLY)\n",
            "os.ftruncate(fd2, 8192)",
        ),
        // The aligned truncate as a cut before its commit leaves it: not made.
        &[("torn", Some(2503)), ("aligned", None)],
    );
    assert_eq!(
        fs::read(root.join("torn")).unwrap(),
        old[..2503],
        "recovery left the truncate the lower tore half made"
    );
    assert_eq!(
        fs::read(root.join("aligned")).unwrap(),
        old,
        "a truncate to a block boundary was logged (the lower keeps it whole or not at all)"
    );
}

/// Files of 20,480 bytes made and synced outside `pmstack run` (and closed: a writer the
/// daemon does not see would rightly keep them unlogged), then truncated by `code` (Python,
/// the root in `d`) under a daemon started with `serve_args` (and no write-back). The program
/// and the daemon are killed; each file of `files` is then left as ext4 -o dax leaves a
/// truncate to `Some(len)` cut before its commit (the old size, the new last block zeroed from
/// the new end, the blocks after it as they were), or with its old bytes (`None`); and the
/// daemon started again recovers. Returns the directory (removed on drop), the root and the
/// old bytes.
fn truncates_cut(
    serve_args: &[&str],
    code: &str,
    files: &[(&str, Option<usize>)],
) -> (tempfile::TempDir, PathBuf, Vec<u8>) {
    let mut args = vec!["--flush-interval-ms", "3600000"];
    args.extend_from_slice(serve_args);
    let (d, root, pm, mut s) = serve_with(&args);
    let old: Vec<u8> = (0..20480u32).map(|i| (i % 251) as u8 + 1).collect();
    for (name, _) in files {
        let mut f = fs::File::create(root.join(name)).unwrap();
        f.write_all(&old).unwrap();
        f.sync_all().unwrap();
    }
    fs::File::open(&root).unwrap().sync_all().unwrap();
    let mut a = Py::spawn(s.run(), &root);
    a.exec(code);
    s.kill9();
    drop(a);
    for (name, len) in files {
        let mut now = old.clone();
        if let Some(len) = len {
            now[*len..(*len).next_multiple_of(4096)].fill(0);
        }
        fs::write(root.join(name), &now).unwrap();
    }
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    drop(s);
    (d, root, old)
}

/// The same truncate under a daemon that watches for writers outside `pmstack run` (its
/// default), of a file the program opened just before: an object the daemon has not vetted
/// yet, about which nothing may be logged until it has (a writer from before the watch could
/// be rolled back by replay). The truncate went to the lower alone, and the VM rig lost the
/// tail of an acknowledged page to it (seed 1925517903, `r-devdax`: a file idle since its
/// last write-back, unwatched at its close, truncated to 2,482 bytes by its next opener).
/// The library now has the object vetted first and logs the truncate.
#[test]
fn a_truncate_into_a_block_of_a_file_not_yet_vetted_is_completed_by_recovery() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    // Through a descriptor, by path, and by path through syscall(2), by a program that syncs
    // (so its truncates are worth a record), of files it opens just before (the daemon vets
    // at most every 10 ms) or never opened.
    let names = ["torn", "by-path", "by-syscall"];
    let (_d, root, old) = truncates_cut(
        &[],
        concat!(
            "import ctypes\n",
            "dfd = os.open(d, os.O_RDONLY)\n",
            "os.fsync(dfd)\n",
            "fd = os.open(os.path.join(d, 'torn'), os.O_WRONLY)\n",
            "os.ftruncate(fd, 2482)\n",
            "os.truncate(os.path.join(d, 'by-path'), 2482)\n",
            "lc = ctypes.CDLL(None, use_errno=True)\n",
            "L = ctypes.c_long\n",
            "assert lc.syscall(L(76), ctypes.c_char_p(os.path.join(d, 'by-syscall').encode()), L(2482)) == 0",
        ),
        &names.map(|n| (n, Some(2482))),
    );
    for name in names {
        assert_eq!(
            fs::read(root.join(name)).unwrap(),
            old[..2482],
            "{name}: recovery left the truncate the lower tore half made"
        );
    }
}

/// An O_SYNC write is logged before it reaches the lower; when the lower then takes only part
/// of it (a short write) or none (an error), the record must not stand: replayed after a
/// crash, it wrote bytes the program was told were not written, past a file size limit here
/// (RLIMIT_FSIZE: the kernel writes up to the limit, then fails with EFBIG).
#[test]
fn bytes_a_write_did_not_write_are_never_replayed() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let (_d, root, pm, mut s) = quiet_serve();
    let mut a = Py::spawn(s.run(), &root);
    a.exec(concat!(
        "import resource, signal, errno\n",
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n",
        "resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))\n",
        "fd = os.open(os.path.join(d, 'f'), os.O_WRONLY | os.O_CREAT | os.O_SYNC, 0o644)\n",
        "assert os.pwrite(fd, b'a' * 4096, 0) == 4096\n",
        "assert os.pwrite(fd, b'b' * 8192, 4096) == 4096\n",
        "try:\n",
        "    os.pwrite(fd, b'c' * 4096, 8192)\n",
        "    raise SystemExit('a write past the limit succeeded')\n",
        "except OSError as e:\n",
        "    assert e.errno == errno.EFBIG, e",
    ));
    s.kill9();
    drop(a);
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    let mut want = vec![b'a'; 4096];
    want.extend_from_slice(&[b'b'; 4096]);
    let got = fs::read(root.join("f")).unwrap();
    assert!(
        got == want,
        "replay wrote bytes the lower refused: {} bytes ({} 'b', {} 'c'), want 4096 'a' then 4096 'b'",
        got.len(),
        got.iter().filter(|&&b| b == b'b').count(),
        got.iter().filter(|&&b| b == b'c').count(),
    );
}

/// A write logged before it reaches the lower (an O_DSYNC write) whose thread is preempted
/// between its record and the write itself: the daemon's write-back must not expire the
/// record meanwhile. Its syncfs ran before the write, so a checkpoint past the record was
/// not earned; a power cut then lost the acknowledged write. The write-back now waits for
/// operations in flight (`client::InFlight`, `Daemon::wait_in_flight`). The preemption is a
/// pause the library takes on a test hook; the daemon writes back every 20 ms. While the
/// write is paused, the daemon is frozen and everything killed: the record must still be
/// live, and recovery shows the write whole.
#[test]
fn a_write_back_never_expires_a_record_whose_write_has_not_happened() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    // Write-backs every 20 ms while the write waits between its record and the lower.
    stalled_write_survives(|_| std::thread::sleep(Duration::from_millis(500)));
}

/// The same write stalled for longer than a write-back waits (5 s): the write-back gives up
/// (`writeback_errors`), expiring nothing, and so do the ones after it, although the phase
/// they wait for has moved on.
#[test]
fn a_write_back_that_gives_up_on_a_stalled_write_expires_nothing() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    stalled_write_survives(|s| {
        s.wait_stats("a write-back gave up", |v| {
            v["writeback_errors"].as_u64() >= Some(1)
        });
        // The next write-backs (every 20 ms) must wait for both phases: one that waited only
        // for the phase after the flip would pass the stalled record.
        std::thread::sleep(Duration::from_millis(300));
    });
}

/// An O_DSYNC write stalled (the test hook) between its record and the lower while the
/// daemon writes back every 20 ms; `meanwhile` runs during the stall, then the daemon is
/// frozen and everything killed: the record must still be live (recovery replays it) and
/// the write shows whole.
fn stalled_write_survives(meanwhile: impl FnOnce(&Serve)) {
    let (_d, root, pm, mut s) =
        serve_with(&["--flush-interval-ms", "20", "--all-writers-attached"]);
    let code = "import os, sys\nfd = os.open(os.path.join(sys.argv[1], 'f'), os.O_WRONLY | os.O_CREAT | os.O_DSYNC, 0o644)\nprint('start', flush=True)\nos.pwrite(fd, b'n' * 4096, 0)\nprint('written', flush=True)\n";
    let mut p = piped(
        s.run()
            .env("PMSTACK_TEST_PAUSE_LOGGED_WRITE_MS", "60000")
            .args(["python3", "-c", code])
            .arg(&root),
    );
    assert_eq!(p.line(), "start");
    meanwhile(&s);
    s.freeze();
    drop(p);
    s.kill9();
    let out = Command::new(common::bin())
        .args(["recover", "--pm"])
        .arg(&pm)
        .arg(&root)
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    let ops: u64 = said
        .split(" file ops")
        .next()
        .and_then(|h| h.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no file ops count in: {said}"));
    assert!(
        ops >= 1,
        "the write's record was expired before the write happened: {said}"
    );
    assert_eq!(
        fs::read(root.join("f")).unwrap(),
        vec![b'n'; 4096],
        "{said}"
    );
}

#[test]
fn daemon_death_makes_programs_fall_back_and_finish() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    fs::write(d.path().join("pre-A"), vec![b'p'; 20000]).unwrap();
    let pm = d.path().join("region.pm");
    let mut s = Serve::start(d.path(), &pm, &["--flush-interval-ms", "3600000"]);
    let acks = Arc::new(Mutex::new(Acks::default()));
    // Paced, so the program runs well past the daemon's death (2 s heartbeat timeout).
    let (mut k, reader) = spawn_load(&s, "A", 3000, 0.0015, &acks, 0);
    while acks.lock().unwrap().ready < 1 {
        std::thread::sleep(Duration::from_millis(10));
    }
    writeln!(k.stdin.as_mut().unwrap(), "go").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let before = acks.lock().unwrap().rec.values().sum::<i64>();
    s.kill9();
    // The program notices (heartbeat), its syncs become the lower file system's, it finishes.
    let st = exited_within(
        &mut k,
        Duration::from_secs(120),
        "program hung after the daemon died",
    );
    assert!(st.success());
    reader.join().unwrap();
    let acks = std::mem::take(&mut *acks.lock().unwrap());
    assert_eq!(acks.done, 1);
    assert!(acks.rec.values().sum::<i64>() > before);
    // Its syncs after the daemon died were the lower file system's own (counted in the
    // shared table, which outlives the daemon): more than the first sync of each file.
    let t = pmstack::front::table::Table::open(
        &pmstack::front::paths(&fs::canonicalize(d.path()).unwrap()).1,
    )
    .unwrap();
    let real = proc_counters(&t, k.id() as u64)[pmstack::front::table::P_FALLBACKS];
    assert!(real > 100, "only {real} real syncs after the daemon died");
    // The region still holds entries from before the death; a new daemon recovers them and
    // must not roll back what the program synced for real afterwards.
    let mut s2 = Serve::start(d.path(), &pm, &[]);
    s2.stop();
    verify(&fs::canonicalize(d.path()).unwrap(), &acks, &["A"], 0);
    for t in 0..THREADS {
        let len = fs::metadata(d.path().join(format!("f-A-{t}")))
            .unwrap()
            .len();
        assert_eq!(len, 2999 * REC + rec_len(t, 2999) as u64, "thread {t} file");
    }
}

/// Python helpers for the watch: `wait_vetted(n)` waits until `n` objects were vetted (the
/// daemon, or the library at the open, ruled out writers outside `pmstack run` that opened
/// them before they were watched: `F_VETTED`), so the first sync after that logs the file
/// whole or is real, and sets the baseline, and later ones are absorbed. It counts vetted
/// objects (`objects_vetted`, `vetted_at_open`), not marks looked at (`marks_vetted`): a look
/// whose vetting was voided (the object unmarked or spawning in between) moves the ring on
/// but vets nothing. `expect_syncs()` syncs the root directory,
/// so that the files the process opens for writing from then on are marked for the watch at
/// once (`Client::sync_expected`); the directory itself is not marked.
const WAIT_VETTED: &str = "def expect_syncs():\n    fd = os.open(d, os.O_RDONLY)\n    os.fsync(fd)\n    os.close(fd)\ndef wait_vetted(n):\n    import json, time\n    t0, v = time.time(), None\n    while time.time() - t0 < 60:\n        try:\n            with open(os.environ['PMSTACK_TEST_STATS']) as f:\n                v = json.load(f)\n            if v.get('objects_vetted', 0) + v.get('vetted_at_open', 0) >= n:\n                return\n        except (OSError, ValueError):\n            pass\n        time.sleep(0.05)\n    sys.exit(f'{n} objects not vetted in 60 s: {v}')\n";

/// Each case the library cannot follow: (name, prelude makes the file's entries live, code
/// run right after `f` is opened, code that changes bytes 100..200 of `f` through the unseen
/// path and syncs, absorbed syncs, real syncs). Absorbed: the file's first sync (it logs the
/// file whole: `Client::log_baseline`) and the prelude's. Real: one when a writer the library
/// cannot see appears while the file has live entries (mmap, stdio), and the sync after the
/// unseen write.
const FALLBACK_CASES: &[(&str, bool, &str, &str, u64, u64)] = &[
    (
        "mmap",
        true,
        "",
        "import mmap\nm = mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)\nm[100:200] = NEW[:100]\nos.fsync(fd)",
        3,
        2,
    ),
    (
        "copy_file_range",
        true,
        "",
        "src = os.open(os.path.join(d, 'src'), os.O_RDWR | os.O_CREAT)\nos.pwrite(src, NEW[:100], 0)\nos.copy_file_range(src, fd, 100, 0, 100)\nos.fsync(fd)",
        3,
        // Live entries are expired by a real sync before the kernel copies; the next
        // sync is real too.
        2,
    ),
    (
        "sendfile",
        true,
        "",
        "src = os.open(os.path.join(d, 'src'), os.O_RDWR | os.O_CREAT)\nos.pwrite(src, NEW[:100], 0)\nos.lseek(fd, 100, 0)\nos.sendfile(fd, src, 0, 100)\nos.fsync(fd)",
        3,
        // Live entries are expired by a real sync before the kernel copies; the next
        // sync is real too.
        2,
    ),
    // A read-only shared mapping of the file (opened for writing) made writable by mprotect.
    (
        "mprotect",
        true,
        "",
        "import ctypes\nlc = ctypes.CDLL(None, use_errno=True)\nlc.mmap.restype = ctypes.c_void_p\nlc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\np = lc.mmap(None, 8192, 1, 1, fd, 0)\nassert p and p != 2**64 - 1\nlc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\nassert lc.mprotect(p, 8192, 3) == 0\nctypes.memmove(p + 100, NEW[:100], 100)\nos.fsync(fd)",
        3,
        2,
    ),
    // The same, the read-only mapping moved by mremap before mprotect makes it writable.
    (
        "mremap",
        true,
        "",
        "import ctypes\nlc = ctypes.CDLL(None, use_errno=True)\nlc.mmap.restype = ctypes.c_void_p\nlc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\nlc.mremap.restype = ctypes.c_void_p\nlc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]\np = lc.mmap(None, 4096, 1, 1, fd, 0)\nassert p and p != 2**64 - 1\nq = lc.mremap(p, 4096, 8192, 1)\nassert q and q != 2**64 - 1\nlc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\nassert lc.mprotect(q, 8192, 3) == 0\nctypes.memmove(q + 100, NEW[:100], 100)\nos.fsync(fd)",
        3,
        2,
    ),
    // The same, made writable by a forked child (which has the parent's mappings): the
    // parent's sync after the child's stores is real.
    (
        "mprotect_in_a_child",
        true,
        "",
        "import ctypes\nlc = ctypes.CDLL(None, use_errno=True)\nlc.mmap.restype = ctypes.c_void_p\nlc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\nlc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\np = lc.mmap(None, 8192, 1, 1, fd, 0)\nassert p and p != 2**64 - 1\npid = os.fork()\nif pid == 0:\n    ok = lc.mprotect(p, 8192, 3) == 0\n    if ok:\n        ctypes.memmove(p + 100, NEW[:100], 100)\n    os._exit(0 if ok else 1)\nassert os.waitpid(pid, 0)[1] == 0\nos.fsync(fd)",
        3,
        1,
    ),
    // The same paths taken through syscall(2), as programs written before the C library had
    // a wrapper do.
    (
        "copy_file_range_syscall",
        true,
        "",
        "import ctypes\nlc = ctypes.CDLL(None, use_errno=True)\nsrc = os.open(os.path.join(d, 'src'), os.O_RDWR | os.O_CREAT)\nos.pwrite(src, NEW[:100], 0)\noi = ctypes.c_int64(0)\noo = ctypes.c_int64(100)\nL = ctypes.c_long\nassert lc.syscall(L(326), L(src), ctypes.byref(oi), L(fd), ctypes.byref(oo), L(100), L(0)) == 100\nos.fsync(fd)",
        3,
        2,
    ),
    (
        "mmap_syscall",
        true,
        "",
        "import ctypes\nlc = ctypes.CDLL(None, use_errno=True)\nlc.syscall.restype = ctypes.c_long\nL = ctypes.c_long\np = lc.syscall(L(9), None, L(8192), L(3), L(1), L(fd), L(0))\nassert p > 0\nctypes.memmove(p + 100, NEW[:100], 100)\nos.fsync(fd)",
        3,
        2,
    ),
    (
        "stdio",
        true,
        "",
        "import ctypes\nlc = ctypes.CDLL(None)\nlc.fopen.restype = ctypes.c_void_p\nfp = lc.fopen(os.path.join(d, 'f').encode(), b'r+')\nlc.fseek(ctypes.c_void_p(fp), 100, 0)\nlc.fwrite(NEW[:100], 1, 100, ctypes.c_void_p(fp))\nlc.fflush(ctypes.c_void_p(fp))\nos.fsync(fd)",
        3,
        2,
    ),
    // Another process's writes not yet logged (the file has no live entries, so they are
    // lazy): this process's fsync must cover them, as the kernel's would.
    (
        "other_process",
        false,
        // Its first sync real (the truncate is not logged: the object has no live entries
        // and the lower cannot tear it), so that the other process's writes are not logged.
        "os.ftruncate(fd, 1 << 20)\n",
        // The writer stays alive until the sync returned: once it exits, the daemon may write
        // back what it wrote before the sync, which is then absorbed.
        "r, w = os.pipe()\nr2, w2 = os.pipe()\npid = os.fork()\nif pid == 0:\n    g = os.open(os.path.join(d, 'f'), os.O_RDWR)\n    os.pwrite(g, OLD, 0)\n    os.pwrite(g, NEW[:100], 100)\n    os.write(w, b'x')\n    os.read(r2, 1)\n    os._exit(0)\nos.read(r, 1)\nos.fsync(fd)\nos.write(w2, b'x')\nos.waitpid(pid, 0)",
        0,
        2,
    ),
];

#[test]
fn every_unseen_write_path_gets_a_real_sync_and_is_never_rolled_back() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    for (name, live, opened, code, absorbed, real) in FALLBACK_CASES {
        let d = tempfile::tempdir_in("/var/tmp").unwrap();
        let pm = d.path().join("region.pm");
        let root = fs::canonicalize(d.path()).unwrap();
        // `f` exists before: it is watched from the open (after `expect_syncs`), not from its
        // birth, and vetted at the open.
        fs::write(root.join("f"), b"").unwrap();
        let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
        let prelude = if *live {
            "os.pwrite(fd, OLD, 0)\nos.fsync(fd)\nos.pwrite(fd, OLD[:10], 0)\nos.fsync(fd)\n"
        } else {
            ""
        };
        let script = format!(
            "import os, sys, time\n{WAIT_VETTED}d = sys.argv[1]\nOLD = b'o' * 8192\nNEW = b'n' * 8192\n\
             expect_syncs()\nfd = os.open(os.path.join(d, 'f'), os.O_RDWR | os.O_CREAT, 0o644)\n{opened}\
             wait_vetted(1)\nos.fsync(fd)\n{prelude}{code}\nprint('synced', flush=True)\ntime.sleep(30)\n"
        );
        let mut k = s
            .run()
            .arg("python3")
            .arg("-c")
            .arg(&script)
            .arg(&root)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(k.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "synced", "{name}: the script failed");
        let (p, st) = s.wait_real_syncs(name, k.id() as u64, *real);
        assert_eq!(p["real_syncs"], *real, "{name}: {st}");
        assert_eq!(p["absorbed_fsync"], *absorbed, "{name}: {st}");
        // Kill everything; recovery replays the entries of the absorbed syncs, which are
        // older than the unseen write: the real sync must have expired them.
        let _ = k.kill();
        let _ = k.wait();
        s.kill9();
        let mut s2 = Serve::start(&root, &pm, &[]);
        s2.stop();
        let got = fs::read(root.join("f")).unwrap();
        assert_eq!(
            &got[100..200],
            &[b'n'; 100][..],
            "{name}: rolled back by replay"
        );
        assert_eq!(&got[..100], &[b'o'; 100][..], "{name}");
    }
}

fn sha(dir: &Path) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for e in walk(dir) {
        let rel = e.strip_prefix(dir).unwrap().to_string_lossy().to_string();
        let md = fs::symlink_metadata(&e).unwrap();
        let v = if md.is_file() {
            format!("{:08x}", crc32c::crc32c(&fs::read(&e).unwrap()))
        } else if md.is_dir() {
            "dir".into()
        } else {
            format!("link {:?}", fs::read_link(&e).ok())
        };
        m.insert(rel, v);
    }
    m
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for e in fs::read_dir(d).unwrap().flatten() {
        let p = e.path();
        if e.file_name().to_string_lossy().starts_with(".pmstack") {
            continue;
        }
        if e.file_type().unwrap().is_dir() {
            v.extend(walk(&p));
        }
        v.push(p);
    }
    v
}

/// The same commands natively in `plain` and under `pmstack run` in the served `root`; the
/// trees and outputs must be identical.
fn same_results(name: &str, sh: &str, exclude: &[&str]) {
    let plain = tempfile::tempdir_in("/var/tmp").unwrap();
    let served = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(served.path()).unwrap();
    let pm = plain.path().with_extension("pm");
    let mut s = Serve::start(&root, &pm, &[]);
    let a = Command::new("sh")
        .arg("-c")
        .arg(sh)
        .current_dir(plain.path())
        .output()
        .unwrap();
    assert!(
        a.status.success(),
        "{name} natively: {}",
        String::from_utf8_lossy(&a.stderr)
    );
    let b = s
        .run()
        .arg("sh")
        .arg("-c")
        .arg(sh)
        .current_dir(&root)
        .output()
        .unwrap();
    assert!(
        b.status.success(),
        "{name} under pmstack run: {}",
        String::from_utf8_lossy(&b.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&a.stdout),
        String::from_utf8_lossy(&b.stdout),
        "{name}: outputs differ"
    );
    let st = s.wait_stats(name, |v| v["attaches"].as_u64().is_some_and(|n| n > 0));
    // Every number the daemon reports has one definition (name, unit, help), and every
    // number defined for a served directory is reported.
    assert_eq!(
        pmstack::metrics::undefined_numbers(&st),
        Vec::<String>::new(),
        "{st}"
    );
    for m in pmstack::metrics::METRICS.iter() {
        if m.source != pmstack::metrics::Source::Mount && !m.name.contains('.') {
            assert!(
                st.get(m.name).is_some() || st["totals"].get(m.name).is_some(),
                "{} is defined but serve does not report it: {st}",
                m.name
            );
        }
    }
    s.stop();
    let keep = |m: BTreeMap<String, String>| -> BTreeMap<String, String> {
        m.into_iter()
            .filter(|(k, _)| {
                !exclude
                    .iter()
                    .any(|x| k == x || k.starts_with(&format!("{x}/")))
            })
            .collect()
    };
    let (x, y) = (keep(sha(plain.path())), keep(sha(&root)));
    let diff: Vec<String> = x
        .keys()
        .chain(y.keys())
        .filter(|k| x.get(*k) != y.get(*k))
        .map(|k| format!("{k}: {:?} vs {:?}", x.get(k), y.get(k)))
        .collect();
    assert!(diff.is_empty(), "{name}: trees differ: {diff:?} ({st})");
    let _ = fs::remove_file(&pm);
}

/// Write calls given memory the program cannot read (never mapped, or a buffer running into
/// an unmapped page, or an iovec array or buffer that is) get EFAULT or the short write the
/// kernel gives natively, and the files end the same; the library never dereferences them
/// itself (it crashed the program with SIGSEGV on an O_SYNC file or a writev).
#[test]
fn writes_from_memory_the_program_cannot_read_fail_as_natively() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/preload/bad_buffers.py");
    same_results("bad buffers", &format!("python3 {}", script.display()), &[]);
}

#[test]
fn sqlite_gives_the_same_results_under_pmstack_run() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    for mode in ["DELETE", "WAL"] {
        same_results(
            &format!("sqlite {mode}"),
            &format!(
                "python3 -c \"
import sqlite3
c = sqlite3.connect('t.db', isolation_level=None)
c.execute('PRAGMA journal_mode={mode}'); c.execute('PRAGMA synchronous=FULL')
c.execute('create table t(k integer primary key, v text)')
for i in range(300):
    c.execute('begin'); c.execute('insert into t values(?, ?)', (i, 'v%d' % i * 20)); c.execute('commit')
for i in range(0, 300, 7):
    c.execute('update t set v = ? where k = ?', ('u%d' % i, i))
c.execute('delete from t where k % 5 = 0')
print(c.execute('select count(*), sum(length(v)) from t').fetchone())
c.execute('PRAGMA wal_checkpoint(TRUNCATE)') if '{mode}' == 'WAL' else None
c.close()
\""
            ),
            &[],
        );
    }
}

#[test]
fn shell_tools_give_the_same_results_under_pmstack_run() {
    if !common::can_mount() {
        return;
    }
    same_results(
        "cp mv tar",
        "set -e; mkdir -p src/sub; for i in $(seq 1 40); do \
         printf 'line %s\\n' $(seq 1 $i) > src/f$i; done; printf x > src/sub/y; ln -s f1 src/l; \
         cp -a src copy; mv copy/f2 copy/sub/f2; tar --mtime=@0 --sort=name --owner=0 --group=0 -cf a.tar src; mkdir out; tar -xf a.tar -C out; \
         cat src/f40 >> out/src/f1; sync; ls -R | wc -l",
        &[],
    );
}

#[test]
fn fio_and_db_bench_give_the_same_results_under_pmstack_run() {
    if !common::can_mount() || !have("fio") {
        return;
    }
    // fio with fsync=1 writes blocks with verify headers (which hold timestamps, so the
    // files are not compared) and reads every one back checking its checksum.
    same_results(
        "fio",
        "fio --name=w --directory=. --rw=randwrite --bs=4k --size=8m --fsync=1 --ioengine=psync \
         --randseed=7 --verify=crc32c --do_verify=1 --verify_fatal=1 --output=/dev/null && echo fio-ok",
        &["w.0.0"],
    );
    if have("db_bench") && have("ldb") {
        // The database's files hold timestamps and ids; its content is compared instead.
        same_results(
            "db_bench",
            "db_bench --benchmarks=fillrandom,overwrite --sync=1 --num=2000 --db=db --seed=7 \
             --compression_type=none --threads=1 > /dev/null && ldb --db=db scan | cksum",
            &["db"],
        );
    }
}

/// A process that cannot attach (here: every append area is leased) still runs, natively; the
/// files it writes are marked in the shared table, so an attached process's fsync of them is
/// the lower file system's own, which covers the unattached writes.
#[test]
fn a_process_that_cannot_attach_makes_syncs_of_what_it_writes_real() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = root.join("region.pm");
    // `pmstack format` makes 16 areas; the daemon keeps 8: room for 8 attached processes.
    let st = Command::new(common::bin())
        .args(["format", "--size", "64M", "--pm"])
        .arg(&pm)
        .arg("--lower")
        .arg(&root)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    fs::write(root.join("f"), b"").unwrap(); // watched from the open, not its birth
    let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    // Holder 0 opens f, makes its first sync, then waits; holders 1..7 take the rest
    // of the areas (their files are new: watched from their birth, never vetted).
    let holder = format!(
        "import os, sys\n{WAIT_VETTED}d, k = sys.argv[1], sys.argv[2]\n\
         expect_syncs()\nfd = os.open(os.path.join(d, 'f' if k == '0' else 'h' + k), os.O_RDWR | os.O_CREAT, 0o644)\n\
         if k == '0':\n    wait_vetted(1)\nos.pwrite(fd, b'o' * 100, 0)\nos.fsync(fd)\nprint('ready', flush=True)\n\
         sys.stdin.readline()\nos.fsync(fd)\nprint('synced', flush=True)\nsys.stdin.readline()\n"
    );
    let mut holders: Vec<(Child, BufReader<std::process::ChildStdout>)> = (0..8)
        .map(|k| {
            let mut c = s
                .run()
                .args(["python3", "-c", &holder])
                .arg(&root)
                .arg(k.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut out = BufReader::new(c.stdout.take().unwrap());
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            assert_eq!(line.trim(), "ready", "holder {k}");
            (c, out)
        })
        .collect();
    s.wait_stats("eight attached", |v| {
        v["attached"].as_array().is_some_and(|a| a.len() == 8)
    });
    // The ninth process finds no free area: it writes f natively.
    let st = s
        .run()
        .args([
            "python3",
            "-c",
            "import os, sys\nfd = os.open(os.path.join(sys.argv[1], 'f'), os.O_RDWR)\nos.pwrite(fd, b'n' * 100, 0)\n",
        ])
        .arg(&root)
        .env("PMSTACK_DEBUG", "1")
        .output()
        .unwrap();
    assert!(st.status.success());
    assert!(
        String::from_utf8_lossy(&st.stderr).contains("cannot attach"),
        "the ninth process attached after all: {}",
        String::from_utf8_lossy(&st.stderr)
    );
    // Holder 0 syncs f: it must be real (its first sync logged f whole, absorbed).
    let (c0, out0) = &mut holders[0];
    writeln!(c0.stdin.as_mut().unwrap(), "go").unwrap();
    let mut line = String::new();
    out0.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "synced");
    let (p, v) = s.wait_real_syncs("holder 0 synced", c0.id() as u64, 1);
    assert_eq!(p["absorbed_fsync"], 1, "{v}");
    assert_eq!(p["real_syncs"], 1, "{v}");
    for (mut c, _) in holders {
        let _ = c.kill();
        let _ = c.wait();
    }
    s.stop();
    assert_eq!(fs::read(root.join("f")).unwrap(), vec![b'n'; 100]);
}

/// A process's record is cleaned without sweeping every slot of the table only when the
/// process holds nothing (`H_MAY_HOLD`): one killed while it holds a file open leaves no
/// holder bit behind once the daemon cleaned its record (else the next process given that
/// record would seem to hold the file), and one that closed what it opened holds nothing.
#[test]
fn a_process_killed_holding_a_file_leaves_no_holder_and_one_that_closed_holds_nothing() {
    use pmstack::front::table::*;
    use std::os::unix::fs::MetadataExt;
    use std::sync::atomic::Ordering;
    let Some((_d, root, _pm, mut s)) = served_tmp("mayhold", &[]) else {
        return;
    };
    let tab = Table::open(&pmstack::front::paths(&s.dir).1).unwrap();
    let record_of =
        |pid: u64| (0..MAX_PROCS).find(|&i| tab.proc_word(i, P_PID).load(Ordering::Acquire) == pid);
    let holders_of = |name: &str| {
        let md = fs::metadata(root.join(name)).unwrap();
        let slot = tab.find(md.dev(), md.ino()).expect("the file has a slot");
        tab.slot(slot).holders().collect::<Vec<_>>()
    };
    // Opens `name` for writing, says so, and with `close` closes it and says so again; then
    // waits for its stdin to end.
    let script = "import os, sys\nfd = os.open(os.path.join(sys.argv[1], sys.argv[2]), os.O_WRONLY | os.O_CREAT, 0o644)\n\
                  print('open', flush=True)\nif sys.argv[3] == 'close':\n    os.close(fd)\n    print('closed', flush=True)\n\
                  sys.stdin.read()\n";
    let start = |name: &str, close: bool| {
        let mut c = s
            .run()
            .args(["python3", "-c", script])
            .arg(&root)
            .args([name, if close { "close" } else { "keep" }])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(c.stdout.take().unwrap());
        for want in ["open"].into_iter().chain(close.then_some("closed")) {
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            assert_eq!(line.trim(), want, "{name}");
        }
        c
    };
    let mut kept = common::Reaped(vec![start("held", false)]);
    let pid = kept.0[0].id() as u64;
    let rec = record_of(pid).expect("the holder is attached");
    assert!(tab.may_hold(rec), "a holder's record says it may hold");
    assert_eq!(holders_of("held"), vec![rec]);
    let _ = kept.0[0].kill();
    let _ = kept.0[0].wait();
    // The daemon frees the record of a reaped process within a round or two.
    let t0 = Instant::now();
    while record_of(pid) == Some(rec) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "record {rec} never freed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        holders_of("held").is_empty(),
        "the killed holder still holds its file"
    );
    assert!(!tab.may_hold(rec));
    let closer = start("closed", true);
    let crec = record_of(closer.id() as u64).expect("the closer is attached");
    assert!(holders_of("closed").is_empty());
    assert!(
        !tab.may_hold(crec),
        "a process that closed all it held may hold nothing"
    );
    drop(common::Reaped(vec![closer]));
    s.stop();
}

/// A program that exits gives its PM area back: one that committed nothing at once, with no
/// write-back; one whose records are live at the next write-back, which comes early only when
/// few areas are left (each exit made one within 200 ms: a syncfs forcing out data nobody
/// asked to be durable, which the kernel would have written later or never). More short
/// programs than the region has areas all attach.
#[test]
fn areas_of_programs_that_exited_come_back_without_a_write_back_per_exit() {
    let Some((_d, root, pm, s)) = served_tmp("areas", &["--flush-interval-ms", "3600000"]) else {
        return;
    };
    fs::write(root.join("x"), b"hi").unwrap();
    let n: u64 = 80; // more than the 64 areas of a region
    let attached = |args: &[String]| {
        let st = s
            .run()
            .args(args)
            .env("PMSTACK_DEBUG", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&st.stderr);
        assert!(st.status.success(), "{args:?}: {err}");
        assert!(
            err.contains("-> true") && !err.contains("cannot attach"),
            "{args:?}: {err}"
        );
    };
    let x = root.join("x").display().to_string();
    // In rounds of 40 (fewer than the free areas), each waiting for the daemon to have taken
    // the areas back: the test does not race the daemon's loop.
    for k in 0..n {
        attached(&["cat".into(), x.clone()]);
        if k % 40 == 39 {
            s.wait_stats("the readers' areas back", |v| {
                v["leases_reclaimed"] == k + 1
            });
        }
    }
    let v = s.wait_stats("the readers' areas back", |v| v["leases_reclaimed"] == n);
    assert_eq!(v["writebacks"], 0, "readers made write-backs: {v}");
    let write = |i: u64| {
        let f = root.join(format!("f{i}")).display().to_string();
        attached(&["sh".into(), "-c".into(), format!("echo a > '{f}'")]);
    };
    for i in 0..10 {
        write(i);
    }
    s.wait_stats("ten writers attached", |v| v["attaches"] == n + 10);
    std::thread::sleep(Duration::from_millis(600));
    let v = s.stats();
    assert_eq!(v["writebacks"], 0, "writers' exits made write-backs: {v}");
    // More writers than the areas left: an early write-back gives theirs back when few are
    // free. Each round of 20 waits for room for 20 (of the region's 64 areas), so that no
    // writer races the daemon's loop.
    for i in 10..n {
        if i % 20 == 10 {
            s.wait_stats("room for 20 writers", |v| {
                v["areas_leased"].as_u64().is_some_and(|l| l <= 64 - 20)
            });
        }
        write(i);
    }
    let v = s.wait_stats("every writer attached", |v| v["attaches"] == 2 * n);
    assert!(v["writebacks"].as_u64().unwrap() >= 1, "{v}");
    drop(s);
    for i in 0..n {
        assert_eq!(fs::read(root.join(format!("f{i}"))).unwrap(), b"a\n");
    }
    let _ = fs::remove_file(&pm);
}

/// A python process driven line by line: each `exec` runs code in one shared namespace.
struct Py {
    c: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Py {
    fn spawn(mut cmd: Command, root: &Path) -> Py {
        let driver = format!(
            "import os, sys, json\n{WAIT_VETTED}d = sys.argv[1]\nfor line in sys.stdin:\n    exec(json.loads(line))\n    print('ok', flush=True)\n"
        );
        let mut c = cmd
            .args(["python3", "-c", &driver])
            .arg(root)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(c.stdout.take().unwrap());
        Py { c, out }
    }

    fn exec(&mut self, code: &str) {
        self.send(code);
        self.done(code);
    }

    /// Create an empty file at `path` under the root (`open(.., 'w')`).
    fn create(&mut self, path: &str) {
        self.exec(&format!("open(os.path.join(d, '{path}'), 'w').close()"));
    }

    /// Remove the file at `path` under the root.
    fn unlink(&mut self, path: &str) {
        self.exec(&format!("os.unlink(os.path.join(d, '{path}'))"));
    }

    /// Remove the directory at `path` under the root.
    fn rmdir(&mut self, path: &str) {
        self.exec(&format!("os.rmdir(os.path.join(d, '{path}'))"));
    }

    /// Start running `code`, without waiting for it (`done`).
    fn send(&mut self, code: &str) {
        let line = serde_json::to_string(code).unwrap();
        writeln!(self.c.stdin.as_mut().unwrap(), "{line}").unwrap();
    }

    /// Wait until the `code` sent last has run.
    fn done(&mut self, code: &str) {
        let mut r = String::new();
        self.out.read_line(&mut r).unwrap();
        assert_eq!(r.trim(), "ok", "python failed on: {code}");
    }

    fn pid(&self) -> u64 {
        self.c.id() as u64
    }
}

impl Drop for Py {
    fn drop(&mut self) {
        let _ = self.c.kill();
        let _ = self.c.wait();
    }
}

/// A read open of a watched file by one thread of a process outside `pmstack run`, while
/// another of its threads is in a write open of something else (a FIFO no one reads), is no
/// writer: the daemon asks the opening thread alone what it opens (`FAN_REPORT_TID`). Before,
/// any thread of the process in a write open made the read count as a write: the file was
/// taken for foreign and its syncs were real (a multithreaded backup or indexer reading
/// watched files; the crash round's snapshot beside another test's writes). A write open by
/// that thread is still a writer.
#[test]
fn a_read_open_beside_another_threads_write_open_is_no_writer() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = shm_region("tidopen");
    // There before: watched from the attached process's open (after `expect_syncs`).
    fs::write(root.join("w"), b"").unwrap();
    let s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let mut a = Py::spawn(s.run(), &root);
    a.exec("expect_syncs()\nfd = os.open(os.path.join(d, 'w'), os.O_RDWR | os.O_CREAT, 0o644)\nwait_vetted(1)");
    a.exec("os.pwrite(fd, b'w' * 4096, 0)\nos.fsync(fd)");
    let fifo = d.path().join("fifo");
    let mut f = Py::spawn(Command::new("env"), &root);
    // A thread blocked in an open of the FIFO for writing (until a reader comes), seen so in
    // /proc before the read open below (openat is 257 on x86_64).
    f.exec(&format!(
        r#"import threading, time
fifo = {fifo:?}
os.mkfifo(fifo)
t = threading.Thread(target=lambda: os.close(os.open(fifo, os.O_WRONLY)), daemon=True)
t.start()
def other_in_open():
    for tid in os.listdir('/proc/self/task'):
        if int(tid) == threading.get_native_id():
            continue
        try:
            line = open(f'/proc/self/task/{{tid}}/syscall').read().split()
        except OSError:
            continue
        if line and line[0] == '257' and int(line[3], 16) & 3 == os.O_WRONLY:
            return True
    return False
t0 = time.time()
while not other_in_open():
    assert time.time() - t0 < 10, 'the writer thread never blocked in its open'
    time.sleep(0.01)
data = open(os.path.join(d, 'w'), 'rb').read()
assert len(data) == 4096"#
    ));
    let v = s.wait_stats("the read open seen", |v| {
        v["watched_opens"].as_u64() >= Some(1)
    });
    assert_eq!(
        v["foreign_writers"], 0,
        "a read open taken for a write: {v}"
    );
    // The writer thread let go, and the same process opens the file for writing: a writer.
    f.exec("r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)\nt.join()\nos.close(r)\nos.unlink(fifo)\ng = os.open(os.path.join(d, 'w'), os.O_WRONLY)\nos.close(g)");
    s.wait_stats("the write open taken for a writer", |v| {
        v["foreign_writers"].as_u64() >= Some(1)
    });
    drop(a);
    drop(f);
    drop(s);
    let _ = fs::remove_file(&pm);
}

#[test]
fn writers_outside_pmstack_run_are_watched_and_never_rolled_back() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = root.join("region.pm");
    // `f` exists before: it is watched from the open (after `expect_syncs`), not its birth.
    fs::write(root.join("f"), b"").unwrap();
    let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let plain = || Command::new("env");
    let counts = |s: &Serve, pid: u64| -> (u64, u64) {
        let p = proc_stats(&s.stats(), pid).unwrap_or_default();
        (
            p["absorbed_fsync"].as_u64().unwrap_or(0),
            p["real_syncs"].as_u64().unwrap_or(0),
        )
    };
    let wait_counts = |s: &Serve, pid: u64, want: (u64, u64)| {
        let t0 = Instant::now();
        while counts(s, pid) != want {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "pid {pid}: (absorbed, real) {:?}, want {want:?}; {}",
                counts(s, pid),
                s.stats()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };

    // 1. A write open after the file is watched. The attached process leaves a live entry
    // over bytes 100..200; a process outside `pmstack run` then overwrites them and syncs
    // natively.
    let mut a = Py::spawn(s.run(), &root);
    a.exec("expect_syncs()\nfd = os.open(os.path.join(d, 'f'), os.O_RDWR | os.O_CREAT, 0o644)\nwait_vetted(1)");
    a.exec(
        "os.pwrite(fd, b'o' * 8192, 0)\nos.fsync(fd)\nos.pwrite(fd, b'a' * 100, 100)\nos.fsync(fd)",
    );
    // Vetted (at the open, or by the daemon first), so its first sync logs it whole.
    wait_counts(&s, a.pid(), (2, 0));
    let v = s.stats();
    assert_eq!(v["baselines_logged"], 1, "{v}");
    // A reader outside is no writer.
    let st = plain().arg("cat").arg(root.join("f")).output().unwrap();
    assert!(st.status.success());
    let mut f = Py::spawn(plain(), &root);
    f.exec(
        "g = os.open(os.path.join(d, 'f'), os.O_RDWR)\nos.pwrite(g, b'n' * 100, 100)\nos.fsync(g)",
    );
    let v = s.wait_stats("the foreign writer is seen", |v| {
        v["foreign_writers"].as_u64() >= Some(1)
    });
    assert_eq!(
        v["foreign_writers"], 1,
        "the reader was taken for a writer: {v}"
    );
    // While it may write, the attached process's syncs are real.
    a.exec("os.pwrite(fd, b'b' * 50, 300)\nos.fsync(fd)");
    wait_counts(&s, a.pid(), (2, 1));
    // Kill everything: recovery must not apply the entry of bytes 100..200 over the foreign
    // writer's durable bytes.
    drop(a);
    drop(f);
    s.kill9();
    let mut s2 = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let got = fs::read(root.join("f")).unwrap();
    assert_eq!(&got[100..200], &[b'n'; 100][..], "rolled back by replay");
    assert_eq!(&got[300..350], &[b'b'; 50][..]);

    // 2. A writer that opened the file before any attached process tracked it (no open
    // event): the daemon's scan finds it; syncs stay real until it is gone, then one more
    // real sync covers what it left, and absorption resumes.
    let mut f = Py::spawn(plain(), &root);
    f.exec("g = os.open(os.path.join(d, 'g'), os.O_RDWR | os.O_CREAT, 0o644)");
    let mut a = Py::spawn(s2.run(), &root);
    a.exec("expect_syncs()\nfd = os.open(os.path.join(d, 'g'), os.O_RDWR)");
    // Vetting g (marked at the open: the process syncs) finds the writer: the daemon's, since
    // the writer's open file kept the library from vetting it at the open.
    let v = s2.wait_stats("the writer from before the mark is found", |v| {
        v["foreign_writers"].as_u64() >= Some(1)
    });
    assert_eq!(v["vetted_at_open"], 0, "{v}");
    a.exec("os.fsync(fd)");
    f.exec("os.pwrite(g, b'z' * 10, 0)");
    a.exec("os.fsync(fd)");
    wait_counts(&s2, a.pid(), (0, 2));
    drop(f);
    // Within a second the daemon finds the writer gone.
    std::thread::sleep(Duration::from_millis(1500));
    a.exec("os.pwrite(fd, b'y' * 10, 20)\nos.fsync(fd)");
    a.exec("os.pwrite(fd, b'x' * 10, 40)\nos.fsync(fd)");
    wait_counts(&s2, a.pid(), (1, 3));
    drop(a);
    s2.stop();
    let got = fs::read(root.join("g")).unwrap();
    assert_eq!(&got[..10], b"zzzzzzzzzz");
    assert_eq!(&got[40..50], b"xxxxxxxxxx");
}

/// A file that existed before, written last by a program outside `pmstack run` that left
/// its bytes in the page cache only, is absorbed from the first sync of an attached program
/// that opens it (a mail server appending to a mailbox, a database opening its file): the
/// library vets it at the open (no other open file of it on the host) and that first sync
/// logs the file whole. A power cut that loses everything the lower did not make durable,
/// then recovery, gives back both programs' bytes, as the lower's own fsync would have kept
/// them. A file over 256 KiB still gets a real first sync. (Before, each such file's first
/// sync after vetting was real, and so was a sync before the daemon had vetted it.)
#[test]
fn an_existing_file_is_absorbed_from_its_first_sync_and_keeps_what_an_earlier_writer_left() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = shm_region("existing");
    fs::write(root.join("mbox"), vec![b'a'; 10_000]).unwrap();
    fs::write(root.join("big"), vec![b'b'; 300 << 10]).unwrap();
    let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let mut a = Py::spawn(s.run(), &root);
    // `a` syncs from now on, so the files it opens for writing are marked at the open.
    a.exec("expect_syncs()");
    assert!(Command::new("sync").status().unwrap().success());
    let durable = snapshot(&root);
    // A program outside `pmstack run` overwrites the head of the mailbox and extends it, and
    // syncs nothing.
    let st = Command::new("python3")
        .arg("-c")
        .arg("import os, sys\nfd = os.open(os.path.join(sys.argv[1], 'mbox'), os.O_RDWR)\nos.pwrite(fd, b'x' * 100, 0)\nos.pwrite(fd, b'y' * 500, 10000)\nos.close(fd)")
        .arg(&root)
        .status()
        .unwrap();
    assert!(st.success());
    let pid = a.pid();
    let counts = |s: &Serve| {
        let v = s.stats();
        let p = proc_stats(&v, pid).unwrap_or_default();
        (
            p["absorbed_fsync"].as_u64().unwrap_or(0),
            p["real_syncs"].as_u64().unwrap_or(0),
            v,
        )
    };
    a.exec("fd = os.open(os.path.join(d, 'mbox'), os.O_RDWR | os.O_APPEND)\nos.write(fd, b'z' * 700)\nos.fsync(fd)\nos.close(fd)");
    let v = s.wait_stats("the mailbox's sync is counted", |v| {
        proc_stats(v, pid).is_some_and(|p| fsyncs(&p) >= 1)
    });
    let (absorbed, real, _) = counts(&s);
    assert_eq!((absorbed, real), (1, 0), "the mailbox's first sync: {v}");
    // Vetted once: by the library at the open, or by the daemon if it woke for the mark and
    // got there first.
    let vetted = |v: &serde_json::Value| {
        v["vetted_at_open"].as_u64().unwrap_or(0) + v["objects_vetted"].as_u64().unwrap_or(0)
    };
    assert_eq!(vetted(&v), 1, "{v}");
    assert_eq!(v["baselines_logged"], 1, "{v}");
    a.exec("g = os.open(os.path.join(d, 'big'), os.O_RDWR | os.O_APPEND)\nos.write(g, b'w' * 10)\nos.fsync(g)\nos.close(g)");
    let v = s.wait_stats("the big file's sync is counted", |v| {
        proc_stats(v, pid).is_some_and(|p| p["real_syncs"].as_u64().unwrap_or(0) >= 1)
    });
    let (absorbed, real, _) = counts(&s);
    assert_eq!(
        (absorbed, real),
        (1, 1),
        "the big file's first sync is real: {v}"
    );
    assert_eq!(v["baselines_logged"], 1, "{v}");
    // Twenty more existing files, each synced right after its open, the first write-only: all
    // absorbed. The daemon's scan, at most one per 10 ms, could not have vetted them all in
    // time; the library vets each at its open (the write-only one gets a descriptor of the
    // library's own to read it through).
    for i in 0..20 {
        fs::write(root.join(format!("m{i}")), vec![b'c'; 1000]).unwrap();
    }
    a.exec("for i in range(20):\n    fd = os.open(os.path.join(d, 'm%d' % i), (os.O_WRONLY if i == 0 else os.O_RDWR) | os.O_APPEND)\n    os.write(fd, b'q' * 10)\n    os.fsync(fd)\n    os.close(fd)");
    let v = s.wait_stats("the twenty syncs are counted", |v| {
        proc_stats(v, pid).is_some_and(|p| fsyncs(&p) >= 22)
    });
    let (absorbed, real, _) = counts(&s);
    assert_eq!((absorbed, real), (21, 1), "syncs right after the open: {v}");
    assert_eq!(v["baselines_logged"], 21, "{v}");
    assert_eq!(vetted(&v), 22, "the mailbox, the big file and twenty: {v}");
    drop(a);
    s.kill9();
    // The power cut: the mailbox as it was last made durable (nothing of it was since: its
    // only sync was absorbed); the big file keeps what its real sync made durable.
    fs::write(root.join("mbox"), &durable["mbox"]).unwrap();
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    let mut want = vec![b'x'; 100];
    want.extend(vec![b'a'; 9_900]);
    want.extend(vec![b'y'; 500]);
    want.extend(vec![b'z'; 700]);
    let got = fs::read(root.join("mbox")).unwrap();
    assert_eq!(got.len(), want.len(), "the mailbox's size after recovery");
    assert!(
        got == want,
        "the mailbox after recovery differs from what was synced"
    );
    let mut big = vec![b'b'; 300 << 10];
    big.extend(vec![b'w'; 10]);
    assert!(fs::read(root.join("big")).unwrap() == big, "the big file");
    let _ = fs::remove_file(&pm);
}

/// Over a FUSE lower (bindfs here; GlusterFS and JuiceFS are FUSE too), whose reads after
/// writes can be slow (JuiceFS uploads what was written before it serves a read of the
/// file), a file vetted at its open is read then, and its first sync logs that snapshot
/// with the process's own unsynced bytes over it, without reading the file back. Not once a
/// record of the object was logged since (here another process's O_SYNC write, which the
/// snapshot and the dirty bytes lack): the file is then read back. A power cut, then
/// recovery, gives back every byte of both.
#[test]
fn over_a_fuse_lower_a_file_read_at_its_open_is_logged_whole_at_its_first_sync() {
    let Some((_d, root, _bind)) = bindfs_root() else {
        return;
    };
    let pm = shm_region("snapshot");
    fs::write(root.join("m1"), vec![b'a'; 8000]).unwrap();
    fs::write(root.join("m2"), vec![b'a'; 8000]).unwrap();
    let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let mut a = Py::spawn(s.run(), &root);
    a.exec("expect_syncs()");
    assert!(Command::new("sync").status().unwrap().success());
    let durable = snapshot(&root);
    let pid = a.pid();
    let absorbed = move |v: &serde_json::Value| {
        proc_stats(v, pid).map_or(0, |p| p["absorbed_fsync"].as_u64().unwrap_or(0))
    };
    a.exec("f1 = os.open(os.path.join(d, 'm1'), os.O_RDWR | os.O_APPEND)\nos.write(f1, b'z' * 700)\nos.fsync(f1)");
    let v = s.wait_stats("m1's sync is absorbed", |v| absorbed(v) >= 1);
    assert_eq!(v["baselines_logged"], 1, "{v}");
    assert_eq!(
        v["baselines_from_snapshots"], 1,
        "m1 from its snapshot: {v}"
    );
    a.exec("f2 = os.open(os.path.join(d, 'm2'), os.O_RDWR | os.O_APPEND)");
    let mut b = Py::spawn(s.run(), &root);
    b.exec(
        "g = os.open(os.path.join(d, 'm2'), os.O_WRONLY | os.O_SYNC)\nos.pwrite(g, b'B' * 50, 0)",
    );
    a.exec("os.write(f2, b'y' * 300)\nos.fsync(f2)");
    let v = s.wait_stats("m2's sync is absorbed", |v| absorbed(v) >= 2);
    assert_eq!(v["baselines_logged"], 2, "{v}");
    assert_eq!(
        v["baselines_from_snapshots"], 1,
        "m2's snapshot is stale: {v}"
    );
    let real = proc_stats(&v, pid).map_or(0, |p| p["real_syncs"].as_u64().unwrap_or(0));
    assert_eq!(real, 0, "{v}");
    drop(a);
    drop(b);
    s.kill9();
    // The power cut: both files as last made durable (nothing of them was since).
    for n in ["m1", "m2"] {
        fs::write(root.join(n), &durable[n]).unwrap();
    }
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    let mut m1 = vec![b'a'; 8000];
    m1.extend(vec![b'z'; 700]);
    assert!(
        fs::read(root.join("m1")).unwrap() == m1,
        "m1 after recovery"
    );
    let mut m2 = vec![b'B'; 50];
    m2.extend(vec![b'a'; 7950]);
    m2.extend(vec![b'y'; 300]);
    assert!(
        fs::read(root.join("m2")).unwrap() == m2,
        "m2 after recovery"
    );
    let _ = fs::remove_file(&pm);
}

/// What the namespace workload acknowledged: name -> state ("SEQ", "old:NAME", "dir", "-"),
/// and the names of the operation under way.
#[derive(Default)]
struct NsAcks {
    ready: bool,
    state: BTreeMap<String, String>,
    inflight: Vec<String>,
    acked: u64,
}

fn ns_content(cid: u64) -> Vec<u8> {
    let unit = format!("{cid}:").into_bytes();
    let mut v: Vec<u8> = unit
        .iter()
        .copied()
        .cycle()
        .take(unit.len() * (2 + cid as usize % 1500))
        .collect();
    v.truncate(1 + (cid as usize * 37) % 9000);
    v
}

/// Every file and directory under `dir` (relative names), files with their inode numbers.
fn tree(dir: &Path) -> (BTreeMap<String, u64>, Vec<String>) {
    use std::os::unix::fs::MetadataExt;
    let mut files = BTreeMap::new();
    let mut dirs = Vec::new();
    let mut stack = vec![String::new()];
    while let Some(rel) = stack.pop() {
        for e in fs::read_dir(dir.join(&rel)).unwrap().flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if rel.is_empty() && (pmstack::lower::is_internal(n.as_bytes()) || n == "lost+found") {
                continue;
            }
            let name = if rel.is_empty() {
                n
            } else {
                format!("{rel}/{n}")
            };
            let m = fs::symlink_metadata(e.path()).unwrap();
            if m.is_dir() {
                dirs.push(name.clone());
                stack.push(name);
            } else {
                files.insert(name, m.ino());
            }
        }
    }
    (files, dirs)
}

/// One round of the namespace crash test: load, kill -9 (program and daemon), a power cut
/// that keeps none of the namespace changes made after the snapshot (the lower's journal
/// committed nothing since) and a random mix of the files' old and new pages, recovery.
fn ns_crash_round(base: &Path, seed: u64) {
    use std::os::unix::fs::FileExt;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = base.join(format!("ns{seed}"));
    let stash = base.join(format!("stash{seed}"));
    fs::create_dir_all(&dir).unwrap();
    fs::create_dir_all(&stash).unwrap();
    let tags = ["A", "B"];
    for k in 0..3 {
        fs::write(dir.join(format!("shared{k}")), vec![b'S'; 3000]).unwrap();
    }
    for t in tags {
        for k in 0..6 {
            fs::write(
                dir.join(format!("old{t}-{k}")),
                vec![b'a' + k as u8; 5000 + k * 300],
            )
            .unwrap();
        }
    }
    Command::new("sync").status().unwrap();
    let pm = PathBuf::from(format!("/dev/shm/pmstack-test-preload-ns-{seed}.pm"));
    let _ = fs::remove_file(&pm);
    let mut s = Serve::start(
        &dir,
        &pm,
        &["--flush-interval-ms", "3600000", "--pm-size", "1G"],
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/preload/nsload.py");
    // Two processes in one directory tree: their operations are ordered by the namespace
    // lock they share.
    let mut kids = Vec::new();
    let mut readers = Vec::new();
    let mut all_acks = Vec::new();
    for (i, t) in tags.iter().enumerate() {
        let mut k = s
            .run()
            .arg("python3")
            .arg(&script)
            .arg(&s.dir)
            .arg((seed * 2 + i as u64).to_string())
            .arg(t)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let acks = Arc::new(Mutex::new(NsAcks::default()));
        let out = k.stdout.take().unwrap();
        let a2 = acks.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let w: Vec<&str> = line.split_whitespace().collect();
                let mut a = a2.lock().unwrap();
                match w.as_slice() {
                    ["ready"] => a.ready = true,
                    ["begin", _, names @ ..] => {
                        a.inflight = names.iter().map(|s| s.to_string()).collect()
                    }
                    ["ack", _, changes @ ..] => {
                        for c in changes {
                            let (n, v) = c.split_once('=').unwrap();
                            a.state.insert(n.to_string(), v.to_string());
                        }
                        a.inflight.clear();
                        a.acked += 1;
                    }
                    _ => {}
                }
            }
        }));
        kids.push(k);
        all_acks.push(acks);
    }
    let mut kids = common::Reaped(kids);
    let t0 = Instant::now();
    while !all_acks.iter().all(|a| a.lock().unwrap().ready) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "workload never got ready"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The state a power cut may keep: durable now; every file kept alive through a link in
    // the stash (outside the tree, as a file may have a name elsewhere), so the cut can put
    // its old name back.
    Command::new("sync").status().unwrap();
    let (snap_files, snap_dirs) = tree(&dir);
    let mut old = BTreeMap::new();
    for (name, ino) in &snap_files {
        let st = stash.join(ino.to_string());
        if !st.exists() {
            fs::hard_link(dir.join(name), &st).unwrap();
        }
        old.insert(name.clone(), fs::read(dir.join(name)).unwrap());
    }
    let tab = pmstack::front::table::Table::open(&pmstack::front::paths(&s.dir).1).unwrap();
    let counters = |pid: u64| {
        use pmstack::front::table::*;
        let w = proc_counters(&tab, pid);
        (
            w[P_FALLBACKS],
            w[P_NS_SYNCS],
            w[P_NS_OPS],
            w[P_DIR_FSYNC],
            w[P_UNSERVED],
        )
    };
    let before: Vec<_> = kids.iter().map(|k| counters(k.id() as u64)).collect();
    for k in kids.0.iter_mut() {
        writeln!(k.stdin.as_mut().unwrap(), "go").unwrap();
    }
    // Kill at a random point of the load, counted in acknowledged operations (not in time:
    // on a busy machine the load may be slow).
    let target = rng.gen_range(8..40);
    let t0 = Instant::now();
    while all_acks.iter().any(|a| a.lock().unwrap().acked < target) {
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "seed {seed}: a workload did not acknowledge {target} operations in 300 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    if rng.gen_bool(0.5) {
        s.kill9();
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..200)));
    }
    s.freeze();
    for k in kids.0.iter_mut() {
        let _ = k.kill();
        let _ = k.wait();
    }
    s.kill9();
    // Read once nothing runs any more: every acknowledged operation is counted. (Records of
    // dead processes are only reused by a later attach.)
    let after: Vec<_> = kids.iter().map(|k| counters(k.id() as u64)).collect();
    for r in readers {
        r.join().unwrap();
    }
    let mut acks = NsAcks::default();
    for a in &all_acks {
        let a = std::mem::take(&mut *a.lock().unwrap());
        acks.state.extend(a.state);
        acks.inflight.extend(a.inflight);
        acks.acked += a.acked;
    }
    for (b, a) in before.iter().zip(&after) {
        // Nothing was made durable by the lower after the snapshot, or the cut below would
        // not be a possible one: no real sync, no namespace write-back, no operation that
        // found the daemon not serving (it runs, with a real sync, on the lower alone).
        assert_eq!(
            (a.0, a.1, a.4),
            (b.0, b.1, b.4),
            "seed {seed}: real syncs, namespace write-backs or unserved operations after the snapshot (counters before {b:?}, after {a:?})"
        );
        assert!(a.2 > b.2 && a.3 > b.3, "seed {seed}: {b:?} -> {a:?}");
    }

    // What the lower holds at the shared names now (the programs are dead): the replaces
    // that won, in the order the lower applied them.
    let shared_now: Vec<Option<Vec<u8>>> = (0..3)
        .map(|k| fs::read(dir.join(format!("shared{k}"))).ok())
        .collect();
    // The power cut: names as at the snapshot, each file a mix of its old and new pages.
    let (now_files, mut now_dirs) = tree(&dir);
    for name in now_files.keys() {
        fs::remove_file(dir.join(name)).unwrap();
    }
    now_dirs.sort_by_key(|d| std::cmp::Reverse(d.matches('/').count()));
    for d in now_dirs.iter().filter(|d| !snap_dirs.contains(d)) {
        fs::remove_dir(dir.join(d)).unwrap();
    }
    for (name, ino) in &snap_files {
        let st = stash.join(ino.to_string());
        let cur = fs::read(&st).unwrap();
        let prev = &old[name];
        let f = fs::OpenOptions::new().write(true).open(&st).unwrap();
        for pg in 0..cur.len().max(prev.len()).div_ceil(4096) {
            if rng.gen_bool(0.5) {
                let (a, b) = (pg * 4096, ((pg + 1) * 4096).min(prev.len()));
                if a < b {
                    f.write_all_at(&prev[a..b], a as u64).unwrap();
                }
            }
        }
        if rng.gen_bool(0.5) {
            f.set_len(prev.len() as u64).unwrap();
        }
        fs::hard_link(&st, dir.join(name)).unwrap();
    }

    // Recovery, then a clean stop. The stash's links stay until then: to the programs they
    // were names outside the tree, which the unlink records count (a file unlinked from the
    // tree still had a name); the cut keeps the lower as at the snapshot, so it keeps them.
    let mut s2 = Serve::start(&dir, &pm, &[]);
    s2.stop();
    fs::remove_dir_all(&stash).unwrap();
    let (got_files, got_dirs) = tree(&dir);
    let skip = |n: &String| acks.inflight.contains(n);
    for (name, want) in &acks.state {
        if skip(name) {
            continue;
        }
        let path = dir.join(name);
        match want.as_str() {
            "-" => assert!(
                !path.exists(),
                "seed {seed}: {name} was removed (acknowledged) but is back"
            ),
            "dir" => assert!(path.is_dir(), "seed {seed}: directory {name} is missing"),
            cid => {
                let data = fs::read(&path).unwrap_or_else(|e| {
                    panic!("seed {seed}: {name} (content {cid}) is missing after recovery: {e}")
                });
                let expect = match cid.strip_prefix("old:") {
                    Some(orig) => old[orig].clone(),
                    None => ns_content(cid.parse().unwrap()),
                };
                assert!(
                    data == expect,
                    "seed {seed}: {name} should hold content {cid}"
                );
            }
        }
    }
    for (k, want) in shared_now.iter().enumerate() {
        let name = format!("shared{k}");
        if skip(&name) {
            continue;
        }
        assert!(
            &fs::read(dir.join(&name)).ok() == want,
            "seed {seed}: {name} after recovery is not what the last acknowledged replace left"
        );
    }
    // Nothing else: every name there is one the workload wants (or was changing).
    for name in got_files.keys() {
        let wanted = acks.state.get(name).is_some_and(|v| v != "-")
            || (!acks.state.contains_key(name) && snap_files.contains_key(name));
        assert!(
            wanted || skip(name),
            "seed {seed}: unexpected file {name} after recovery"
        );
    }
    for d in &got_dirs {
        let wanted = snap_dirs.contains(d) || acks.state.get(d).is_some_and(|v| v == "dir");
        assert!(
            wanted || skip(d),
            "seed {seed}: unexpected directory {d} after recovery"
        );
    }
    assert_log_empty(&pm);
    drop(s2);
    drop(s);
    let _ = fs::remove_file(&pm);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn kill9_and_power_loss_keep_every_acknowledged_namespace_operation() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    crash_rounds("pmstack-preload-ns-", 4, ns_crash_round);
}

/// A temporary directory served for a test (needs python3): the directory (removed on
/// drop), its canonical path, the region, the daemon. None where the test cannot run.
fn served_tmp(name: &str, extra: &[&str]) -> Option<(tempfile::TempDir, PathBuf, PathBuf, Serve)> {
    if !common::can_mount() || !have("python3") {
        return None;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = shm_region(name);
    let s = Serve::start(&root, &pm, extra);
    Some((d, root, pm, s))
}

/// Run a Python `script` under `pmstack run` of `s` with the root as its argument; it must
/// print "ok".
fn python_ok(s: &Serve, root: &Path, script: &str) {
    let out = s
        .run()
        .args(["python3", "-c", script])
        .arg(root)
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The library keeps O_SYNC and O_DSYNC away from the kernel's descriptor (it logs those
/// writes instead); `fcntl(F_GETFL)` still reports what the program asked for, also through a
/// duplicate and in a forked child, and nothing it did not ask for.
#[test]
fn fcntl_getfl_reports_the_sync_flags_the_program_asked_for() {
    let Some((_d, root, pm, s)) = served_tmp("getfl", &[]) else {
        return;
    };
    let script = r#"
import fcntl, os, sys
d = sys.argv[1]
def kind(fd):
    g = fcntl.fcntl(fd, fcntl.F_GETFL)
    return "sync" if g & os.O_SYNC == os.O_SYNC else ("dsync" if g & os.O_DSYNC else "none")
got = []
for name, fl in (("sync", os.O_SYNC), ("dsync", os.O_DSYNC), ("none", 0)):
    fd = os.open(os.path.join(d, name), os.O_CREAT | os.O_RDWR | fl, 0o644)
    os.write(fd, b"x")
    got.append((name, kind(fd), kind(os.dup(fd))))
    pid = os.fork()
    if pid == 0:
        os._exit(0 if kind(fd) == name else 1)
    assert os.waitpid(pid, 0)[1] == 0, "forked child of " + name
for name, k, kd in got:
    assert k == name and kd == name, got
print("ok")
"#;
    python_ok(&s, &root, script);
    // The library did track the descriptors: each O_SYNC or O_DSYNC write was absorbed, or
    // synced for real (the first file's creation was the directory's first change, written
    // back instead of logged: its file is not absorbed before the daemon vetted it).
    s.wait_stats("O_SYNC and O_DSYNC writes seen", |v| {
        let t = &v["totals"];
        t["absorbed_osync"].as_u64().unwrap_or(0) + t["real_syncs"].as_u64().unwrap_or(0) >= 2
    });
    drop(s);
    let _ = fs::remove_file(&pm);
}

/// A file opened for writing by a path relative to the working directory or to a directory
/// descriptor under the root is tracked like one opened by its absolute path: its writes are
/// seen and its syncs absorbed (an untracked writer of an object with live entries would
/// have its writes rolled back by replay).
#[test]
fn files_opened_by_relative_paths_are_tracked() {
    // (No watch: absorption then does not wait for the daemon's vetting of each file.)
    let Some((_d, root, pm, s)) = served_tmp("relopen", &["--all-writers-attached"]) else {
        return;
    };
    let script = r#"
import os, sys
d = sys.argv[1]
os.mkdir(os.path.join(d, "sub"))
for p in ("sub/a", "sub/b"):
    os.close(os.open(os.path.join(d, p), os.O_CREAT | os.O_WRONLY, 0o644))
os.chdir(os.path.join(d, "sub"))
dfd = os.open(".", os.O_RDONLY)
for fd in (os.open("a", os.O_WRONLY), os.open("b", os.O_WRONLY, dir_fd=dfd)):
    for _ in range(2):
        os.write(fd, b"x" * 4096)
        os.fsync(fd)
    os.close(fd)
print("ok")
"#;
    python_ok(&s, &root, script);
    // A file's first sync may be real (a creation written back instead of logged); its
    // second is absorbed if the library tracks the descriptor.
    s.wait_stats("the second fsync of each file absorbed", |v| {
        v["totals"]["absorbed_fsync"].as_u64() >= Some(2)
    });
    drop(s);
    let _ = fs::remove_file(&pm);
}

/// Namespace calls on paths with a trailing slash, which ask the kernel for a directory, give
/// under `pmstack run` what they give on the lower alone: `unlink("f/")` of a file fails with
/// ENOTDIR (it removed the file), `open("n/", O_CREAT)` with EISDIR (it created a file), and so
/// on. The same script runs on a plain directory and under `pmstack run`.
#[test]
fn trailing_slashes_mean_what_they_mean_on_the_lower() {
    let Some((_d, root, pm, s)) = served_tmp("slash", &[]) else {
        return;
    };
    let script = r#"
import os, sys
d = sys.argv[1]
res = []
def tr(name, f):
    try:
        f()
        res.append(name + ": ok")
    except OSError as e:
        res.append(name + ": " + os.strerror(e.errno))
open(d + "/f", "w").close()
os.mkdir(d + "/e")
tr("unlink f/", lambda: os.unlink(d + "/f/"))
tr("rename f/ g", lambda: os.rename(d + "/f/", d + "/g"))
tr("rename f g/", lambda: os.rename(d + "/f", d + "/g/"))
tr("link f h/", lambda: os.link(d + "/f", d + "/h/"))
tr("mkdir m/", lambda: os.mkdir(d + "/m/"))
tr("rename m/ k/", lambda: os.rename(d + "/m/", d + "/k/"))
tr("rmdir k/", lambda: os.rmdir(d + "/k/"))
tr("rmdir f/", lambda: os.rmdir(d + "/f/"))
tr("open n/ O_CREAT", lambda: os.close(os.open(d + "/n/", os.O_CREAT | os.O_WRONLY)))
tr("symlink s/", lambda: os.symlink("f", d + "/s/"))
tr("unlink e/", lambda: os.unlink(d + "/e/"))
names = sorted(n for n in os.listdir(d) if not n.startswith(".pmstack"))
print(" | ".join(res) + " || " + " ".join(names))
"#;
    let run = |c: &mut Command, dir: &Path| {
        let out = c.args(["python3", "-c", script]).arg(dir).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let plain = tempfile::tempdir_in("/var/tmp").unwrap();
    let want = run(&mut Command::new("env"), plain.path());
    let got = run(&mut s.run(), &root);
    drop(s);
    let _ = fs::remove_file(&pm);
    assert_eq!(
        got, want,
        "under pmstack run (left), on the lower alone (right)"
    );
}

/// A write through an O_APPEND descriptor lands at the end of the file, a pwrite too (Linux
/// ignores its offset), and so does its log record: replay after a crash puts the bytes
/// where the program's write put them. The library logged a pwrite at its offset, and
/// recovery wrote the appended bytes over the start of the file. Also when O_APPEND is set
/// later by `fcntl(F_SETFL)`.
#[test]
fn appends_by_pwrite_are_replayed_at_the_end_of_the_file() {
    let Some((_d, root, pm, mut s)) = served_tmp(
        "append",
        &["--all-writers-attached", "--flush-interval-ms", "3600000"],
    ) else {
        return;
    };
    let mut a = Py::spawn(s.run(), &root);
    // The root's first change writes back what came before it; then the files' creations
    // are logged, and their syncs absorbed from the first.
    a.exec(concat!(
        "open(os.path.join(d, 'first'), 'w').close()\n",
        "fa = os.open(os.path.join(d, 'a'), os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)\n",
        "fb = os.open(os.path.join(d, 'b'), os.O_CREAT | os.O_WRONLY, 0o644)\n",
        "import fcntl\n",
        "fcntl.fcntl(fb, fcntl.F_SETFL, os.O_APPEND)\n",
        "for fd in (fa, fb):\n",
        "    os.write(fd, b'a' * 100)\n",
        "    os.fsync(fd)\n",
        "    os.pwrite(fd, b'X' * 10, 0)\n",
        "    os.fsync(fd)",
    ));
    let want = [vec![b'a'; 100], vec![b'X'; 10]].concat();
    for f in ["a", "b"] {
        assert_eq!(
            fs::read(root.join(f)).unwrap(),
            want,
            "{f} before the crash"
        );
    }
    // The daemon dies with the records live; the lower loses the appended bytes (as a power
    // cut could: they were only in its page cache).
    s.kill9();
    for f in ["a", "b"] {
        fs::OpenOptions::new()
            .write(true)
            .open(root.join(f))
            .unwrap()
            .set_len(100)
            .unwrap();
    }
    drop(a);
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    for f in ["a", "b"] {
        assert_eq!(fs::read(root.join(f)).unwrap(), want, "{f} after recovery");
    }
}

/// A FUSE lower for `pmstack run` (bindfs over a directory in /var/tmp): the temporary
/// directory, the bindfs mount, and what unmounts it when dropped (before the directory
/// goes). None where it cannot be made outside CI (in CI a missing bindfs fails).
fn bindfs_root() -> Option<(tempfile::TempDir, PathBuf, Unmount)> {
    if !common::can_mount() || !have("python3") {
        return None;
    }
    if !have("bindfs") {
        assert!(!ci(), "bindfs is needed (apt-get install bindfs)");
        return None;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let src = d.path().join("src");
    let root = d.path().join("bind");
    fs::create_dir_all(&src).unwrap();
    fs::create_dir_all(&root).unwrap();
    assert!(Command::new("bindfs")
        .arg(&src)
        .arg(&root)
        .status()
        .unwrap()
        .success());
    let bind = Unmount(root.clone());
    Some((d, root, bind))
}

/// Unmounts a FUSE mount (lazily) when dropped.
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Over a FUSE lower (bindfs here; GlusterFS, JuiceFS) each process keeps copies of the
/// bytes it wrote and has not synced, for its next sync to log without reading them back
/// (milliseconds there). Another process changing those bytes in between (a write it then
/// synced, a truncate) makes the copies stale: the sync reads the bytes back instead. Logging
/// the copy would have made replay roll the other process's synced bytes back.
#[test]
fn over_a_fuse_lower_a_sync_never_logs_bytes_another_process_changed_since() {
    let Some((_d, root, _bind)) = bindfs_root() else {
        return;
    };
    let pm = shm_region("stalecopy");
    let mut s = Serve::start(
        &root,
        &pm,
        &["--all-writers-attached", "--flush-interval-ms", "3600000"],
    );
    let mut a = Py::spawn(s.run(), &root);
    let mut b = Py::spawn(s.run(), &root);
    // The root's first change is written back; then the creations are logged.
    a.exec("open(os.path.join(d, 'first'), 'w').close()");
    a.exec(concat!(
        "fa = os.open(os.path.join(d, 'f'), os.O_CREAT | os.O_RDWR, 0o644)\n",
        "os.pwrite(fa, b'a' * 4096, 0)\n",
        "ta = os.open(os.path.join(d, 't'), os.O_CREAT | os.O_RDWR, 0o644)\n",
        "os.pwrite(ta, b'a' * 8192, 0)",
    ));
    // The other process changes those bytes and syncs: its bytes are durable.
    b.exec(concat!(
        "fb = os.open(os.path.join(d, 'f'), os.O_RDWR)\n",
        "os.pwrite(fb, b'b' * 4096, 0)\n",
        "os.fsync(fb)\n",
        "tb = os.open(os.path.join(d, 't'), os.O_RDWR)\n",
        "os.ftruncate(tb, 100)\n",
        "os.fsync(tb)",
    ));
    // The first one writes elsewhere and syncs: its dirty bytes at 0 are the other's now.
    a.exec(concat!(
        "os.pwrite(fa, b'c' * 4096, 8192)\n",
        "os.fsync(fa)\n",
        "os.pwrite(ta, b'c' * 100, 200)\n",
        "os.fsync(ta)",
    ));
    let f = [vec![b'b'; 4096], vec![0; 4096], vec![b'c'; 4096]].concat();
    let t = [vec![b'a'; 100], vec![0; 100], vec![b'c'; 100]].concat();
    assert!(fs::read(root.join("f")).unwrap() == f && fs::read(root.join("t")).unwrap() == t);
    let (pa, pb) = (a.pid(), b.pid());
    let v = s.wait_stats("both processes' syncs", |v| {
        let n = |pid| proc_stats(v, pid).map_or(0, |p| fsyncs(&p));
        n(pa) >= 2 && n(pb) >= 2
    });
    let absorbed = proc_stats(&v, pa).map_or(0, |p| p["absorbed_fsync"].as_u64().unwrap_or(0));
    assert_eq!(absorbed, 2, "the first process's syncs are absorbed: {v}");
    // Replay after the daemon's death puts back what the records hold.
    s.kill9();
    drop((a, b));
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    assert!(fs::read(root.join("f")).unwrap() == f, "f after recovery");
    assert!(fs::read(root.join("t")).unwrap() == t, "t after recovery");
}

/// A descriptor opened O_DIRECT (a database doing its own caching), or switched to it by
/// `fcntl(F_SETFL)`, works as natively: the kernel refuses a direct write or read from a
/// buffer not aligned to the device's block, so what the library writes through it (a
/// logged write to a file with live records, a writev it gathered) comes from aligned memory
/// of its own, and a sync reads the dirty bytes back through another descriptor. Its syncs
/// are absorbed, and recovery replays them after the daemon died and the lower lost them.
#[test]
fn o_direct_descriptors_are_logged_and_synced_as_natively() {
    let Some((_d, root, pm, mut s)) = served_tmp(
        "direct",
        &["--all-writers-attached", "--flush-interval-ms", "3600000"],
    ) else {
        return;
    };
    let mut a = Py::spawn(s.run(), &root);
    a.exec(concat!(
        "import mmap, fcntl\n",
        "open(os.path.join(d, 'first'), 'w').close()\n",
        "m = mmap.mmap(-1, 1 << 17)\n",
        "def fill(c, n):\n",
        "    m[:n] = c * n\n",
        "    return memoryview(m)[:n]\n",
        "fd = os.open(os.path.join(d, 'direct'), os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)\n",
        // More than the 64 KiB a process keeps a copy of: the sync reads the rest back.
        "assert os.pwrite(fd, fill(b'a', 1 << 17), 0) == 1 << 17\n",
        "os.fsync(fd)\n",
        // Live records now: each write is logged, then written from the library's copy.
        "assert os.pwrite(fd, fill(b'b', 8192), 4096) == 8192\n",
        "os.lseek(fd, 65536, os.SEEK_SET)\n",
        "c = mmap.mmap(-1, 4096); c[:] = b'c' * 4096\n",
        "e = mmap.mmap(-1, 4096); e[:] = b'd' * 4096\n",
        "assert os.writev(fd, [c, e]) == 8192\n",
        "os.fdatasync(fd)\n",
        "assert os.pwrite(fd, fill(b'e', 4096), 1 << 17) == 4096\n",
        "os.fsync(fd)\n",
        "g = os.open(os.path.join(d, 'toggled'), os.O_CREAT | os.O_RDWR, 0o644)\n",
        "os.write(g, b'f' * 4096)\n",
        "os.fsync(g)\n",
        "fcntl.fcntl(g, fcntl.F_SETFL, os.O_DIRECT)\n",
        "assert os.pwrite(g, fill(b'g', 4096), 4096) == 4096\n",
        "os.fsync(g)",
    ));
    let mut direct = vec![b'a'; 1 << 17];
    direct[4096..12288].fill(b'b');
    direct[65536..69632].fill(b'c');
    direct[69632..73728].fill(b'd');
    direct.extend_from_slice(&[b'e'; 4096]);
    let toggled = [vec![b'f'; 4096], vec![b'g'; 4096]].concat();
    let want = [("direct", &direct), ("toggled", &toggled)];
    for (f, w) in want {
        assert!(
            fs::read(root.join(f)).unwrap() == *w,
            "{f} before the crash"
        );
    }
    // (Stats are written every 500 ms.)
    let pid = a.pid();
    let all = s.wait_stats("the syncs counted", |v| {
        proc_stats(v, pid).is_some_and(|p| p["absorbed_fsync"].as_u64() >= Some(5))
    });
    let st = proc_stats(&all, pid).expect("found above");
    let g = |k: &str| st[k].as_u64().unwrap_or(0);
    assert_eq!(g("real_syncs"), 0, "every sync absorbed: {st}");
    assert!(g("eager_writes") >= 3, "writes logged first: {st}");
    // The daemon dies with the records live; the lower loses what they hold.
    s.kill9();
    for (f, _) in want {
        fs::OpenOptions::new()
            .write(true)
            .open(root.join(f))
            .unwrap()
            .set_len(0)
            .unwrap();
    }
    drop(a);
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    for (f, w) in want {
        assert!(fs::read(root.join(f)).unwrap() == *w, "{f} after recovery");
    }
}

/// Random writes of every kind the library logs (write, pwrite, writev, pwritev, through
/// O_APPEND, O_SYNC and O_DSYNC descriptors, after seeks past the end, through duplicates;
/// ftruncate, fallocate; fsync and fdatasync) and one it does not (pwritev2 with
/// RWF_APPEND), then a kill -9 of the daemon while the program is still attached, after a
/// last fsync of every file or not: the lower holds every byte (nothing was lost), so
/// recovery, which replays every live record, must change nothing. A record logged at the
/// wrong place, or older than a write it would overwrite, shows as a changed file.
#[test]
fn recovery_after_a_daemon_crash_changes_nothing_the_program_wrote() {
    const WRITES: &str = r#"
import random
rnd = random.Random(SEED)
P = lambda n: os.path.join(d, n)
def blob(n): return bytes(rnd.randrange(256) for _ in range(n))
open(P("first"), "w").close()
fds = {}
for i in range(6):
    fl = os.O_CREAT | os.O_RDWR | rnd.choice([0, 0, 0, os.O_APPEND, os.O_SYNC, os.O_DSYNC])
    fds["f%d" % i] = os.open(P("f%d" % i), fl, 0o644)
for step in range(300):
    fd = fds[rnd.choice(sorted(fds))]
    op = rnd.randrange(12)
    size = os.fstat(fd).st_size
    if op == 0: os.write(fd, blob(rnd.randrange(1, 9000)))
    elif op == 1: os.pwrite(fd, blob(rnd.randrange(1, 9000)), rnd.randrange(0, size + 5000))
    elif op == 2: os.writev(fd, [blob(rnd.randrange(1, 3000)) for _ in range(3)])
    elif op == 3: os.pwritev(fd, [blob(rnd.randrange(1, 3000)) for _ in range(2)], rnd.randrange(0, size + 100))
    elif op == 4: os.lseek(fd, rnd.randrange(0, size + 8192), os.SEEK_SET)
    elif op == 5: os.lseek(fd, 0, os.SEEK_END)
    elif op == 6: os.ftruncate(fd, rnd.randrange(0, size + 8192))
    elif op == 7: os.fsync(fd)
    elif op == 8: os.fdatasync(fd)
    elif op == 9:
        d2 = os.dup(fd); os.write(d2, blob(rnd.randrange(1, 500))); os.close(d2)
    elif op == 10:
        os.posix_fallocate(fd, rnd.randrange(0, size + 100), rnd.randrange(1, 20000))
    else:
        os.pwritev(fd, [blob(rnd.randrange(1, 2000))], rnd.randrange(0, size + 10), os.RWF_APPEND)
if FINAL:
    for fd in fds.values():
        os.fsync(fd)
"#;
    for (seed, last_fsync) in [
        (11, true),
        (12, true),
        (31, false),
        (32, false),
        (33, false),
    ] {
        let Some((_d, root, pm, mut s)) = served_tmp(
            "replay",
            &["--all-writers-attached", "--flush-interval-ms", "3600000"],
        ) else {
            return;
        };
        let mut a = Py::spawn(s.run(), &root);
        let final_ = if last_fsync { "True" } else { "False" };
        a.exec(
            &WRITES
                .replace("SEED", &seed.to_string())
                .replace("FINAL", final_),
        );
        let snap = common::snapshot(&root);
        assert!(snap.len() >= 6, "seed {seed}: {:?}", snap.keys());
        s.kill9();
        drop(a);
        let live = Command::new(common::bin())
            .args(["check", "--json", "--pm"])
            .arg(&pm)
            .output()
            .unwrap();
        let live: serde_json::Value = serde_json::from_slice(&live.stdout).unwrap();
        assert!(
            live["live_entries"].as_u64() >= Some(10),
            "seed {seed}: too few live records to mean anything: {live}"
        );
        let mut s2 = Serve::start(&root, &pm, &[]);
        s2.stop();
        let got = common::snapshot(&root);
        for (name, want) in &snap {
            assert!(
                got.get(name) == Some(want),
                "seed {seed}: recovery changed {name}"
            );
        }
    }
}

/// `open(O_TRUNC)` of an existing file marks its modification and change times for update,
/// also when the file is empty (POSIX; the library truncates instead of the kernel).
#[test]
fn o_trunc_of_an_existing_empty_file_updates_its_times() {
    let Some((_d, root, pm, s)) = served_tmp("otrunc", &[]) else {
        return;
    };
    let script = r#"
import os, sys, time
p = os.path.join(sys.argv[1], "empty")
open(p, "w").close()
before = os.stat(p)
time.sleep(0.05)  # above the timestamp granularity (the coarse clock ticks every 4 ms)
os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
after = os.stat(p)
assert after.st_mtime_ns > before.st_mtime_ns, "mtime kept"
assert after.st_ctime_ns > before.st_ctime_ns, "ctime kept"
print("ok")
"#;
    python_ok(&s, &root, script);
    drop(s);
    let _ = fs::remove_file(&pm);
}

/// (namespace write-backs, absorbed directory fsyncs, logged namespace operations) of
/// attached process `pid`, once its stats show `want` (they are written every 500 ms).
fn expect_ns_counts(s: &Serve, pid: u64, want: (u64, u64, u64), what: &str) {
    let keys = ["ns_write_backs", "absorbed_dir_fsync", "ns_ops"];
    expect_counts(s, pid, keys, want, what);
}

/// The counters `keys` of attached process `pid`, once its stats show `want`.
fn expect_counts(s: &Serve, pid: u64, keys: [&str; 3], want: (u64, u64, u64), what: &str) {
    let counts = || -> (u64, u64, u64) {
        let p = proc_stats(&s.stats(), pid).unwrap_or_default();
        let g = |k: &str| p[k].as_u64().unwrap_or(0);
        (g(keys[0]), g(keys[1]), g(keys[2]))
    };
    let t0 = Instant::now();
    while counts() != want {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what}: {keys:?} {:?}, want {want:?}",
            counts()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Paths relative to the working directory or to a directory descriptor under the root are
/// logged like absolute ones (the library knows those directories are under the root
/// without asking the kernel each time); a relative path whose directory is outside the root
/// is not ours, and one with ".." is resolved by the kernel.
#[test]
fn namespace_operations_on_relative_paths_are_logged_like_absolute_ones() {
    let Some((_d, root, pm, s)) = served_tmp("nsrel", &["--flush-interval-ms", "3600000"]) else {
        return;
    };
    let outside = tempfile::tempdir_in("/var/tmp").unwrap();
    let mut a = Py::spawn(s.run(), &root);
    let pid = a.pid();
    // A directory's first change writes back what came before it (here the mkdir); then its
    // changes are logged. The new directory is clean from its birth: its first create is
    // logged too.
    a.exec("os.chdir(d)\nos.mkdir('sub')\nos.close(os.open('r1', os.O_CREAT | os.O_WRONLY))");
    expect_ns_counts(
        &s,
        pid,
        (1, 0, 1),
        "mkdir and create in the working directory",
    );
    a.exec(concat!(
        "os.rename('r1', 'r2')\n",
        "dfd = os.open('sub', os.O_RDONLY)\n",
        "os.close(os.open('f', os.O_CREAT | os.O_WRONLY, dir_fd=dfd))\n",
        "os.fsync(dfd)",
    ));
    expect_ns_counts(
        &s,
        pid,
        (1, 1, 3),
        "a rename, then a create beside a descriptor",
    );
    a.exec(concat!(
        "os.rename('r2', 'sub/r3')\n",
        "os.unlink('f', dir_fd=dfd)\n",
        "os.chdir('sub')\n",
        "os.rename('../sub/r3', 'r4')\n",
        "os.fsync(dfd)",
    ));
    expect_ns_counts(
        &s,
        pid,
        (1, 2, 6),
        "renames and an unlink by relative paths",
    );
    // Outside the root: not ours (nothing logged, nothing written back); then one more
    // logged operation, so that the stats are known to be written after them.
    a.exec(&format!(
        "os.chdir({:?})\nos.close(os.open('o', os.O_CREAT | os.O_WRONLY))\nos.rename('o', 'p')",
        outside.path()
    ));
    a.exec("os.rename('r4', 'r5', src_dir_fd=dfd, dst_dir_fd=dfd)");
    expect_ns_counts(&s, pid, (1, 2, 7), "outside the root, then one inside");
    drop(a);
    let mut s = s;
    s.stop();
    let _ = fs::remove_file(&pm);
    assert!(root.join("sub/r5").exists() && !root.join("r1").exists() && !root.join("r2").exists());
    assert!(!root.join("sub/f").exists() && !root.join("sub/r3").exists());
    assert!(outside.path().join("p").exists());
}

/// The library keeps the directories of recent namespace operations open and finds them
/// again by a stat of the path (`ns::dirs`): a path that names another directory since (the
/// first renamed away, a new one made at its name) reaches the new one, in the lower and in
/// the log; a bounded number stay open, removed ones are closed, and numbers the program
/// closes are the program's (never closed again by the library, which would close a file
/// the program opened under that number). Recovery over the lower changes nothing: every
/// record named the directory the operation changed.
#[test]
fn directories_kept_open_for_namespace_operations_follow_their_identity() {
    let Some((_d, root, pm, mut s)) = served_tmp("nsdirs", &["--flush-interval-ms", "3600000"])
    else {
        return;
    };
    let mut a = Py::spawn(s.run(), &root);
    let pid = a.pid();
    a.exec(concat!(
        "import stat\n",
        "def dir_fds():\n",
        "    out = []\n",
        "    for n in os.listdir('/proc/self/fd'):\n",
        "        try:\n",
        "            t = os.readlink('/proc/self/fd/' + n)\n",
        "            st = os.stat('/proc/self/fd/' + n)\n",
        "        except OSError:\n",
        "            continue\n",
        "        if stat.S_ISDIR(st.st_mode) and t.startswith(d):\n",
        "            out.append((int(n), t))\n",
        "    return out\n",
        "def touch(p):\n",
        "    os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))\n",
        "A = os.path.join(d, 'a'); O = os.path.join(d, 'old')\n",
        "os.mkdir(A)\n",
        "for i in range(4): touch(os.path.join(A, 'x%d' % i))\n",
        "os.rename(A, O)\n",
        "os.mkdir(A)\n",
        "touch(os.path.join(A, 'y'))\n",
        "os.unlink(os.path.join(O, 'x0'))\n",
        "os.rename(os.path.join(O, 'x1'), os.path.join(A, 'x1'))\n",
        "assert sorted(os.listdir(A)) == ['x1', 'y'], os.listdir(A)\n",
        "assert sorted(os.listdir(O)) == ['x2', 'x3'], os.listdir(O)\n",
        "for j in range(40):\n",
        "    p = os.path.join(d, 'm%d' % j); os.mkdir(p); touch(os.path.join(p, 'f'))\n",
        "kept = dir_fds()\n",
        "assert 1 <= len(kept) <= 16, kept\n",
        "for j in range(40):\n",
        "    p = os.path.join(d, 'm%d' % j); os.unlink(os.path.join(p, 'f')); os.rmdir(p)\n",
        "assert not [t for _, t in dir_fds() if t.endswith('(deleted)')], dir_fds()\n",
        "kept = dir_fds()\n",
        "assert kept, 'the directories of the last operations are kept open'\n",
        "for n, _ in kept: os.close(n)\n",
        "f = os.open(os.path.join(A, 'z'), os.O_CREAT | os.O_WRONLY, 0o644)\n",
        "for j in range(40):\n",
        "    p = os.path.join(d, 'n%d' % j); os.mkdir(p); touch(os.path.join(p, 'f'))\n",
        "assert os.write(f, b'still the program\\'s') == 19\n",
        "os.fsync(f)\n",
        "os.close(f)\n",
        "os.rename(os.path.join(A, 'z'), os.path.join(O, 'z'))\n",
        // A fork's child: the copies of the kept directories are closed before it runs; it
        // closes what it does not know, opens a file under a number they may have had,
        // attaches, logs, and its file is still its own.
        "assert dir_fds()\n",
        "pid = os.fork()\n",
        "if pid == 0:\n",
        "    try:\n",
        "        assert not dir_fds(), dir_fds()\n",
        "        os.closerange(3, 4096)\n",
        "        f = os.open(os.path.join(d, 'child-file'), os.O_CREAT | os.O_WRONLY, 0o644)\n",
        "        touch(os.path.join(A, 'from-child'))\n",
        "        assert os.write(f, b'child') == 5\n",
        "        os.fsync(f)\n",
        "        os.close(f)\n",
        "        os._exit(0)\n",
        "    except BaseException as e:\n",
        "        os.write(2, repr(e).encode())\n",
        "        os._exit(1)\n",
        "assert os.waitpid(pid, 0)[1] == 0\n",
    ));
    s.wait_stats("the operations were logged", |v| {
        proc_stats(v, pid).is_some_and(|p| p["ns_ops"].as_u64() >= Some(200))
    });
    let before = tree(&root);
    let z = fs::read(root.join("old/z")).unwrap();
    assert_eq!(z, b"still the program's");
    assert_eq!(fs::read(root.join("child-file")).unwrap(), b"child");
    assert!(root.join("a/from-child").exists());
    s.kill9();
    drop(a);
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    assert_eq!(tree(&root), before, "recovery changed the tree");
    assert_eq!(fs::read(root.join("old/z")).unwrap(), z);
    let _ = fs::remove_file(&pm);
}

#[test]
fn directory_changes_outside_the_log_make_the_next_directory_sync_a_write_back() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = shm_region("nsdir");
    let s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let expect =
        |pid: u64, want: (u64, u64, u64), what: &str| expect_ns_counts(&s, pid, want, what);
    let mut a = Py::spawn(s.run(), &root);
    let pid = a.pid();
    // The directory's first logged change writes back what came before it; then it is clean.
    a.exec("dfd = os.open(d, os.O_RDONLY)\nopen(os.path.join(d, 'a'), 'w').close()\nos.fsync(dfd)");
    expect(pid, (1, 1, 0), "first change, then a sync");
    // A process outside `pmstack run` creates a file: the next directory sync writes back.
    let mut f = Py::spawn(Command::new("env"), &root);
    f.exec("open(os.path.join(d, 'x'), 'w').close()");
    a.exec("os.fsync(dfd)");
    expect(pid, (2, 1, 0), "sync after a change outside the log");
    a.exec("os.fsync(dfd)");
    expect(pid, (2, 2, 0), "clean again");
    // A rename after a change outside the log writes that change back first (its record
    // must not be replayed over it), then is logged as usual (an intent, before the call).
    f.exec("os.rename(os.path.join(d, 'x'), os.path.join(d, 'y'))");
    a.exec("os.rename(os.path.join(d, 'a'), os.path.join(d, 'b'))\nos.fsync(dfd)");
    expect(pid, (3, 3, 1), "change after a change outside the log");
    // Clean: logged, nothing written back.
    a.exec("os.rename(os.path.join(d, 'b'), os.path.join(d, 'c'))\nos.fsync(dfd)");
    expect(pid, (3, 4, 2), "a change in a clean directory");
    // So far no namespace record was live at a write-back: each synced only the directory
    // (nothing older could be replayed over the change outside the log). Now the renames'
    // records are live (no write-back for an hour): the next one writes everything back.
    let dir_wbs = || proc_stats(&s.stats(), pid).unwrap()["ns_dir_write_backs"].as_u64();
    assert_eq!(
        dir_wbs(),
        Some(3),
        "write-backs that synced only directories"
    );
    f.exec("open(os.path.join(d, 'z'), 'w').close()");
    a.exec("os.rename(os.path.join(d, 'c'), os.path.join(d, 'e'))\nos.fsync(dfd)");
    expect(
        pid,
        (4, 5, 3),
        "change after a change outside the log, records live",
    );
    assert_eq!(
        dir_wbs(),
        Some(3),
        "a write-back with records live is the whole lower's"
    );
    drop(a);
    drop(f);
    drop(s);
    let _ = fs::remove_file(&pm);
    assert!(root.join("e").exists() && root.join("y").exists() && !root.join("c").exists());
}

/// An attribute change of a directory (its times, owner or mode, as an untar gives them back
/// to each directory at its end), by path or through a descriptor, leaves a directory whose
/// every change was logged clean: the next namespace operation in it is logged, not written
/// back (an untar's directories each wrote the namespace back at their first removal). The
/// directory's next fsync is the lower's own (the attributes are durable by it alone), the
/// one after is absorbed again. Recovery after a kill of the daemon keeps the tree.
#[test]
fn an_attribute_change_of_a_directory_leaves_it_clean() {
    let Some((_d, root, pm, mut s, mut a)) = served_with_a_dir("nsattrs") else {
        return;
    };
    let pid = a.pid();
    let expect =
        |pid: u64, want: (u64, u64, u64), what: &str| expect_ns_counts(&s, pid, want, what);
    a.exec("a = os.path.join(d, 'a')");
    let changes = [
        "os.utime(a, (1, 2))",
        "os.chmod(a, 0o750)",
        "os.chown(a, os.getuid(), os.getgid())",
        "os.utime(a, (3, 4), follow_symlinks=False)",
        "fd = os.open(a, os.O_RDONLY); os.utime(fd, (5, 6)); os.close(fd)",
        "fd = os.open(a, os.O_RDONLY); os.fchmod(fd, 0o755); os.close(fd)",
        "fd = os.open(a, os.O_RDONLY); os.fchown(fd, os.getuid(), os.getgid()); os.close(fd)",
    ];
    for (i, change) in changes.iter().enumerate() {
        a.exec(change);
        a.exec(&format!("open(os.path.join(a, 'f{i}'), 'w').close()"));
        expect(
            pid,
            (1, 0, 1 + i as u64),
            &format!("a create after `{change}`"),
        );
    }
    let keys = ["ns_write_backs", "absorbed_dir_fsync", "real_syncs"];
    let reals = proc_stats(&s.stats(), pid).unwrap_or_default()["real_syncs"]
        .as_u64()
        .unwrap_or(0);
    a.exec("fd = os.open(a, os.O_RDONLY); os.fsync(fd); os.close(fd)");
    expect_counts(
        &s,
        pid,
        keys,
        (1, 0, reals + 1),
        "the fsync after the changes",
    );
    a.exec("fd = os.open(a, os.O_RDONLY); os.fsync(fd); os.close(fd)");
    expect_counts(&s, pid, keys, (1, 1, reals + 1), "the fsync after that");
    recovery_keeps_the_tree_after(&root, &pm, &mut s, || drop(a));
    use std::os::unix::fs::MetadataExt;
    let md = fs::metadata(root.join("a")).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o755);
}

/// A directory that a logged rename moved (to another parent, within its parent, exchanged
/// with another) stays clean if every change of it was logged: the rename moved its change
/// time, but the change is in the log, so the next namespace operation in it is logged, not
/// written back (each first change in a moved directory was a syncfs). Recovery after a kill
/// of the daemon keeps the tree.
#[test]
fn a_directory_moved_by_a_logged_rename_stays_clean() {
    let Some((_d, root, pm, mut s, mut a)) = served_with_a_dir("nsmoved") else {
        return;
    };
    let pid = a.pid();
    let expect =
        |pid: u64, want: (u64, u64, u64), what: &str| expect_ns_counts(&s, pid, want, what);
    a.exec("os.mkdir(os.path.join(d, 'b'))");
    expect(pid, (1, 0, 1), "a mkdir beside the directory");
    let steps = [
        (
            "os.rename(os.path.join(d, 'a'), os.path.join(d, 'b', 'a'))",
            "open(os.path.join(d, 'b', 'a', 'f'), 'w').close()",
            "a create in a directory moved to another parent",
        ),
        (
            "os.rename(os.path.join(d, 'b', 'a'), os.path.join(d, 'b', 'c'))",
            "open(os.path.join(d, 'b', 'c', 'g'), 'w').close()",
            "a create in a directory renamed within its parent",
        ),
        (
            "os.mkdir(os.path.join(d, 'e'))",
            "import ctypes; assert ctypes.CDLL(None, use_errno=True).renameat2(-100, os.path.join(d, 'b', 'c').encode(), -100, os.path.join(d, 'e').encode(), 2) == 0",
            "an exchange of two directories",
        ),
        (
            "open(os.path.join(d, 'e', 'h'), 'w').close()",
            "open(os.path.join(d, 'b', 'c', 'i'), 'w').close()",
            "creates in both exchanged directories",
        ),
    ];
    let mut ops = 1;
    for (first, then, what) in steps {
        a.exec(first);
        a.exec(then);
        ops += 2;
        expect(pid, (1, 0, ops), what);
    }
    recovery_keeps_the_tree_after(&root, &pm, &mut s, || drop(a));
    for p in ["e/f", "e/g", "e/h", "b/c/i"] {
        assert!(root.join(p).exists(), "{p} missing after recovery");
    }
}

/// A directory made where the operation could not be logged (its parent had a change outside
/// the log: the operation was written back instead) is clean from its birth, as one made by a
/// logged operation is: the first operation in it is logged, not written back again (tar
/// wrote back every directory above each new one, down a whole tree). Recovery after a kill
/// of the daemon keeps the tree as it was.
#[test]
fn a_directory_made_by_a_written_back_operation_is_clean_from_its_birth() {
    let Some((_d, root, pm, mut s, mut a)) = served_with_a_dir("nsborn") else {
        return;
    };
    let pid = a.pid();
    let expect =
        |pid: u64, want: (u64, u64, u64), what: &str| expect_ns_counts(&s, pid, want, what);
    a.exec("os.mkdir(os.path.join(d, 'a', 'b'))");
    expect(
        pid,
        (1, 0, 1),
        "a change in the directory that write-back made",
    );
    a.exec("open(os.path.join(d, 'a', 'b', 'f'), 'w').close()");
    expect(pid, (1, 0, 2), "a change in the directory that change made");
    recovery_keeps_the_tree_after(&root, &pm, &mut s, || drop(a));
    assert!(root.join("a/b/f").exists());
}

/// A daemon with a write-back period of an hour over a fresh root, and an attached Python
/// process that made the directory `a` there: the root's first change, written back (the
/// test made the root outside the log).
fn served_with_a_dir(name: &str) -> Option<(tempfile::TempDir, PathBuf, PathBuf, Serve, Py)> {
    let (d, root, pm, s) = served_tmp(name, &["--flush-interval-ms", "3600000"])?;
    let mut a = Py::spawn(s.run(), &root);
    a.exec("os.mkdir(os.path.join(d, 'a'))");
    expect_ns_counts(&s, a.pid(), (1, 0, 0), "the root's first change");
    Some((d, root, pm, s, a))
}

/// A directory's first logged change after changes outside the log syncs only the
/// directories from it up to the root where no live namespace record names any of them
/// (none can be replayed over what that makes durable), even while records naming other
/// directories are live; where one names any of them, it is the whole lower's write-back.
/// What the namespace write-back tests count of the attached program: (write-backs, of them
/// directory-only, logged operations).
const NS_WRITE_BACKS: [&str; 3] = ["ns_write_backs", "ns_dir_write_backs", "ns_ops"];

/// `root` served with a region in /dev/shm named after `tag` (write-back only when asked),
/// a Python attached to it and one outside `pmstack run`.
fn ns_write_backs_served(root: &Path, tag: &str) -> (PathBuf, Serve, Py, Py) {
    let pm = shm_region(tag);
    let s = Serve::start(root, &pm, &["--flush-interval-ms", "3600000"]);
    let a = Py::spawn(s.run(), root);
    let f = Py::spawn(Command::new("env"), root);
    (pm, s, a, f)
}

/// The programs gone, the daemon killed -9, its log recovered by a new one, stopped; the
/// region removed.
fn killed_and_recovered(mut s: Serve, programs: [Py; 2], root: &Path, pm: &Path) {
    drop(programs);
    s.kill9();
    let mut s2 = Serve::start(root, pm, &[]);
    s2.stop();
    let _ = fs::remove_file(pm);
}

#[test]
fn a_write_back_where_no_live_record_names_the_directories_syncs_only_them() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    for sub in ["a", "b"] {
        fs::create_dir(root.join(sub)).unwrap();
    }
    let (pm, s, mut a, mut f) = ns_write_backs_served(&root, "nsnamed");
    let pid = a.pid();
    let expect = |want, what: &str| expect_counts(&s, pid, NS_WRITE_BACKS, want, what);
    // a/ was made outside the log: its first change writes back (and is durable by that, not
    // logged); no record is live. The next one is logged: a record naming a/ is live.
    a.create("a/f1");
    expect((1, 1, 0), "first change in a/");
    a.create("a/f2");
    expect((1, 1, 1), "a change in a clean a/");
    // b/ changes outside the log; the write-back before the change in b/ syncs b/ and the
    // root, which no live record names.
    f.create("b/x");
    a.create("b/f3");
    expect((2, 2, 1), "first change in b/, a record naming a/ live");
    // a/ changes outside the log: a live record names it (its creation of f2 would be
    // replayed over what the write-back makes durable): the whole lower's write-back, which
    // expires every record so far.
    f.create("a/y");
    a.create("a/f4");
    expect(
        (3, 2, 1),
        "change in a/ after one outside, a record naming a/ live",
    );
    // The root's first logged change (it changed outside the log when a/ and b/ were made),
    // then a logged one: a record naming the root is live.
    a.create("g1");
    a.create("g2");
    expect((4, 3, 2), "first changes in the root");
    // A directory made outside the log under the root: the walk up from it meets the root,
    // which a live record names, so the whole lower's write-back.
    f.exec("os.mkdir(os.path.join(d, 'n'))");
    f.create("n/z");
    a.create("n/h");
    expect(
        (5, 3, 2),
        "first change in n/, a record naming the root live",
    );
    // After a crash every name is there.
    killed_and_recovered(s, [a, f], &root, &pm);
    for p in [
        "a/f1", "a/f2", "a/y", "a/f4", "b/f3", "g1", "g2", "n/z", "n/h",
    ] {
        assert!(root.join(p).exists(), "{p} lost");
    }
}

#[test]
fn removing_a_tree_made_outside_the_log_syncs_only_its_directories() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    // A tree made before the daemon started: every directory has changes the log lacks.
    for sub in ["p/q1", "p/q2", "p/q3"] {
        fs::create_dir_all(root.join(sub)).unwrap();
        fs::write(root.join(sub).join("x"), b"x").unwrap();
    }
    let (pm, s, mut a, mut f) = ns_write_backs_served(&root, "nstree");
    let pid = a.pid();
    let expect = |want, what: &str| expect_counts(&s, pid, NS_WRITE_BACKS, want, what);
    // q1's first change writes q1 and those above it back (no record is live), then is
    // logged; so is the removal of q1 in p, after p's own write-back.
    a.unlink("p/q1/x");
    expect((1, 1, 1), "first change in q1");
    a.rmdir("p/q1");
    expect((2, 2, 2), "first change in p");
    // q2's first change: the walk up from q2 meets p, which a live record names (the removal
    // of q1) but whose every change since was logged: syncing it makes durable only what that
    // record did. Directories only, as above.
    a.unlink("p/q2/x");
    expect(
        (3, 3, 3),
        "first change in q2, p clean and named by a live record",
    );
    a.rmdir("p/q2");
    expect((3, 3, 4), "a change in a clean p");
    // p changes outside the log: the walk up from q3 meets p, named by a live record and no
    // longer clean, so the whole lower's write-back, which expires every record so far.
    f.exec("os.mkdir(os.path.join(d, 'p/o'))");
    a.unlink("p/q3/x");
    expect((4, 3, 5), "first change in q3, p changed outside the log");
    // After a crash the tree is as the programs left it.
    killed_and_recovered(s, [a, f], &root, &pm);
    for gone in ["p/q1", "p/q2", "p/q3/x"] {
        assert!(!root.join(gone).exists(), "{gone} came back");
    }
    for there in ["p/q3", "p/o"] {
        assert!(root.join(there).is_dir(), "{there} lost");
    }
}

/// A program that has synced nothing under the root (an untar, a build, `rm -rf`) runs its
/// namespace operations as the lower's own: none is logged, none writes anything back. Its
/// first one logged after it synced (in a directory clean through the log, which alone
/// would need no write-back) first makes those durable: a power cut must not keep it and
/// lose an earlier one. A program that synced nothing still logs its creations where files
/// born in the directory were synced (a mail delivery's). After a kill of everything and
/// recovery the tree is as the programs left it.
#[test]
fn a_program_that_synced_nothing_runs_its_namespace_operations_as_the_lowers_own() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = shm_region("unsynced");
    let s = Serve::start_unsynced(&root, &pm, &["--flush-interval-ms", "3600000"]);
    assert_eq!(s.stats()["unsynced_names"], true);
    // q syncs first (its first creation is the lower's own): its namespace operations
    // after are logged. It makes c (clean through the log) and m, where a file born there
    // is synced.
    let mut q = Py::spawn(s.run(), &root);
    q.exec("fd = os.open(os.path.join(d, 'q0'), os.O_CREAT | os.O_WRONLY, 0o644); os.write(fd, b'q'); os.fsync(fd); os.close(fd)");
    q.exec("os.mkdir(os.path.join(d, 'c')); os.mkdir(os.path.join(d, 'm'))");
    q.exec("fd = os.open(os.path.join(d, 'm/q1'), os.O_CREAT | os.O_WRONLY, 0o644); os.write(fd, b'q'); os.fsync(fd); os.close(fd)");
    let mut a = Py::spawn(s.run(), &root);
    let pid = a.pid();
    // (ns_write_backs, ns_ops, real_syncs) of a, and unsynced_ns_ops, once the stats show
    // `done` (they are written every 500 ms).
    let counts = |what: &str, done: &dyn Fn(&[u64; 4]) -> bool| -> [u64; 4] {
        let of = |v: &serde_json::Value| {
            let p = proc_stats(v, pid).unwrap_or_default();
            let g = |k: &str| p[k].as_u64().unwrap_or(0);
            let all = v["unsynced_ns_ops"].as_u64().unwrap_or(0);
            [g("ns_write_backs"), g("ns_ops"), g("real_syncs"), all]
        };
        of(&s.wait_stats(what, |v| done(&of(v))))
    };
    // a has synced nothing: a tree made and changed as the lower's own.
    a.exec("os.makedirs(os.path.join(d, 't/u'))");
    a.exec("open(os.path.join(d, 't/u/x'), 'w').write('x')");
    a.exec("os.rename(os.path.join(d, 't/u/x'), os.path.join(d, 't/z'))");
    a.create("t/u/gone");
    a.unlink("t/u/gone");
    a.exec("os.link(os.path.join(d, 't/z'), os.path.join(d, 't/u/z2'))");
    a.exec("os.symlink('z', os.path.join(d, 't/s'))");
    a.exec("os.mkdir(os.path.join(d, 't/v'))");
    a.rmdir("t/v");
    // Of a's operations, the first (t, in the root, which live records of q name: one
    // replayed over it could undo it) is logged; the nine after are the lower's own, as
    // was q's first creation, before its sync. Nothing written back.
    assert_eq!(
        counts("a's operations", &|c| c[3] == 10),
        [0, 1, 0, 10],
        "makedirs (2), create, rename, create, unlink, link, symlink, mkdir, rmdir"
    );
    // a syncs a file (the lower's own: a's first sync of it): its next namespace operation
    // is logged, in c (clean), after a write-back of what it did before.
    a.exec("fd = os.open(os.path.join(d, 't/z'), os.O_WRONLY); os.write(fd, b'y'); os.fsync(fd); os.close(fd)");
    let before = counts("a's sync", &|c| c[2] == 1);
    a.create("c/w");
    let after = counts("a creation in c", &|c| c[1] == before[1] + 1);
    assert_eq!(
        after,
        [before[0] + 1, before[1] + 1, 1, 10],
        "a's earlier operations written back first, then the creation in c logged"
    );
    a.create("c/w2");
    assert_eq!(
        counts("another creation in c", &|c| c[1] == after[1] + 1),
        [after[0], after[1] + 1, 1, 10],
        "written back once"
    );
    // Where files born are synced, a creation of a program that synced nothing is logged
    // even so (a mail delivery's: its first sync there can be absorbed).
    drop(q);
    let mut q = Py::spawn(s.run(), &root);
    q.create("m/b1");
    let qp = q.pid();
    let st = s.wait_stats("a creation in m", |v| {
        proc_stats(v, qp).is_some_and(|p| p["ns_ops"] == 1)
    });
    let p = proc_stats(&st, qp).unwrap();
    assert_eq!(
        (&p["ns_write_backs"], &st["unsynced_ns_ops"]),
        (&0.into(), &10.into()),
        "a creation where files born are synced: logged, nothing written back"
    );
    killed_and_recovered(s, [a, q], &root, &pm);
    assert_eq!(fs::read(root.join("t/z")).unwrap(), b"y");
    assert_eq!(fs::read(root.join("t/u/z2")).unwrap(), b"y");
    assert_eq!(fs::read_link(root.join("t/s")).unwrap(), Path::new("z"));
    for there in ["c/w", "c/w2", "m/b1", "m/q1", "q0"] {
        assert!(root.join(there).is_file(), "{there} lost");
    }
    for gone in ["t/u/x", "t/u/gone", "t/v"] {
        assert!(!root.join(gone).exists(), "{gone} came back");
    }
}

/// Over a journaled ext4 (a loop image), a write-back of the whole file system settles every
/// directory changed before it (`front::settle`): a tree made outside `pmstack run` costs one
/// namespace write-back, not one sync per directory it empties; a directory fsync there is
/// absorbed; a directory changed outside the log after that write-back is written back
/// again at its next logged change. After a kill of the daemon and recovery the tree is as
/// the programs left it.
#[test]
fn a_write_back_of_the_whole_lower_settles_the_directories_changed_before_it() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let base = tempfile::tempdir_in("/var/tmp").unwrap();
    let Some(lfs) = LoopFs::of("ext4", 64 << 20, base.path()) else {
        return;
    };
    let root = lfs.dir.join("r");
    // A tree made before the daemon started: every directory has changes the log lacks.
    for q in 0..5 {
        let dir = root.join(format!("p/q{q}"));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("x"), b"x").unwrap();
        fs::write(dir.join("y"), b"y").unwrap();
    }
    // Older than a write-back's mark by more than its margin (`settle::MARGIN_NS`, 100 ms)
    // however slowly what follows runs.
    std::thread::sleep(Duration::from_millis(300));
    let pm = shm_region("settle");
    let s = Serve::start_settling(
        &root,
        &pm,
        &["--flush-interval-ms", "3600000", "--log-unsynced-names"],
    );
    assert_eq!(s.stats()["settles_dirs"], true, "a journaled ext4 settles");
    let mut a = Py::spawn(s.run(), &root);
    let mut f = Py::spawn(Command::new("env"), &root);
    let pid = a.pid();
    let keys = ["ns_write_backs", "ns_ops", "absorbed_dir_fsync"];
    let expect = |want, what: &str| expect_counts(&s, pid, keys, want, what);
    // The root changed outside the log (p was made there): its first change writes back
    // (the whole lower where little is dirty, else the root alone).
    a.create("g");
    expect((1, 0, 0), "the root's first change");
    // A record naming the root is live, and the root changes outside the log again.
    a.create("h");
    expect((1, 1, 0), "a change in a clean root");
    f.create("z");
    // The root's next change: the root, named by a live record and not clean, cannot be
    // synced alone: the whole lower is written back, which settles every directory changed
    // before it (the tree, long before).
    a.create("k");
    expect((2, 1, 0), "a change in the root after one outside the log");
    // q0, q1, q2 and p: changed only before that write-back. An fsync of q1 has nothing to
    // do, nor have their first changes.
    a.exec("fd = os.open(os.path.join(d, 'p/q1'), os.O_RDONLY); os.fsync(fd); os.close(fd)");
    expect((2, 1, 1), "an fsync of a settled directory");
    a.unlink("p/q0/x");
    a.unlink("p/q1/x");
    a.unlink("p/q1/y");
    a.rmdir("p/q1");
    a.unlink("p/q2/x");
    expect((2, 6, 1), "first changes in settled directories");
    // q3 changes outside the log after the write-back: not settled; its next logged change
    // writes back.
    f.create("p/q3/w");
    a.unlink("p/q3/x");
    expect(
        (3, 7, 1),
        "a change in a directory changed outside the log since",
    );
    let settled = s.stats()["dirs_settled"].as_u64().unwrap();
    assert!(
        settled >= 3,
        "directories taken for clean as settled: {settled}"
    );
    killed_and_recovered(s, [a, f], &root, &pm);
    for gone in ["p/q0/x", "p/q1", "p/q2/x", "p/q3/x"] {
        assert!(!root.join(gone).exists(), "{gone} came back");
    }
    for there in [
        "g", "h", "z", "k", "p/q0/y", "p/q2/y", "p/q3/w", "p/q3/y", "p/q4/x",
    ] {
        assert!(root.join(there).exists(), "{there} lost");
    }
}

/// A removal finds its victim before it takes the namespace lock where the lock is busy or
/// the lower slow (`ns::pinned_early`). If another program puts another object at the name
/// in between, the removal's record must name the object it removed, not the one found
/// first: recovery removes a name only for the object the log took from it. The test holds
/// the removal between the two (`PMSTACK_TEST_EARLY_GATE`), renames another file over the
/// name from outside `pmstack run`, then, after the removal, puts the name back as a power
/// cut would leave it (durable: the rename, which the removal wrote back first; not
/// durable: the removal) and kills the daemon. Recovery must remove it again.
#[test]
fn a_removal_whose_name_changed_while_it_waited_for_the_lock_names_what_it_removed() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let g = tempfile::tempdir_in("/var/tmp").unwrap();
    let gate = g.path().join("gate");
    fs::create_dir(root.join("k")).unwrap();
    let (pm, s, mut a, mut f) = ns_write_backs_served(&root, "nsearly");
    let mut b = Py::spawn(
        {
            let mut c = s.run();
            c.env("PMSTACK_TEST_EARLY_GATE", &gate);
            c
        },
        &root,
    );
    a.exec("open(os.path.join(d, 'x'), 'w').write('old')");
    a.exec("open(os.path.join(d, 'y'), 'w').write('new')");
    // The object y names keeps a second name, so that the power cut below can give x back.
    f.exec("os.link(os.path.join(d, 'y'), os.path.join(d, 'k/keep'))");
    let rm = "os.unlink(os.path.join(d, 'x'))";
    b.send(rm);
    let t0 = Instant::now();
    while !g.path().join("gate.pinned").exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the removal never found x"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Found the object 'old'; now x names the object 'new'.
    f.exec("os.rename(os.path.join(d, 'y'), os.path.join(d, 'x'))");
    fs::write(g.path().join("gate.go"), b"").unwrap();
    b.done(rm);
    assert!(!root.join("x").exists() && !root.join("y").exists());
    // The power cut: the lower keeps x (the rename was made durable before the removal's
    // record), not its removal.
    f.exec("os.link(os.path.join(d, 'k/keep'), os.path.join(d, 'x'))");
    drop(b);
    killed_and_recovered(s, [a, f], &root, &pm);
    assert!(
        !root.join("x").exists(),
        "x came back: the removal's record named another object"
    );
    assert!(!root.join("y").exists(), "y came back");
    assert_eq!(fs::read_to_string(root.join("k/keep")).unwrap(), "new");
}

#[test]
fn a_mount_and_serve_of_one_lower_directory_refuse_each_other() {
    if !common::can_mount() {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let lower = d.path().join("lower");
    let mnt = d.path().join("mnt");
    fs::create_dir_all(&lower).unwrap();
    fs::create_dir_all(&mnt).unwrap();
    let pm = d.path().join("serve.pm");
    let mut s = Serve::start(&lower, &pm, &[]);
    // Another region for the same lower directory: each would replay its log over the
    // other's newer bytes.
    let out = Command::new(common::bin())
        .args(["mount", "--pm"])
        .arg(d.path().join("mount.pm"))
        .arg(&lower)
        .arg(&mnt)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the mount was not refused");
    assert!(err.contains("already in use by pmstack process"), "{err}");
    assert!(
        !fs::read_to_string("/proc/mounts")
            .unwrap()
            .contains(mnt.to_str().unwrap()),
        "refused, yet mounted"
    );
    s.stop();
    // With the daemon gone, the mount is fine (and a serve is refused while it runs).
    let out = Command::new(common::bin())
        .args(["mount", "--pm"])
        .arg(d.path().join("mount.pm"))
        .arg(&lower)
        .arg(&mnt)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(common::bin())
        .arg("serve")
        .arg(&lower)
        .arg("--pm")
        .arg(&pm)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("already in use"),
        "{err}"
    );
    let out = Command::new(common::bin())
        .arg("umount")
        .arg(&mnt)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn closing_files_releases_what_the_library_kept_for_them() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = shm_region("release");
    let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    // Each absorbed sync of a write-only descriptor opens a read descriptor for the bytes;
    // with a limit of 128 descriptors, 2000 files would run out if those were kept.
    let mut a = Py::spawn(s.run(), &root);
    a.exec(
        "import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))\n\
         open(os.path.join(d, 'prime'), 'w').close()\n\
         for i in range(2000):\n    p = os.path.join(d, f'm{i}')\n    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)\n    os.write(fd, b'mail')\n    os.fsync(fd)\n    os.close(fd)\n    os.unlink(p)",
    );
    // The loop did not just fall back to real syncs: its syncs were absorbed.
    let pid = a.pid();
    s.wait_stats("the syncs were absorbed", |v| {
        proc_stats(v, pid).is_some_and(|p| p["absorbed_fsync"].as_u64() >= Some(1900))
    });
    drop(a);
    s.stop();
    let _ = fs::remove_file(&pm);
}

/// Wait for `k` to exit, at most `limit`: past it the test fails saying `what` (a `Reaped`
/// holding `k` then kills it).
fn exited_within(k: &mut Child, limit: Duration, what: &str) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(st) = k.try_wait().unwrap() {
            return st;
        }
        assert!(t0.elapsed() < limit, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// For a test of the C program `tests/preload/NAME.c`: a temporary directory holding the
/// program, compiled, an empty `root` (canonical) and the path of a region; None where the
/// machine cannot run it (outside CI).
fn c_program(name: &str) -> Option<(tempfile::TempDir, PathBuf, PathBuf, PathBuf)> {
    if !common::can_mount() || !have("cc") {
        return None;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let exe = compile_c(name, d.path());
    let root = fs::canonicalize(d.path()).unwrap().join("root");
    fs::create_dir(&root).unwrap();
    let pm = d.path().join("region.pm");
    Some((d, exe, root, pm))
}

/// Compile the C program `tests/preload/NAME.c` into `dir` (with `-pthread -ldl`).
fn compile_c(name: &str, dir: &Path) -> PathBuf {
    compile_c_with(name, dir, &[])
}

/// `compile_c`, linked with the libraries `libs` too.
fn compile_c_with(name: &str, dir: &Path, libs: &[&str]) -> PathBuf {
    let exe = dir.join(name);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/preload/{name}.c"));
    let st = Command::new("cc")
        .args(["-O2", "-pthread", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-ldl")
        .args(libs)
        .status()
        .unwrap();
    assert!(st.success(), "compiling {}", src.display());
    exe
}

/// `args` started under `pmstack run` of `s`, with its standard input a pipe (it waits for
/// it to close), once it printed "done" (as its first line).
fn started_until_done(s: &Serve, args: &[&std::ffi::OsStr], round: usize) -> common::Reaped {
    let mut k = common::Reaped(vec![s
        .run()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()]);
    let out = k.0[0].stdout.take().unwrap();
    let first = BufReader::new(out).lines().next();
    assert!(
        matches!(&first, Some(Ok(l)) if l == "done"),
        "round {round}: {first:?}"
    );
    k
}

/// A crash of `s` with its program's records live (the program `k` killed while the daemon
/// is stopped, then the daemon): the next daemon recovers them. A dropped `Serve` removes
/// the region: the killed ones are kept in `killed` to the end.
fn crash_with_records_live(mut s: Serve, k: common::Reaped, killed: &mut Vec<Serve>) {
    s.freeze();
    drop(k);
    s.kill9();
    killed.push(s);
}

/// A descriptor that another thread closes while the process attaches, and then reuses for
/// a file outside the root, is not taken for the file the attach found under that number.
/// (It was: the attach's scan tracked the root file, the close ran natively beside it and
/// left the entry, and the outside file's writes and syncs were logged under the root
/// file's identity: after a crash, recovery wrote them into it.)
#[test]
fn a_descriptor_closed_while_the_process_attaches_is_not_taken_for_another_file() {
    let Some((d, exe, root, pm)) = c_program("attach_race") else {
        return;
    };
    let other = d.path().join("other");
    fs::create_dir(&other).unwrap();
    const N: usize = 200;
    const ROUNDS: usize = 4;
    // Each round races anew (fresh files, a fresh process) and ends in a crash with the
    // program's records live; the next daemon recovers them. Before the fix, every round on
    // this machine logged some of the outside files' writes. (A dropped `Serve` removes the
    // region: the killed ones are kept to the end.)
    let mut killed = Vec::new();
    for round in 0..ROUNDS {
        let s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
        let dir = root.join(format!("round{round}"));
        fs::create_dir(&dir).unwrap();
        for i in 0..N {
            fs::write(dir.join(format!("r{i}")), format!("ROOT-{round}-{i}")).unwrap();
        }
        let n = N.to_string();
        let k = started_until_done(
            &s,
            &[
                exe.as_os_str(),
                dir.as_os_str(),
                other.as_os_str(),
                n.as_ref(),
            ],
            round,
        );
        for i in 0..N {
            assert_eq!(
                fs::read(other.join(format!("o{i}"))).unwrap(),
                b"OTHER-BYTES"
            );
        }
        crash_with_records_live(s, k, &mut killed);
    }
    Serve::start(&root, &pm, &[]).stop();
    for round in 0..ROUNDS {
        for i in 0..N {
            let got = fs::read(root.join(format!("round{round}/r{i}"))).unwrap();
            assert_eq!(
                String::from_utf8_lossy(&got),
                format!("ROOT-{round}-{i}"),
                "round {round}: r{i} holds bytes written to another file"
            );
        }
    }
}

/// An attach waits for closing calls under way in other threads, but not forever: one that
/// waits for the attaching thread itself (an fclose flushing into a pipe that thread drains)
/// would hang the program. The attach is tried again later instead.
#[test]
fn an_attach_does_not_wait_forever_for_a_close_that_waits_for_it() {
    let Some((_d, exe, root, pm)) = c_program("attach_fclose") else {
        return;
    };
    let s = Serve::start(&root, &pm, &[]);
    let mut c = s.run();
    c.arg(&exe).arg(&root).stdout(Stdio::piped());
    let mut k = common::Reaped(vec![c.spawn().unwrap()]);
    exited_within(
        &mut k.0[0],
        Duration::from_secs(20),
        "the program hangs: its attach waits for a close that waits for it",
    );
    let mut out = String::new();
    k.0[0]
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert_eq!(out.trim(), format!("done {}", 1 << 19));
    assert!(root.join("first").exists() && root.join("second").exists());
    // The process did attach, and its second creation went through the library: the
    // first ran natively (the attach was given up), so the directory wrote back.
    let st = s.wait_stats("the program attached", |v| {
        v["attaches"].as_u64() >= Some(1) && v["attached_processes"].as_u64() == Some(0)
    });
    let t = &st["totals"];
    assert!(
        t["ns_ops"].as_u64().unwrap_or(0) + t["ns_write_backs"].as_u64().unwrap_or(0) >= 1,
        "{st}"
    );
}

/// Writes through a descriptor number that another thread keeps making a copy of another
/// file (dup2: a program swapping in its reopened log file) are logged under the file they
/// land in. (They were not: a write found what the number tracked, the swap went through,
/// and the bytes landed in the other file while the log held them under the first one's
/// identity; recovery wrote them into a file that never had them.)
#[test]
fn writes_racing_a_dup2_over_their_descriptor_are_logged_for_the_file_they_land_in() {
    let Some((_d, exe, root, pm)) = c_program("dup2_race") else {
        return;
    };
    const N: usize = 3000;
    const ROUNDS: usize = 2;
    // Each record in exactly one file of its pair, the other holding a hole there.
    let check = |dir: &Path, when: &str| {
        for (pair, names) in [["a", "b"], ["c", "d"]].iter().enumerate() {
            let files: Vec<Vec<u8>> = names
                .iter()
                .map(|n| fs::read(dir.join(n)).unwrap())
                .collect();
            let at = |f: &Vec<u8>, i: usize| -> Vec<u8> {
                f.get(64 * i..(64 * i + 64).min(f.len()))
                    .unwrap_or(&[])
                    .to_vec()
            };
            for i in 0..N {
                let rec = format!("pair {pair} record {i}");
                let holds: Vec<bool> = files
                    .iter()
                    .map(|f| at(f, i).starts_with(rec.as_bytes()))
                    .collect();
                assert!(
                    holds.iter().filter(|&&h| h).count() == 1,
                    "{when}: record {i} of pair {pair} is in {:?} of {names:?}",
                    holds
                );
                let other = at(&files[holds.iter().position(|&h| !h).unwrap()], i);
                assert!(
                    other.iter().all(|&b| b == 0),
                    "{when}: {} holds {:?} where record {i} of pair {pair} went to the other file",
                    names[holds.iter().position(|&h| !h).unwrap()],
                    String::from_utf8_lossy(&other)
                );
            }
        }
    };
    let mut killed = Vec::new();
    for round in 0..ROUNDS {
        let s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
        let dir = root.join(format!("round{round}"));
        fs::create_dir(&dir).unwrap();
        let n = N.to_string();
        let k = started_until_done(&s, &[exe.as_os_str(), dir.as_os_str(), n.as_ref()], round);
        check(&dir, "before the crash");
        crash_with_records_live(s, k, &mut killed);
    }
    Serve::start(&root, &pm, &[]).stop();
    for round in 0..ROUNDS {
        check(
            &root.join(format!("round{round}")),
            &format!("round {round} after recovery"),
        );
    }
}

/// A descriptor the library opened for itself (to read back what a write-only descriptor
/// wrote), closed by the program and reused for another file, is neither read nor closed by
/// the library as its own. (It was both: the next sync logged the other file's bytes under
/// the first one's identity, written into it by recovery after a crash, and the close of the
/// first file closed the program's descriptor of the other.)
#[test]
fn a_library_descriptor_the_program_closed_and_reused_is_not_taken_for_its_own() {
    let Some((_d, exe, root, pm)) = c_program("rfd_closed") else {
        return;
    };
    let s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let k = started_until_done(&s, &[exe.as_os_str(), root.as_os_str()], 0);
    let check = |when: &str| {
        let f = fs::read(root.join("f")).unwrap();
        assert!(
            f.len() == 256 << 10 && f.iter().all(|&b| b == b'C'),
            "{when}: f holds other bytes than its last write's: {:?}",
            String::from_utf8_lossy(&f[..64.min(f.len())])
        );
        let g = fs::read(root.join("g")).unwrap();
        assert!(g.len() == 256 << 10 && g[0] == b'g' && g[1..].iter().all(|&b| b == b'G'));
    };
    check("before the crash");
    let mut killed = Vec::new();
    crash_with_records_live(s, k, &mut killed);
    Serve::start(&root, &pm, &[]).stop();
    check("after recovery");
}

/// Paths in the program's stack or break heap are read in place by the library (no
/// process_vm_readv): in the main thread and in a thread on a stack the program mapped
/// itself, from malloc; so are paths in pages it read whole before, until the program
/// unmaps them (then EFAULT); a path with no NUL within PATH_MAX is left to the kernel
/// (ENAMETOOLONG), and so are pointers it answers EFAULT for (never mapped, or running into
/// an unmapped page). Every call answers as natively, and the ones on names under the root
/// were logged (not run natively for an unreadable path).
#[test]
fn namespace_calls_with_paths_in_the_stack_or_heap_answer_as_natively_and_are_logged() {
    let Some((d, exe, root, pm)) = c_program("stack_paths") else {
        return;
    };
    let plain = d.path().join("plain");
    fs::create_dir(&plain).unwrap();
    let run = |mut cmd: Command, dir: &Path, before_end: &dyn Fn(u32)| -> Vec<String> {
        let mut c = cmd
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = Vec::new();
        for l in BufReader::new(c.stdout.take().unwrap()).lines() {
            let l = l.unwrap();
            if l == "end" {
                before_end(c.id());
                break;
            }
            lines.push(l);
        }
        drop(c.stdin.take());
        assert!(c.wait().unwrap().success());
        lines
    };
    let native = run(Command::new(&exe), &plain, &|_| {});
    assert_eq!(native.len(), 27, "{native:?}");
    assert!(
        native.contains(&"unlink-bad -1 14".to_string()),
        "{native:?}"
    );
    assert!(native.contains(&"unlink-unterminated-at-unmapped -1 14".to_string()));
    assert!(native.contains(&"unlink-mapped-unmapped -1 14".to_string()));
    let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let mut cmd = s.run();
    cmd.arg(&exe);
    let ours = run(cmd, &root, &|pid| {
        // create, rename, link, unlink, mkdir, rmdir in each of the two threads, and a create
        // and an unlink by a heap path and two by an mmap'd one: logged, but the first, which
        // writes back what the root saw before (one namespace write-back).
        s.wait_stats("the calls were logged", |v| {
            proc_stats(v, pid as u64).is_some_and(|p| {
                p["ns_ops"].as_u64() == Some(17) && p["ns_write_backs"].as_u64() == Some(1)
            })
        });
    });
    assert_eq!(ours, native);
    s.stop();
}

/// A program whose own allocator makes system calls by number (`syscall(2)`, which the
/// library interposes) while it holds its initialization lock, as jemalloc does at its first
/// allocation (rustc), starts under `pmstack run`: the library allocates nothing on
/// that path. (It read the root from the environment into a new allocation there, which
/// waited for that lock for ever.)
#[test]
fn a_program_whose_allocator_makes_system_calls_while_it_starts_does_not_hang() {
    let Some((_d, exe, root, pm)) = c_program("malloc_init") else {
        return;
    };
    let mut s = Serve::start(&root, &pm, &[]);
    let mut k = common::Reaped(vec![s
        .run()
        .arg(&exe)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()]);
    let status = exited_within(
        &mut k.0[0],
        Duration::from_secs(20),
        "the program hung at its first allocation",
    );
    let mut out = String::new();
    std::io::Read::read_to_string(&mut k.0[0].stdout.take().unwrap(), &mut out).unwrap();
    s.stop();
    assert!(status.success() && out.trim() == "ok", "{status:?} {out:?}");
}

/// A child that does not attach (started without the library) and writes through a
/// descriptor it inherited opens nothing the daemon's watch sees, and the library sees none
/// of its writes: the parent's next sync must be real, however the child was started (fork
/// and execl, posix_spawnp, system, popen, vfork and execve). (It was absorbed, logging none
/// of the child's bytes: a power cut then lost them although the sync had returned.) A vfork
/// child borrows the parent's memory: one that writes, then closes the descriptor and every
/// other before its exec must leave the parent's library as it was (the parent's syncs are
/// absorbed again after the next real one; the vfork is a real vfork, `preload/src/spawn.rs`).
#[test]
fn a_sync_after_a_child_wrote_through_an_inherited_descriptor_is_real() {
    let Some((_d, exe, root, pm)) = c_program("spawn_inherit") else {
        return;
    };
    let s = Serve::start(&root, &pm, &[]);
    let f = root.join("f");
    let mut k = common::Reaped(vec![s
        .run()
        .arg(&exe)
        .arg(&f)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()]);
    let mut input = k.0[0].stdin.take().unwrap();
    let mut out = BufReader::new(k.0[0].stdout.take().unwrap()).lines();
    let first = out.next().unwrap().unwrap();
    let pid: u64 = first.strip_prefix("pid ").unwrap().parse().unwrap();
    let mut say = |cmd: &str| {
        writeln!(input, "{cmd}").unwrap();
        input.flush().unwrap();
        assert_eq!(out.next().unwrap().unwrap(), "ok", "{cmd}");
    };
    // (real syncs, absorbed fsyncs) of the program, as they are now (the shared table's
    // counters; the daemon's stats lag by up to half a second).
    let table = pmstack::front::table::Table::open(&pmstack::front::paths(&root).1).unwrap();
    let counts = || {
        use pmstack::front::table::{P_ABSORBED_FSYNC, P_FALLBACKS};
        let (_, r) = table.procs().into_iter().find(|(p, _)| *p == pid).unwrap();
        (r[P_FALLBACKS], r[P_ABSORBED_FSYNC])
    };
    const HOW: [&str; 6] = ["fork", "spawn", "system", "popen", "vfork-close", "vfork"];
    for how in HOW {
        // Until the file's syncs are absorbed (again: the daemon looks at its writers after
        // each child, and the sync after that is real).
        let t0 = Instant::now();
        loop {
            let before = counts();
            say("sync");
            if counts().1 == before.1 + 1 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "{how}: the file's syncs are never absorbed: {:?}",
                counts()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let before = counts();
        say(how);
        say("sync");
        let after = counts();
        assert!(
            after.1 == before.1 && after.0 > before.0,
            "{how}: the sync after the child's write was absorbed ({before:?} -> {after:?})"
        );
    }
    let text = fs::read_to_string(&f).unwrap();
    for how in HOW {
        assert!(
            text.contains(&format!("FOREIGN {how}\n")),
            "{how}: the child did not write: {text}"
        );
    }
}

/// B8: writes made inside the C library (POSIX AIO) through a descriptor opened O_DSYNC are
/// durable when acknowledged, and replay never rolls them back.
#[test]
fn posix_aio_writes_keep_o_dsync_under_pmstack_run() {
    let Some((_d, exe, root, pm)) = c_program("aio_dsync") else {
        return;
    };
    // Natively first: the program's own check must hold on the plain lower.
    let out = Command::new("timeout")
        .args(["-s", "KILL", "20"])
        .arg(&exe)
        .arg(root.join("native"))
        .arg("exit")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("done"), "native run: {text}");
    let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let mut k = s
        .run()
        .arg(&exe)
        .arg(root.join("f"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(k.stdout.take().unwrap()).lines();
    let mut last = String::new();
    for l in lines.by_ref() {
        last = l.unwrap();
        if last == "done" || last.starts_with("dirty") {
            break;
        }
    }
    let _ = k.kill();
    let _ = k.wait();
    assert_eq!(last, "done", "under pmstack run: {last}");
    s.kill9();
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    let got = fs::read(root.join("f")).unwrap();
    for (pg, want) in [(0usize, b'm'), (1, b'n'), (2, b'o'), (3, b'p')] {
        assert!(
            got[pg * 4096..(pg + 1) * 4096].iter().all(|&b| b == want),
            "page {pg} rolled back or lost"
        );
    }
}

/// A program started with its standard input and output piped: the guard that reaps it, its
/// pid, its input, and its output's lines.
struct Piped {
    k: common::Reaped,
    pid: u64,
    input: std::process::ChildStdin,
    out: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

fn piped(cmd: &mut Command) -> Piped {
    let mut k = common::Reaped(vec![cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()]);
    let pid = u64::from(k.0[0].id());
    let input = k.0[0].stdin.take().unwrap();
    let out = BufReader::new(k.0[0].stdout.take().unwrap()).lines();
    Piped { k, pid, input, out }
}

impl Piped {
    fn line(&mut self) -> String {
        self.out.next().unwrap().unwrap()
    }
}

/// (real syncs, absorbed fsyncs) of attached process `pid`, as the shared table counts them now
/// (the daemon's stats lag).
fn syncs_of(table: &pmstack::front::table::Table, pid: u64) -> (u64, u64) {
    use pmstack::front::table::{P_ABSORBED_FSYNC, P_FALLBACKS};
    let r = proc_counters(table, pid);
    (r[P_FALLBACKS], r[P_ABSORBED_FSYNC])
}

/// Writes through the kernel's asynchronous I/O are invisible to the library: Linux AIO
/// (`io_submit`, through `syscall(2)` and through libaio) and io_uring (through liburing,
/// which makes its system calls itself, and a ring inherited over exec). An fsync after such a
/// write must be the lower's own: each one was absorbed with nothing logged (fio's libaio
/// engine with fsync=1: 255,286 syncs absorbed, 0 bytes logged), and a power cut would have
/// lost every acknowledged write. The program checks with cachestat(2) that the written page
/// is clean after each fsync, once the file's ordinary syncs were absorbed.
#[test]
fn fsync_after_kernel_async_writes_is_real_under_pmstack_run() {
    if !common::can_mount() || !have("cc") {
        return;
    }
    if !Path::new("/usr/include/liburing.h").exists() {
        assert!(
            !ci(),
            "CI: liburing-dev is required by tests/preload.rs (installed by .ci/run)"
        );
        eprintln!("skipped: no liburing.h (apt-get install liburing-dev)");
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let exe = compile_c_with("kernel_aio", d.path(), &["-luring"]);
    let root = fs::canonicalize(d.path()).unwrap().join("root");
    fs::create_dir(&root).unwrap();
    // Every writer is attached: a new file's syncs are absorbed from the first.
    let s = Serve::start(
        &root,
        &d.path().join("r.pm"),
        &["--all-writers-attached", "--flush-interval-ms", "3600000"],
    );
    let table = pmstack::front::table::Table::open(&pmstack::front::paths(&root).1).unwrap();
    for how in ["io_submit", "libaio", "uring", "uring-exec"] {
        let f = root.join(format!("f-{how}"));
        let mut p = piped(s.run().arg(&exe).arg(how).arg(&f));
        assert_eq!(p.line(), "absorbed-rounds done", "{how}");
        let (_, absorbed) = syncs_of(&table, p.pid);
        if how == "uring-exec" {
            // The program holds a ring from its start: nothing of it is absorbed.
            assert_eq!(
                absorbed, 0,
                "{how}: a process holding a ring absorbed syncs"
            );
        } else {
            assert!(
                absorbed >= 3,
                "{how}: the file's ordinary syncs were not absorbed ({absorbed})"
            );
        }
        writeln!(p.input, "go").unwrap();
        p.input.flush().unwrap();
        let mut last = String::new();
        for l in p.out.by_ref() {
            last = l.unwrap();
            if last == "done" || last.starts_with("dirty") {
                break;
            }
        }
        let st = p.k.0[0].wait().unwrap();
        assert_eq!(last, "done", "{how}: {last} ({st})");
        assert!(st.success(), "{how}: {st}");
        let got = fs::read(&f).unwrap();
        for (pg, want) in [(0usize, b'e'), (1, b'f'), (2, b'g'), (3, b'h')] {
            assert!(
                got[pg * 4096..(pg + 1) * 4096].iter().all(|&b| b == want),
                "{how}: page {pg}"
            );
        }
    }
}

/// A reflink clone (FICLONE, FICLONERANGE: `cp --reflink`, coreutils' default on XFS and
/// Btrfs) gives a file another file's blocks inside the kernel, unseen by the library: the
/// fsync after it was absorbed with nothing logged, so a power cut could lose the cloned
/// bytes. It must be the lower's own (XFS on a loop image, through ioctl(3) and syscall(2)).
#[test]
fn fsync_after_a_reflink_clone_is_real_under_pmstack_run() {
    if !common::can_mount() || !have("cc") || !have("mkfs.xfs") {
        return;
    }
    let base = tempfile::tempdir_in("/var/tmp").unwrap();
    let Some(xfs) = common::LoopFs::of("xfs", 512 << 20, base.path()) else {
        return;
    };
    let exe = compile_c("clone_sync", base.path());
    let root = xfs.dir.join("root");
    fs::create_dir(&root).unwrap();
    let src = root.join("src");
    let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
    fs::write(&src, &data).unwrap();
    fs::File::open(&src).unwrap().sync_all().unwrap();
    // Every writer is attached: a new file's syncs are absorbed from the first.
    let mut s = Serve::start(
        &root,
        &base.path().join("r.pm"),
        &["--all-writers-attached", "--flush-interval-ms", "3600000"],
    );
    let table = pmstack::front::table::Table::open(&pmstack::front::paths(&root).1).unwrap();
    for how in ["ficlone", "ficlonerange", "syscall"] {
        let dst = root.join(format!("dst-{how}"));
        let mut p = piped(s.run().arg(&exe).arg(&src).arg(&dst).arg(how));
        assert_eq!(p.line(), "ready", "{how}");
        let before = syncs_of(&table, p.pid);
        assert!(
            before.1 >= 3,
            "{how}: the file's ordinary syncs were not absorbed: {before:?}"
        );
        p.input.write_all(b"g").unwrap();
        p.input.flush().unwrap();
        assert_eq!(p.line(), "cloned", "{how}");
        let after = syncs_of(&table, p.pid);
        assert!(
            after.1 == before.1 && after.0 > before.0,
            "{how}: the fsync after the clone was absorbed ({before:?} -> {after:?})"
        );
        drop(p.input);
        assert!(p.k.0[0].wait().unwrap().success(), "{how}");
        assert!(fs::read(&dst).unwrap() == data, "{how}: the clone's bytes");
    }
    s.stop();
}

/// A descriptor received over a Unix socket (SCM_RIGHTS) by a process that was already
/// attached was not tracked: its writes were invisible, and the sender's next fsync was
/// absorbed without them (page dirty, nothing logged: a power cut lost an acknowledged
/// write). Received descriptors are now tracked (recvmsg, recvmmsg, syscall(2)).
#[test]
fn writes_through_a_descriptor_received_over_a_socket_are_covered_by_the_senders_fsync() {
    page_one_survives_the_fsync(
        "fd_pass",
        &["recvmsg", "recvmmsg", "syscall"],
        b'B',
        ALL_ATTACHED,
    );
}

/// A descriptor opened by open_by_handle_at (the C library's, or through syscall(2)) or by
/// openat2 was not tracked (the first) or tracked only through syscall(2) (the second): an
/// fsync through another descriptor of the file was absorbed without its writes.
#[test]
fn writes_through_descriptors_opened_by_handle_or_openat2_are_covered_by_fsync() {
    page_one_survives_the_fsync(
        "other_opens",
        &["by_handle", "by_handle_syscall", "openat2", "pidfd_getfd"],
        b'H',
        ALL_ATTACHED,
    );
}

/// A program exec'd in place by an attached process (here: one that lost `LD_PRELOAD`) does
/// not attach, and wrote through the descriptors it inherited unseen: another process's fsync
/// of the file was absorbed without its write. Before an exec the library now makes such
/// objects' syncs real (execve, execl, execvp: trampolines that keep a variadic call's
/// arguments; syscall(2)). With the watch on: with every writer declared attached, such a
/// program breaks the declaration.
#[test]
fn writes_of_a_program_execd_without_the_library_are_covered_by_fsync() {
    page_one_survives_the_fsync(
        "exec_unseen",
        &["execve", "execl", "execvp", "syscall"],
        b'W',
        &["--flush-interval-ms", "3600000"],
    );
}

/// Every writer attached (no watch): a new file's syncs are absorbed from the first, whatever
/// the daemon's timing.
const ALL_ATTACHED: &[&str] = &["--all-writers-attached", "--flush-interval-ms", "3600000"];

/// Run the C program `name` with each of `hows`: it writes page 1 of its file (as `byte`s)
/// through a path the library must see, then fsyncs the file and prints whether page 1 is
/// still dirty. Shown end to end: the daemon is stopped and killed, the page is lost from
/// the lower if it was not synced (as a power cut would lose it), and recovery must bring it
/// back.
fn page_one_survives_the_fsync(name: &str, hows: &[&str], byte: u8, serve: &[&str]) {
    let Some((d, exe, root, pm)) = c_program(name) else {
        return;
    };
    for how in hows {
        let f = root.join(format!("f-{how}"));
        let mut s = Serve::start(&root, &pm, serve);
        let mut p = piped(s.run().arg(&exe).arg(&f).arg(how));
        let state = p.line();
        assert!(state == "dirty" || state == "clean", "{how}: {state}");
        // Nothing more reaches the lower: no write-back when the program exits.
        s.freeze();
        p.input.write_all(b"g").unwrap();
        drop(p.input);
        assert!(p.k.0[0].wait().unwrap().success(), "{how}");
        s.kill9();
        if state == "dirty" {
            // The power cut loses the unsynced page (after the kill: an open of a watched
            // file waits for the daemon's answer). Replay must give it back.
            let lower = fs::OpenOptions::new().write(true).open(&f).unwrap();
            use std::os::unix::fs::FileExt;
            lower.write_all_at(&[0u8; 4096], 4096).unwrap();
        }
        let mut s2 = Serve::start(&root, &pm, &[]);
        s2.stop();
        let got = fs::read(&f).unwrap();
        assert!(
            got.len() == 8192 && got[4096..].iter().all(|&b| b == byte),
            "{name} {how}: a write covered by an acknowledged fsync is lost (page 1 was \
             {state} after the fsync)"
        );
    }
    drop(d);
}

/// A truncate by path (truncate(2), Python's `os.truncate`) of a file with live log entries
/// ran natively: once the lower made the truncation durable, replay after a crash wrote the
/// cut bytes back (NVLog's no-rollback rule broken). It is now logged as ftruncate's is; so
/// is the truncation of a read-only O_TRUNC open (Linux truncates then too).
#[test]
fn a_truncate_by_path_is_never_undone_by_replay() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap().join("root");
    fs::create_dir(&root).unwrap();
    let pm = d.path().join("r.pm");
    let f = root.join("f");
    // Every writer attached; the file's first sync is real (its directory was not clean), the
    // next ones absorbed: its entries are live at the truncate.
    let mut s = Serve::start(
        &root,
        &pm,
        &["--all-writers-attached", "--flush-interval-ms", "3600000"],
    );
    let code = "import os, sys\nf = sys.argv[1]\nfd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)\nfor _ in range(3):\n    os.pwrite(fd, b'a' * 8192, 0)\n    os.fsync(fd)\nos.truncate(f, 50)\ng = os.open(f + '.ro', os.O_RDWR | os.O_CREAT, 0o644)\nfor _ in range(3):\n    os.pwrite(g, b'b' * 8192, 0)\n    os.fsync(g)\nos.close(os.open(f + '.ro', os.O_RDONLY | os.O_TRUNC))\nprint('done', flush=True)\nsys.stdin.read(1)\n";
    let mut p = piped(s.run().args(["python3", "-c", code]).arg(&f));
    assert_eq!(p.line(), "done");
    // The crash: nothing written back (the program's exit would), the daemon killed. The
    // lower keeps the truncation (as a journal commit would make it durable).
    s.freeze();
    p.input.write_all(b"g").unwrap();
    drop(p.input);
    assert!(p.k.0[0].wait().unwrap().success());
    s.kill9();
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    assert_eq!(
        fs::read(&f).unwrap(),
        vec![b'a'; 50],
        "replay undid a truncate the lower had made durable"
    );
    assert_eq!(
        fs::read(root.join("f.ro")).unwrap(),
        b"",
        "replay undid a read-only O_TRUNC open's truncation"
    );
}

/// Namespace operations under the root that the log cannot name ran natively and were not
/// durable on return: a rename or hard link between the root and a directory outside it, a
/// path with a trailing slash, a link of a descriptor (O_TMPFILE and linkat AT_EMPTY_PATH).
/// Each is now made durable as it returns (its directories under the root fsynced after the
/// namespace records that could undo it were written back) and counted (`unlogged_ns_ops`).
#[test]
fn namespace_operations_the_log_cannot_name_are_durable_on_return() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let base = fs::canonicalize(d.path()).unwrap();
    let (root, outside) = (base.join("root"), base.join("outside"));
    fs::create_dir(&root).unwrap();
    fs::create_dir(&outside).unwrap();
    let s = Serve::start(&root, &d.path().join("r.pm"), &[]);
    let code = "import ctypes, os, sys\nroot, out = sys.argv[1], sys.argv[2]\nfor n in ('x', 'y'):\n    with open(os.path.join(out, n), 'w') as f:\n        f.write(n)\nos.rename(os.path.join(out, 'x'), os.path.join(root, 'x'))\nos.link(os.path.join(out, 'y'), os.path.join(root, 'y'))\nos.mkdir(os.path.join(root, 'd') + '/')\nos.rename(os.path.join(root, 'y'), os.path.join(out, 'z'))\nfd = os.open(root, os.O_TMPFILE | os.O_RDWR, 0o644)\nos.write(fd, b't')\nlc = ctypes.CDLL(None, use_errno=True)\nassert lc.linkat(fd, b'', -100, os.path.join(root, 't').encode(), 0x1000) == 0, ctypes.get_errno()\nprint('done', flush=True)\nsys.stdin.read(1)\n";
    let mut p = piped(
        s.run()
            .args(["python3", "-c", code])
            .arg(&root)
            .arg(&outside),
    );
    assert_eq!(p.line(), "done");
    let table = pmstack::front::table::Table::open(&pmstack::front::paths(&root).1).unwrap();
    let unlogged = proc_counters(&table, p.pid)[pmstack::front::table::P_UNLOGGED_NS];
    p.input.write_all(b"g").unwrap();
    drop(p.input);
    assert!(p.k.0[0].wait().unwrap().success());
    assert_eq!(
        unlogged, 5,
        "rename in, link in, mkdir with a trailing slash, rename out, linkat of a descriptor"
    );
    assert_eq!(fs::read(root.join("x")).unwrap(), b"x");
    assert_eq!(fs::read(root.join("t")).unwrap(), b"t");
    assert!(root.join("d").is_dir() && !root.join("y").exists());
    assert_eq!(fs::read(outside.join("z")).unwrap(), b"y");
}

/// Namespace calls made through `syscall(2)` (as programs written before the C library had a
/// wrapper, or runtimes that make their own calls, do) are logged as their C library calls
/// are: before, they ran natively, not durable on return, and a logged creation replayed
/// after a crash brought back a file unlinked that way.
#[test]
fn namespace_calls_through_syscall_are_logged_and_never_undone_by_replay() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let (_d, root, pm, mut s) = quiet_serve();
    let mut a = Py::spawn(s.run(), &root);
    let pid = a.pid();
    a.exec(concat!(
        "import ctypes\n",
        "lc = ctypes.CDLL(None, use_errno=True)\n",
        "L = ctypes.c_long\n",
        "P = lambda n: ctypes.c_char_p(os.path.join(d, n).encode())\n",
        "for n in ('a', 'b'):\n",
        "    open(os.path.join(d, n), 'w').close()\n",
    ));
    let table = pmstack::front::table::Table::open(&pmstack::front::paths(&root).1).unwrap();
    let ns_ops = || proc_counters(&table, pid)[pmstack::front::table::P_NS_OPS];
    let before = ns_ops();
    a.exec(concat!(
        "assert lc.syscall(L(87), P('a')) == 0\n",
        "assert lc.syscall(L(82), P('b'), P('c')) == 0\n",
        "assert lc.syscall(L(83), P('e'), L(0o755)) == 0\n",
        "assert lc.syscall(L(88), P('c'), P('l')) == 0",
    ));
    let logged = ns_ops() - before;
    s.kill9();
    drop(a);
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    assert_eq!(
        logged, 4,
        "unlink, rename, mkdir and symlink through syscall(2)"
    );
    assert!(!root.join("a").exists(), "an unlink was undone by replay");
    assert!(!root.join("b").exists() && root.join("c").is_file());
    assert!(root.join("e").is_dir());
    assert_eq!(fs::read_link(root.join("l")).unwrap(), root.join("c"));
    drop(s);
}

/// `pmstack stat` of a served directory whose daemon died says so (it printed the dead
/// daemon's numbers with exit 0).
#[test]
fn stat_of_a_directory_whose_daemon_died_says_it_is_gone() {
    if !common::can_mount() {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap().join("root");
    fs::create_dir(&root).unwrap();
    let mut s = Serve::start(&root, &d.path().join("r.pm"), &[]);
    s.wait_stats("stats written", |v| v["pid"].as_u64().is_some());
    let st = |root: &Path| {
        Command::new(common::bin())
            .arg("stat")
            .arg(root)
            .output()
            .unwrap()
    };
    assert!(st(&root).status.success());
    s.kill9();
    let out = st(&root);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is gone"), "{err}");
}

/// A file a process synced and then opens again by the same path is opened through the
/// daemon's copy of the root's mount (`watch::open_tree`): those opens (an O_CREAT of it too)
/// do not wait for the daemon's watch, and a descriptor opened that way is tracked as any
/// other (its writes logged, its syncs absorbed). Another process's opens are still watched.
/// A path the program gives that is not readable is the kernel's EFAULT, as before (the
/// library looked it up among the paths it remembers and crashed the program).
#[test]
fn a_synced_file_opened_again_by_its_path_does_not_wait_for_the_watch() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = shm_region("tree");
    let watched = watched_opens;
    let absorbed = |v: &serde_json::Value| v["totals"]["absorbed_fsync"].as_u64().unwrap_or(0);
    let synced = |v: &serde_json::Value| fsyncs(&v["totals"]);
    let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let mut a = Py::spawn(s.run(), &root);
    a.exec(
        "p = os.path.join(d, 'f')\nfd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)\n\
         os.write(fd, b'a' * 4096)\nos.fsync(fd)\nos.close(fd)",
    );
    let v0 = s.wait_stats("the first sync is counted", |v| synced(v) >= 1);
    a.exec(
        "for i in range(20):\n    fd = os.open(p, os.O_RDONLY)\n    \
         assert os.read(fd, 1) == b'a'\n    os.close(fd)\n\
         fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)\n\
         os.write(fd, b'c' * 100)\nos.close(fd)\n\
         fd = os.open(p, os.O_RDWR)\nos.pwrite(fd, b'b' * 4096, 4096)\nos.fsync(fd)\nos.close(fd)\n\
         import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n\
         assert libc.open(ctypes.c_void_p(1), os.O_RDONLY) == -1 and ctypes.get_errno() == errno.EFAULT\n\
         os.chdir(d)\n\
         for q in ('g', d + '/./h'):\n    \
             fd = os.open(q, os.O_RDWR | os.O_CREAT, 0o644)\n    os.write(fd, b'g' * 10)\n    os.fsync(fd)\n    os.close(fd)\n    \
             for i in range(5):\n        fd = os.open(q, os.O_RDONLY)\n        assert os.read(fd, 10) == b'g' * 10\n        os.close(fd)",
    );
    // Besides the two files' syncs, that of f.
    let v = s.wait_stats("the later syncs are counted", |v| {
        synced(v) >= synced(&v0) + 3
    });
    assert_eq!(
        watched(&v),
        watched(&v0),
        "the process's own opens of the file it synced waited for the watch: {v}"
    );
    assert_eq!(
        absorbed(&v),
        absorbed(&v0) + 3,
        "the sync through the descriptor opened again was not absorbed: {v}"
    );
    // Another process (not attached) opening the file is still seen.
    let out = Command::new("cat").arg(root.join("f")).output().unwrap();
    assert!(out.status.success() && out.stdout.len() == 8192);
    let v = s.wait_stats("cat's open is watched", |v| watched(v) > watched(&v0));
    assert_eq!(watched(&v), watched(&v0) + 1, "{v}");
    drop(a);
    s.stop();
    let f = fs::read(root.join("f")).unwrap();
    assert_eq!(f.len(), 8192);
    assert!(f[..4096].iter().all(|&b| b == b'a') && f[4096..].iter().all(|&b| b == b'b'));
}

/// The paths remembered for opens through the copy of the root's mount are bounded: a
/// program that syncs and removes many files (a mail spool) forgets the paths it removed, so
/// the path of a file it synced first and keeps is still remembered after thousands of
/// others came and went (the map is emptied when it is full: 4,096 paths). Half of the
/// others are removed by unlink, half renamed away first: more than 4,096 each.
#[test]
fn paths_of_removed_files_are_forgotten() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = shm_region("forget");
    let watched = watched_opens;
    // (The first sync in a new root may be the lower's own.)
    let synced = |v: &serde_json::Value| fsyncs(&v["totals"]);
    let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let mut a = Py::spawn(s.run(), &root);
    a.exec(
        "p = os.path.join(d, 'kept')\nfd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)\n\
         os.write(fd, b'k' * 100)\nos.fsync(fd)\nos.close(fd)\n\
         for i in range(9000):\n    q = os.path.join(d, 'm%d' % i)\n    \
             fd = os.open(q, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)\n    \
             os.write(fd, b'm')\n    os.fsync(fd)\n    os.close(fd)\n    \
             if i % 2:\n        os.rename(q, q + '.old')\n        os.unlink(q + '.old')\n    \
             else:\n        os.unlink(q)",
    );
    let v0 = s.wait_stats("the syncs are counted", |v| synced(v) >= 9001);
    a.exec(
        "fd = os.open(p, os.O_RDONLY)\nassert os.read(fd, 200) == b'k' * 100\nos.close(fd)\n\
         fd = os.open(os.path.join(d, 'later'), os.O_RDWR | os.O_CREAT, 0o644)\n\
         os.write(fd, b'l')\nos.fsync(fd)\nos.close(fd)",
    );
    // Had the open waited for the watch, the daemon counted it before it answered, so before
    // the later sync (the stats read the watch's count after the syncs').
    let v = s.wait_stats("the later sync is counted", |v| synced(v) > synced(&v0));
    assert_eq!(
        watched(&v),
        watched(&v0),
        "the reopen of the file synced first waited for the watch: {v}"
    );
    drop(a);
    s.stop();
}

/// Opens wait for the daemon only while absorption depends on the file: a file an attached
/// process wrote and closed without syncing it is not watched; one that was synced, or that
/// another attached process holds, stays watched; one whose holder died is unmarked at the
/// next read open. A file born in a directory leaves the other opens there alone.
#[test]
fn only_files_that_absorption_depends_on_are_watched() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    // Outside the root: the attached processes' own opens of the region are not counted.
    let pm = shm_region("unwatch");
    fs::write(root.join("old"), b"old").unwrap();
    let cat = |name: &str| {
        let out = Command::new("cat").arg(root.join(name)).output().unwrap();
        assert!(out.status.success(), "cat {name}: {out:?}");
    };
    let watched = watched_opens;

    // 1. No write-back during this part: what is live stays live.
    let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let mut a = Py::spawn(s.run(), &root);
    // `g` first: once the process synced a file, the files it creates are marked at birth
    // (`f`, `h`; `files_are_watched_from_birth_only_where_syncs_are_expected`).
    a.exec(
        "for n in ('g', 'f'):\n    fd = os.open(os.path.join(d, n), os.O_RDWR | os.O_CREAT, 0o644)\n    \
         os.write(fd, b'x' * 4096)\n    if n == 'g':\n        os.fsync(fd)\n    os.close(fd)\n\
         h = os.open(os.path.join(d, 'h'), os.O_RDWR | os.O_CREAT, 0o644)",
    );
    let mut b = Py::spawn(s.run(), &root);
    // The open of `h` is watched (a holds it); when b closes it, a still holds it.
    b.exec("fd = os.open(os.path.join(d, 'h'), os.O_RDWR)\nos.write(fd, b'y')\nos.close(fd)");
    // Not watched: `f` (closed, nothing live) and `old` (in the directory where files were
    // born). Watched: `g` (live entries) and `h` (held).
    for n in ["f", "f", "old", "f", "g", "h"] {
        cat(n);
    }
    let v = s.wait_stats("the opens of g and h are seen", |v| watched(v) >= 3);
    assert_eq!(
        watched(&v),
        3,
        "only b's open of h, and cat of g and h: {v}"
    );
    assert_eq!(v["unmarks"], 1, "f, at its last close: {v}");
    drop(a);
    drop(b);
    s.stop();

    // 2. A file whose last holder died without closing it (and nobody synced) is unmarked at
    // the next read open; later opens cost nothing. A file that was synced keeps its mark
    // after its entries expired (its next syncs stay absorbable).
    let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "200"]);
    let mut a = Py::spawn(s.run(), &root);
    // A new daemon does not know the directory's state: the first creation writes
    // everything back, the next are logged. `k` is born after the sync of `s`: marked.
    a.exec(
        "open(os.path.join(d, 'p'), 'w').close()\n\
         s = os.open(os.path.join(d, 's'), os.O_RDWR | os.O_CREAT, 0o644)\nos.write(s, b's' * 4096)\n\
         os.fsync(s)\nos.close(s)\n\
         fd = os.open(os.path.join(d, 'k'), os.O_RDWR | os.O_CREAT, 0o644)\nos.write(fd, b'z' * 4096)",
    );
    drop(a); // killed: `k` is still held by a process that no longer exists
             // A snapshot taken after the sync of `s`: its LSN counter is past the sync's entries.
    let synced = |v: &serde_json::Value| fsyncs(&v["totals"]);
    let v = s.wait_stats("the sync of s is counted", |v| synced(v) >= 1);
    let lsn = v["lsn"].as_u64().unwrap();
    let v = s.wait_stats("the entries of s expire", |v| {
        v["checkpoint_lsn"].as_u64() >= Some(lsn)
    });
    let before = watched(&v);
    let unmarks = v["unmarks"].as_u64().unwrap();
    for _ in 0..4 {
        cat("k");
    }
    cat("s");
    cat("s");
    let v = s.wait_stats("the opens of s are seen", |v| watched(v) >= before + 3);
    assert_eq!(
        watched(&v),
        before + 3,
        "k at its first open only, s at both: {v}"
    );
    assert_eq!(v["unmarks"].as_u64(), Some(unmarks + 1), "k: {v}");
    s.stop();
    assert_eq!(fs::read(root.join("k")).unwrap(), vec![b'z'; 4096]);
    assert_eq!(fs::read(root.join("s")).unwrap(), vec![b's'; 4096]);
    let _ = fs::remove_file(&pm);
}

/// A dup2 over a tracked descriptor releases what that descriptor referred to, as a close
/// does: the file it held is no longer held by the process, and its watch goes when nothing
/// else needs it. (The replaced entry was dropped without that: the file stayed held, and
/// watched, until the process exited.)
#[test]
fn a_dup2_over_a_tracked_descriptor_releases_its_file() {
    let Some((_d, root, pm, s)) = served_tmp("dup2rel", &[]) else {
        return;
    };
    let mut a = Py::spawn(s.run(), &root);
    // The process syncs first: the files it creates are watched from birth.
    a.exec(&format!(
        "{WAIT_VETTED}expect_syncs()\n\
         f = os.open(os.path.join(d, 'f'), os.O_RDWR | os.O_CREAT, 0o644)\n\
         g = os.open(os.path.join(d, 'g'), os.O_RDWR | os.O_CREAT, 0o644)"
    ));
    let v = s.wait_stats("f and g are marked", |v| v["marks"].as_u64() >= Some(2));
    assert_eq!(v["unmarks"].as_u64(), Some(0), "{v}");
    a.exec("os.dup2(g, f)");
    // f: nobody holds it, nothing of it is live: unmarked.
    let v = s.wait_stats("f is unmarked", |v| v["unmarks"].as_u64() >= Some(1));
    assert_eq!(v["marks"].as_u64(), Some(2), "{v}");
    a.exec("os.close(f)\nos.close(g)");
    s.wait_stats("g is unmarked at its last close", |v| {
        v["unmarks"].as_u64() >= Some(2)
    });
    drop(a);
    drop(s);
    let _ = fs::remove_file(&pm);
}

/// Files are marked for the watch only where their syncs are expected
/// (`Client::sync_expected`): files a program writes and never syncs cost no mark, so none of
/// their opens and closes pays for one. The first file synced in a directory is synced for
/// real (it was not watched from its birth, so the daemon must vet it first); from then on
/// files born in that directory, also by another process, are watched from their birth and
/// absorbed from their first sync, and so are the files the syncing process creates
/// anywhere. In a directory where nothing was synced, a new process's first sync is real.
#[test]
fn files_are_watched_from_birth_only_where_syncs_are_expected() {
    use pmstack::front::table::*;
    let Some((_d, root, pm, mut s)) = served_tmp("predict", &["--flush-interval-ms", "3600000"])
    else {
        return;
    };
    let tab = Table::open(&pmstack::front::paths(&root).1).unwrap();
    let marks = || {
        tab.w(H_NEW_MARKS)
            .load(std::sync::atomic::Ordering::Acquire)
    };
    // (absorbed, real) syncs of a process.
    let syncs = |pid: u64| {
        let c = proc_counters(&tab, pid);
        (c[P_ABSORBED_FSYNC], c[P_FALLBACKS])
    };
    let mut a = Py::spawn(s.run(), &root);
    // The first creation after the daemon started writes everything back; the rest are
    // logged.
    a.exec(concat!(
        "for sub in ('hot', 'other', 'cold'):\n",
        "    os.mkdir(os.path.join(d, sub))\n",
        "for i in range(20):\n",
        "    p = os.path.join(d, 'hot', 'u%d' % i)\n",
        "    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)\n",
        "    os.write(fd, b'u' * 5000)\n",
        "    os.close(fd)\n",
        "    fd = os.open(p, os.O_WRONLY | os.O_APPEND)\n",
        "    os.write(fd, b'v')\n",
        "    os.close(fd)",
    ));
    assert_eq!(marks(), 0, "files nobody syncs were marked");
    a.exec(concat!(
        "fd = os.open(os.path.join(d, 'hot', 'x'), os.O_WRONLY | os.O_CREAT, 0o644)\n",
        "os.write(fd, b'x' * 5000)\n",
        "os.fsync(fd)\n",
        "os.close(fd)",
    ));
    assert_eq!(syncs(a.pid()), (0, 1), "x: not watched from its birth");
    assert_eq!(marks(), 1, "x is marked at its first sync");
    // Another process, in the directory where a file born there was synced.
    let mut b = Py::spawn(s.run(), &root);
    b.exec(concat!(
        "fd = os.open(os.path.join(d, 'hot', 'y'), os.O_WRONLY | os.O_CREAT, 0o644)\n",
        "os.write(fd, b'y' * 5000)\n",
        "os.fsync(fd)\n",
        "os.close(fd)",
    ));
    assert_eq!(syncs(b.pid()), (1, 0), "y: watched from its birth");
    // The process that synced, in a directory where nothing was synced.
    a.exec(concat!(
        "fd = os.open(os.path.join(d, 'other', 'w'), os.O_WRONLY | os.O_CREAT, 0o644)\n",
        "os.write(fd, b'w' * 5000)\n",
        "os.fsync(fd)\n",
        "os.close(fd)",
    ));
    assert_eq!(syncs(a.pid()), (1, 1), "w: watched from its birth");
    // A new process there: its first sync is real.
    let mut c = Py::spawn(s.run(), &root);
    c.exec(concat!(
        "fd = os.open(os.path.join(d, 'cold', 'z'), os.O_WRONLY | os.O_CREAT, 0o644)\n",
        "os.write(fd, b'z' * 5000)\n",
        "os.fsync(fd)\n",
        "os.close(fd)",
    ));
    assert_eq!(syncs(c.pid()), (0, 1), "z: not watched from its birth");
    drop((a, b, c));
    s.kill9();
    // What recovery replays (the absorbed syncs of y and w) is what the files hold.
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    for (n, b, len) in [
        ("hot/u3", b'u', 5001),
        ("hot/x", b'x', 5000),
        ("hot/y", b'y', 5000),
        ("other/w", b'w', 5000),
        ("cold/z", b'z', 5000),
    ] {
        let got = fs::read(root.join(n)).unwrap();
        assert_eq!(got.len(), len, "{n}");
        assert!(got[..5000].iter().all(|&c| c == b), "{n}");
    }
    let _ = fs::remove_file(&pm);
}

/// A chown that changes nothing (SQLite running as root gives each new journal the owner it
/// already has) leaves the file's syncs absorbed; one that changes the owner makes the next
/// sync real (the new owner must be as durable as the lower's fsync would make it).
#[test]
fn a_chown_that_changes_nothing_keeps_syncs_absorbed() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = shm_region("chown");
    let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
    let mut a = Py::spawn(s.run(), &root);
    // The first creation after the daemon started writes everything back (the directory's
    // state is unknown to it); `j` is born in a known directory, after a sync of `p` (so
    // its syncs are expected: it is watched from its birth).
    a.exec(
        "fp = os.open(os.path.join(d, 'p'), os.O_RDWR | os.O_CREAT, 0o644)\nos.fsync(fp)\nos.close(fp)\n\
         fd = os.open(os.path.join(d, 'j'), os.O_RDWR | os.O_CREAT, 0o644)\n\
         st = os.fstat(fd)\nos.fchown(fd, st.st_uid, st.st_gid)\n\
         os.write(fd, b'x' * 100)\nos.fsync(fd)\n\
         os.fchown(fd, 4321, st.st_gid)\nos.write(fd, b'y' * 100)\nos.fsync(fd)",
    );
    let pid = a.pid();
    let synced = fsyncs;
    let v = s.wait_stats("both syncs are counted", |v| {
        proc_stats(v, pid).is_some_and(|p| synced(&p) >= 3)
    });
    let p = proc_stats(&v, pid).unwrap();
    assert_eq!(
        (p["absorbed_fsync"].as_u64(), p["real_syncs"].as_u64()),
        (Some(1), Some(2)),
        "p's sync real, the no-op chown's absorbed, the owner change's real: {p}"
    );
    drop(a);
    s.stop();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(fs::metadata(root.join("j")).unwrap().uid(), 4321);
    let _ = fs::remove_file(&pm);
}

#[test]
fn a_write_only_file_synced_after_more_than_its_copy_is_logged_whole() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    use pmstack::front::table::*;
    // Writes through a write-only descriptor are copied up to a bound (64 KiB) as they are
    // made; a sync after more reads the rest back through a descriptor of its own. Every
    // byte must reach the log: after the daemon's death the lower copy is cut short (what a
    // power loss leaves of bytes nobody synced there), and recovery brings them all back.
    let (_d, root, pm, mut s) = quiet_serve();
    let want: Vec<u8> = (0..200_000u32).map(|k| (k % 253) as u8 + 1).collect();
    fs::write(root.join("want"), &want).unwrap();
    let mut a = Py::spawn(s.run(), &root);
    let pid = a.pid();
    a.exec(concat!(
        "data = open(os.path.join(d, 'want'), 'rb').read()\n",
        "fd = os.open(os.path.join(d, 'w'), os.O_CREAT | os.O_WRONLY, 0o644)\n",
        "os.fsync(fd)\n",
        "for k in range(0, len(data), 10000):\n",
        "    os.write(fd, data[k:k + 10000])\n",
        "os.fsync(fd)\n",
        "os.close(fd)",
    ));
    let tab = Table::open(&pmstack::front::paths(&root).1).unwrap();
    let c = proc_counters(&tab, pid);
    assert!(
        c[P_ABSORBED_FSYNC] >= 1 && c[P_UNSERVED] == 0,
        "the sync was not absorbed: {c:?}"
    );
    drop(a);
    s.kill9();
    fs::OpenOptions::new()
        .write(true)
        .open(root.join("w"))
        .unwrap()
        .set_len(0)
        .unwrap();
    let mut s2 = Serve::start(&root, &pm, &[]);
    s2.stop();
    assert!(
        fs::read(root.join("w")).unwrap() == want,
        "recovery did not bring back every synced byte"
    );
    drop(s);
}

/// The library every program under `pmstack run` loads needs the C library and nothing else:
/// not libgcc_s, whose constructor asks the CPU for its features at every program start (a
/// hypervisor exit per question in a virtual machine; `preload/build.rs`). The unwinder linked
/// in its place is hidden, so a program's own (C++ exceptions) stays the one it uses.
#[test]
fn the_preload_library_loads_nothing_but_the_c_library_and_exports_no_unwinder() {
    common::preload_built();
    let lib = std::path::Path::new(common::bin()).with_file_name("libpmstack_preload.so");
    let out = |args: &[&str]| {
        let o = Command::new(args[0])
            .args(&args[1..])
            .arg(&lib)
            .output()
            .unwrap_or_else(|e| panic!("{} (binutils) failed to start: {e}", args[0]));
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let needed: Vec<String> = out(&["readelf", "-d", "-W"])
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| Some(l.split('[').nth(1)?.trim_end_matches(']').to_string()))
        .collect();
    assert!(!needed.is_empty(), "no NEEDED entries found");
    for n in &needed {
        assert!(
            n.starts_with("libc.so") || n.starts_with("ld-linux"),
            "the preload library needs {n}: {needed:?}"
        );
    }
    let exported = out(&["nm", "-D", "--defined-only"]);
    assert!(
        !exported.contains("_Unwind_"),
        "the preload library exports an unwinder"
    );
    // The unwinder is there (a panic inside the library still prints its message).
    assert!(out(&["nm"]).contains("_Unwind_RaiseException"));
}

/// Over a lower whose directory change times are coarse (tmpfs here; ext4 and XFS on
/// kernels before 6.13), the library cannot tell its own directory changes from a change
/// another process made in the same clock tick (`front::ctime_fine`): the daemon says so in
/// its stats, no directory fsync is absorbed and every namespace operation is written back
/// by the lower's own syncs. The same program over ext4 (fine change times) has its
/// directory fsyncs absorbed: the control.
#[test]
fn over_coarse_change_times_directory_fsyncs_are_real_and_namespace_changes_written_back() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let script = concat!(
        "os.chdir(d)\n",
        "os.mkdir('sub')\n",
        "for i in range(5):\n",
        "    os.close(os.open('sub/f%d' % i, os.O_CREAT | os.O_WRONLY))\n",
        "    fd = os.open('sub', os.O_RDONLY)\n",
        "    os.fsync(fd)\n",
        "    os.close(fd)",
    );
    for (base, coarse) in [("/dev/shm", true), ("/var/tmp", false)] {
        let d = tempfile::tempdir_in(base).unwrap();
        let root = fs::canonicalize(d.path()).unwrap();
        if pmstack::front::ctime_fine(&root).unwrap() == coarse {
            // What this kernel gives: the test wants one lower of each kind.
            assert!(
                std::env::var("CI").is_err(),
                "{base} does not have {} change times on this kernel",
                if coarse { "coarse" } else { "fine" }
            );
            eprintln!("SKIPPED: {base} change times are not as expected here");
            continue;
        }
        let pm = shm_region(if coarse { "coarse" } else { "fine" });
        let mut s = Serve::start(&root, &pm, &["--flush-interval-ms", "3600000"]);
        let st = s.wait_stats("stats", |v| v["ctime_fine"].is_boolean());
        assert_eq!(st["ctime_fine"], !coarse, "{base}: {st}");
        let mut a = Py::spawn(s.run(), &root);
        let pid = a.pid();
        a.exec(script);
        a.exec("os.close(os.open('last', os.O_CREAT | os.O_WRONLY))");
        // 7 namespace operations and 5 directory fsyncs: over coarse change times each is
        // written back (none logged), over fine ones they are logged and absorbed (but the
        // root's first change, which writes back what came before).
        let done = |p: &serde_json::Value| {
            let g = |k: &str| p[k].as_u64().unwrap_or(0);
            if coarse {
                g("ns_write_backs") >= 12
            } else {
                g("ns_ops") >= 6 && g("absorbed_dir_fsync") >= 5
            }
        };
        let st = s.wait_stats("the program's stats", |v| {
            proc_stats(v, pid).is_some_and(|p| done(&p))
        });
        let p = proc_stats(&st, pid).unwrap();
        let g = |k: &str| p[k].as_u64().unwrap_or(0);
        if coarse {
            assert_eq!(
                (g("absorbed_dir_fsync"), g("ns_ops")),
                (0, 0),
                "{base}: {p}"
            );
            assert_eq!(g("ns_write_backs"), 12, "{base}: {p}");
        } else {
            // The mkdir writes back (the root's first change under the daemon); the 6
            // creations are logged (`sub` is clean from its birth).
            assert_eq!(
                (g("absorbed_dir_fsync"), g("ns_ops")),
                (5, 6),
                "{base}: {p}"
            );
            assert_eq!(g("ns_write_backs"), 1, "{base}: {p}");
        }
        drop(a);
        s.stop();
        let _ = fs::remove_file(&pm);
        for i in 0..5 {
            assert!(root.join(format!("sub/f{i}")).exists());
        }
    }
}

/// How `c` exited, if it did within `max` (else it is killed: None). A bound for a test that
/// would otherwise hang, not a measure of speed.
fn exit_within(c: &mut Child, max: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            return Some(st);
        }
        if t0.elapsed() > max {
            let _ = c.kill();
            let _ = c.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An attached process that made the file `w` under the root, wrote and synced it (twice:
/// the first sync marks it for the watch), and holds it open; and the file's path. Returns
/// once the daemon vetted it.
fn holding_a_watched_file(s: &Serve, root: &Path) -> (Py, PathBuf) {
    let mut a = Py::spawn(s.run(), root);
    a.exec(concat!(
        "f = os.open(os.path.join(d, 'w'), os.O_CREAT | os.O_WRONLY, 0o644)\n",
        "os.write(f, b'abc')\n",
        "os.fsync(f)\n",
        "os.fsync(f)\n",
    ));
    s.wait_stats("the file is marked and vetted", |v| {
        v["marks"].as_u64() >= Some(1) && v["marks_vetted"] == v["marks"]
    });
    (a, root.join("w"))
}

/// `cat FILE` by a process outside `pmstack run`: its exit status, None if it took longer
/// than `max` (it is killed).
fn cat_within(file: &Path, max: Duration) -> Option<std::process::ExitStatus> {
    let mut c = Command::new("cat")
        .arg(file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    exit_within(&mut c, max)
}

/// An attached process marks a file it syncs for the daemon's watch: every open of it, by
/// any process, then waits for the daemon's answer. The attached process holds a copy of
/// the watch's group, so the kernel keeps it, and its marks, when the daemon goes. A daemon
/// that stops must remove its marks and answer what waits. One that was killed leaves them:
/// the attached process releases them once it finds the daemon's process gone (at its next
/// call that asks whether the daemon serves), and the next `pmstack serve` does (it refuses
/// to start while the process runs, but no open waits any more). Before, an outside `cat`
/// of the file hung for as long as the attached process ran, in each case.
#[test]
fn a_daemon_that_stops_or_was_killed_leaves_no_open_of_a_watched_file_waiting() {
    for case in ["stopped", "killed, then a call", "killed, then a serve"] {
        let Some((_d, root, pm, mut s)) = served_tmp("watchgone", &[]) else {
            return;
        };
        let (mut a, w) = holding_a_watched_file(&s, &root);
        let cat = |what: &str| {
            assert!(
                cat_within(&w, Duration::from_secs(10)).is_some_and(|st| st.success()),
                "{case}: {what}: an open of the watched file waited for a daemon that is gone"
            );
        };
        cat("while served");
        if case == "stopped" {
            s.stop();
            cat("after the daemon stopped");
            continue;
        }
        s.kill9();
        let mut c = Command::new("cat")
            .arg(&w)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        if case == "killed, then a call" {
            // The daemon is taken for gone once its heartbeat is 2 s old: calls until then
            // are served as usual.
            let t0 = Instant::now();
            while c.try_wait().unwrap().is_none() {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "{case}: the attached process did not release the killed daemon's watch"
                );
                a.exec("os.fsync(f)");
                std::thread::sleep(Duration::from_millis(100));
            }
        } else {
            let out = Command::new(common::bin())
                .arg("serve")
                .arg(&root)
                .arg("--pm")
                .arg(&pm)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success() && err.contains("still running"),
                "a serve while the process runs: {err}"
            );
        }
        assert!(
            exit_within(&mut c, Duration::from_secs(10)).is_some_and(|st| st.success()),
            "{case}: the killed daemon's watch was not released"
        );
        cat("after the release");
        drop(a);
    }
}

/// When the kernel cannot open a descriptor of an open event's object for the daemon (over a
/// network lower, ESTALE for a file removed under the open; here, a full descriptor table),
/// it fails that open (EPERM) and the read of the events with the error: one event's, not
/// the watch's. The watch goes on answering the others. Before, the daemon took the error
/// for the end of its watch and stopped reading: every later open of a marked file waited.
#[test]
fn an_event_the_kernel_cannot_open_for_the_daemon_does_not_end_its_watch() {
    let Some((_d, root, _pm, s)) = served_tmp("watchemfile", &[]) else {
        return;
    };
    let (a, w) = holding_a_watched_file(&s, &root);
    let daemon = s.child.as_ref().unwrap().id() as i32;
    let cat = || cat_within(&w, Duration::from_secs(10));
    let nofile = |new: Option<libc::rlimit>| {
        let mut old = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        let p = new.as_ref().map_or(std::ptr::null(), |n| n as *const _);
        // SAFETY: plain system call on the daemon, our child.
        assert_eq!(
            unsafe { libc::prlimit(daemon, libc::RLIMIT_NOFILE, p, &mut old) },
            0
        );
        old
    };
    let before = nofile(None);
    // The daemon's lowest free descriptor number as its limit: the kernel cannot open the
    // event's descriptor for it. (Its other threads may free one meanwhile: tried again.)
    let mut denied = false;
    for _ in 0..20 {
        let used: std::collections::BTreeSet<i32> = fs::read_dir(format!("/proc/{daemon}/fd"))
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        let free = (0..).find(|n| !used.contains(n)).unwrap();
        nofile(Some(libc::rlimit {
            rlim_cur: free as u64,
            rlim_max: before.rlim_max,
        }));
        let st = cat();
        nofile(Some(before));
        let st = st.expect("an open the daemon could not be told of waited");
        if !st.success() {
            denied = true;
            break;
        }
    }
    assert!(
        denied,
        "the daemon's full descriptor table never failed an open event"
    );
    assert!(
        cat().is_some_and(|st| st.success()),
        "the watch ended with the event it could not open"
    );
    let v = s.wait_stats("the event error is counted", |v| {
        v["watch_event_errors"].as_u64() >= Some(1)
    });
    assert_eq!(v["watching"], true, "{v}");
    drop(a);
}

/// The daemon answers a process attaching on the thread that accepts connections (no thread
/// of its own: the attaching process would wait for one to start). A peer that connects and
/// says nothing, or stalls in the middle of its line, must not hold up anybody else's
/// attach: programs started meanwhile attach and finish.
#[test]
fn a_silent_or_stalled_peer_of_the_daemon_holds_up_no_attach() {
    if !common::can_mount() {
        return;
    }
    use std::io::Write;
    let (_d, root, _pm, s) = quiet_serve();
    let sock = pmstack::front::paths(&root).0;
    let _silent = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    let mut stalled = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    stalled.write_all(b"atta").unwrap();
    // The daemon writes its first stats a moment after its socket answers.
    let before = s.wait_stats("the daemon's first stats", |v| v["attaches"].is_u64())["attaches"]
        .as_u64()
        .unwrap();
    for i in 0..3 {
        let mut c = s
            .run()
            .arg("sh")
            .arg("-c")
            .arg(format!("echo {i} > {}/f{i}", root.display()))
            .spawn()
            .unwrap();
        let status = exit_within(&mut c, Duration::from_secs(60))
            .unwrap_or_else(|| panic!("program {i} did not finish: its attach is held up"));
        assert!(status.success(), "program {i}: {status}");
    }
    s.wait_stats("three more attached", |v| {
        v["attaches"].as_u64().is_some_and(|n| n >= before + 3)
    });
    for i in 0..3 {
        assert_eq!(
            fs::read_to_string(root.join(format!("f{i}"))).unwrap(),
            format!("{i}\n")
        );
    }
}

/// The pid of the process holding the namespace lock of table `t` (0: free): the lock word
/// without its waiters bit.
fn ns_lock_owner(t: &pmstack::front::table::Table) -> u64 {
    t.w(pmstack::front::table::H_NS_LOCK)
        .load(std::sync::atomic::Ordering::Acquire)
        & 0x3fff_ffff
}

/// A lock word of the shared table holds its owner's pid, which an exec keeps: a thread that
/// execs while another thread of its process holds the namespace lock must not leave that
/// lock held by the new program (every attached process would wait for it as long as that
/// program runs). The exec waits for the other thread's operation; another program's
/// namespace operation then completes while the new program still runs.
#[test]
fn an_exec_while_another_thread_holds_the_namespace_lock_leaves_it_free() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    use std::io::Write;
    let (_d, root, _pm, s) = quiet_serve();
    let script = concat!(
        "import os, sys, threading\n",
        "root = sys.argv[1]\n",
        "open(os.path.join(root, 'warm'), 'w').close()\n",
        "print('attached', flush=True)\n",
        "t = threading.Thread(target=lambda: os.mkdir(os.path.join(root, 'made')))\n",
        "t.start()\n",
        "sys.stdin.readline()\n",
        "os.execv('/bin/sleep', ['sleep', '60'])\n",
    );
    let mut p = s
        .run()
        .arg("python3")
        .arg("-c")
        .arg(script)
        .arg(&root)
        .env("PMSTACK_TEST_PAUSE_NS_MS", "1500")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(p.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line.trim(), "attached");
    // Wait until the thread's mkdir holds the namespace lock, then let the program exec.
    let t = pmstack::front::table::Table::open(&pmstack::front::paths(&root).1).unwrap();
    let pid = p.id() as u64;
    let t0 = Instant::now();
    while ns_lock_owner(&t) != pid {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the mkdir never took the lock"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    p.stdin.take().unwrap().write_all(b"go\n").unwrap();
    // Another program's namespace operation, while the new program (sleep 60) runs.
    let mut c = s
        .run()
        .arg("mkdir")
        .arg(root.join("other"))
        .spawn()
        .unwrap();
    let Some(status) = exit_within(&mut c, Duration::from_secs(30)) else {
        let _ = p.kill();
        panic!("another program's mkdir is held up by the lock the exec kept");
    };
    assert!(status.success());
    assert!(
        p.try_wait().unwrap().is_none(),
        "the exec'd program still runs"
    );
    assert!(
        root.join("made").is_dir(),
        "the other thread's mkdir completed before the exec"
    );
    let _ = p.kill();
    let _ = p.wait();
}

/// The fsync of a directory whose every change was logged costs nothing, and is told without
/// the namespace lock: it completes while another program's namespace operation holds that
/// lock (a test hook keeps a mkdir there for 30 s), and the lock is still that program's
/// afterwards. A directory changed outside `pmstack run` is not taken for one whose changes
/// were all logged: its fsync writes back.
#[test]
fn a_logged_directorys_fsync_does_not_wait_for_the_namespace_lock() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let (_d, root, _pm, s) = quiet_serve();
    let mut b = Py::spawn(s.run(), &root);
    let bpid = b.pid();
    // `y` is born through the log: every change of it is logged from its creation on.
    b.exec("os.mkdir(os.path.join(d, 'y'))");
    let fsync_y = "fd = os.open(os.path.join(d, 'y'), os.O_RDONLY)\nos.fsync(fd)\nos.close(fd)";
    b.exec(fsync_y);
    // The counts once the stats show that fsync (counted after the mkdir's).
    let v = s.wait_stats("the fsync of y, made through the log, absorbed", |v| {
        proc_stats(v, bpid).is_some_and(|p| p["absorbed_dir_fsync"].as_u64() == Some(1))
    });
    let p = proc_stats(&v, bpid).unwrap_or_default();
    let (wb0, ops0) = (
        p["ns_write_backs"].as_u64().unwrap_or(0),
        p["ns_ops"].as_u64().unwrap_or(0),
    );

    let mut a = s
        .run()
        .args(["python3", "-c", "import os, sys; os.mkdir(sys.argv[1])"])
        .arg(root.join("held"))
        .env("PMSTACK_TEST_PAUSE_NS_MS", "30000")
        .spawn()
        .unwrap();
    let t = pmstack::front::table::Table::open(&pmstack::front::paths(&root).1).unwrap();
    let lock_owner = || ns_lock_owner(&t);
    let apid = a.id() as u64;
    let t0 = Instant::now();
    while lock_owner() != apid {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the mkdir never took the lock"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    b.exec(fsync_y);
    assert_eq!(
        lock_owner(),
        apid,
        "the fsync of y waited for the namespace lock another program held"
    );
    expect_ns_counts(
        &s,
        bpid,
        (wb0, 2, ops0),
        "the fsync of y beside a held lock",
    );
    let _ = a.kill();
    let _ = a.wait();

    // A change the log lacks (a program outside `pmstack run`): y's fsync is real.
    fs::create_dir(root.join("y").join("outside")).unwrap();
    b.exec(fsync_y);
    let v = s.wait_stats("the fsync of y after a change outside writes back", |v| {
        proc_stats(v, bpid).is_some_and(|p| p["ns_write_backs"].as_u64().unwrap_or(0) > wb0)
    });
    let p = proc_stats(&v, bpid).unwrap_or_default();
    assert_eq!(
        p["absorbed_dir_fsync"].as_u64(),
        Some(2),
        "the fsync of y after a change outside was taken for one with nothing to do"
    );
}

/// A change of working directory is seen by the next relative path, whichever way it was
/// made: chdir, fchdir, syscall(SYS_chdir), syscall(SYS_fchdir), or the C library's own
/// internal calls (nftw with FTW_CHDIR), which the library cannot interpose. A file
/// outside the root (on the root's file system) opened by a relative path after a change to
/// there is not tracked: its syncs are the kernel's, counted nowhere; one under the root
/// after a change back is (its syncs are the library's); a namespace operation outside the
/// root is neither logged nor written back. (Guards any cache of the working directory:
/// keeping its stat between the changes the library sees, tried on 2026-11-27, took a
/// namespace operation in nftw's callback for one under the root.)
#[test]
fn a_change_of_working_directory_is_seen_by_the_next_relative_path() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let (_d, root, _pm, s) = quiet_serve();
    let out = tempfile::tempdir_in("/var/tmp").unwrap();
    // Files that exist: opened without O_CREAT, only the open's own judgement of the path
    // tells whether they are tracked (a creation's directory is looked up by its path).
    for f in ["b", "e"] {
        fs::write(out.path().join(f), b"").unwrap();
    }
    for f in ["a", "c", "g"] {
        fs::write(root.join(f), b"").unwrap();
    }
    let mut a = Py::spawn(s.run(), &root);
    let pid = a.pid();
    a.exec(&format!(
        concat!(
            "import ctypes\n",
            "libc = ctypes.CDLL(None, use_errno=True)\n",
            "out = {:?}\n",
            "outfd = os.open(out, os.O_RDONLY)\n",
            "def synced(name):\n",
            "    fd = os.open(name, os.O_WRONLY)\n",
            "    os.write(fd, b'x')\n",
            "    os.fsync(fd)\n",
            "    os.fsync(fd)\n",
            "    os.close(fd)\n",
            // A namespace operation under the root: counted after the syncs before it.
            "n = 0\n",
            "def mark():\n",
            "    global n\n",
            "    n += 1\n",
            "    os.mkdir(os.path.join(d, 'mark%d' % n))\n",
        ),
        out.path()
    ));
    // Syncs of tracked files (real or absorbed), once `ops` namespace operations are logged.
    let counts = |ops: u64| {
        let v = s.wait_stats("the marks counted", |v| {
            proc_stats(v, pid).is_some_and(|p| p["ns_ops"].as_u64() >= Some(ops))
        });
        let p = proc_stats(&v, pid).unwrap();
        let g = |k: &str| p[k].as_u64().unwrap_or(0);
        assert_eq!(g("ns_ops"), ops, "{p}");
        // Only the first change of the root wrote back: no operation outside the root
        // was taken for one under it (it would write back its directory's path).
        assert_eq!(g("ns_write_backs"), 1, "{p}");
        g("absorbed_fsync") + g("real_syncs")
    };
    // The first mkdir in the root writes back (changed outside the log); the next ones are
    // logged.
    // Each way of changing the working directory, tested by a change away from the root
    // (from a working directory under it, with its stat kept): a stat kept past it would
    // take a file outside for one under the root.
    let steps = [
        (
            "mark()\nos.chdir(d)\nsynced('a')",
            2,
            "under the root after chdir",
        ),
        (
            "os.chdir(out)\nsynced('b')",
            2,
            "outside the root after chdir",
        ),
        ("os.chdir(d)\nsynced('c')", 4, "under the root again"),
        (
            "os.fchdir(outfd)\nsynced('b')",
            4,
            "outside the root after fchdir",
        ),
        ("os.chdir(d)\nsynced('g')", 6, "under the root again"),
        (
            "assert libc.syscall(80, out.encode()) == 0\nsynced('e')",
            6,
            "outside the root after SYS_chdir",
        ),
        ("os.chdir(d)\nsynced('a')", 8, "under the root again"),
        (
            "assert libc.syscall(81, outfd) == 0\nsynced('e')",
            8,
            "outside the root after SYS_fchdir",
        ),
    ];
    let steps_len = steps.len() as u64;
    for (i, (code, syncs, what)) in steps.into_iter().enumerate() {
        a.exec(&format!("{code}\nmark()"));
        assert_eq!(counts(i as u64 + 1), syncs, "{what}");
    }
    // A change the library does not see: the C library's nftw changes directory with its
    // own internal calls (FTW_CHDIR). Neither the file opened by a relative path in its
    // callback nor the namespace operation there may be taken for one under the root.
    fs::create_dir(out.path().join("sub")).unwrap();
    fs::write(out.path().join("x"), b"").unwrap();
    a.exec(concat!(
        "os.chdir(d)\n",
        "synced('a')\n",
        "FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)\n",
        "def cb(path, sb, flag, ftw):\n",
        "    if path.endswith(b'/sub'):\n",
        "        fd = os.open('x', os.O_WRONLY)\n",
        "        os.write(fd, b'y')\n",
        "        os.close(fd)\n",
        "        os.mkdir('made')\n",
        "    return 0\n",
        "assert libc.nftw(out.encode(), FN(cb), 4, 4) == 0\n",
        "mark()",
    ));
    assert_eq!(
        counts(steps_len + 1),
        10,
        "a namespace operation after a change of directory the library did not see"
    );
    assert!(out.path().join("made").is_dir());
    drop(a);
    for f in ["b", "e"] {
        assert_eq!(fs::read(out.path().join(f)).unwrap(), b"x");
    }
    for f in ["a", "c", "g"] {
        assert_eq!(fs::read(root.join(f)).unwrap(), b"x");
    }
}

/// A program working outside the root that opens a file under it by a relative path (from
/// the root's parent: `data/sub/f`) tracks it as it would by the absolute path: its syncs
/// are the library's (absorbed or made real by it), whether the path is judged by its text
/// (the working directory's path, cached) or by the kernel.
#[test]
fn a_relative_path_from_outside_the_root_reaches_a_tracked_file() {
    if !common::can_mount() || !have("python3") {
        return;
    }
    let (_d, root, _pm, s) = quiet_serve();
    fs::create_dir(root.join("sub")).unwrap();
    fs::write(root.join("sub/f"), b"0").unwrap();
    let rel = Path::new(root.file_name().unwrap()).join("sub/f");
    let mut a = Py::spawn(s.run(), &root);
    let code = [
        "os.chdir(os.path.dirname(d))".to_string(),
        "for i in range(3):".to_string(),
        format!("    fd = os.open({:?}, os.O_RDWR)", rel.to_str().unwrap()),
        "    os.write(fd, b'x' * 100)".to_string(),
        "    os.fsync(fd)".to_string(),
        "    os.close(fd)".to_string(),
    ];
    a.exec(&code.join("\n"));
    let pid = a.pid();
    let st = s.wait_stats("the syncs counted", |v| {
        proc_stats(v, pid).is_some_and(|p| fsyncs(&p) >= 3)
    });
    drop(a);
    assert_eq!(
        fs::read(root.join("sub/f")).unwrap(),
        vec![b'x'; 100],
        "{st}"
    );
}

/// The daemon frees the table slots of objects nothing needs tracked any more (closed by
/// every attached process, their records expired), so a program that makes more files over
/// its life than the table has slots goes on logging each creation. Without the freeing, a
/// daemon that ran long enough had every slot taken: from then on each new file's creation
/// was written back (directory fsyncs up to the root, or a syncfs) instead of logged, and
/// an untar ran at a third of the lower's speed. Here 400 files go through a table of 64.
#[test]
fn a_program_that_makes_more_files_than_the_table_has_slots_goes_on_logging_them() {
    let Some((_d, root, pm, mut s, mut a)) = served_small_table("slots") else {
        return;
    };
    let pid = a.pid();
    let tab = pmstack::front::table::Table::open(&pmstack::front::paths(&root).1).unwrap();
    for round in 0..20 {
        a.exec(&format!(
            "for i in range(20): open(os.path.join(d, 'm', 'f{round}_%d' % i), 'w').close()"
        ));
        // Every file is closed, and its creation record expires at the next write-back
        // (within the 100 ms interval): past half of the table in use, the daemon frees
        // their slots (files first: the root's and `m`'s, directories, stay). At most 32 in
        // use leaves room for the next round's 20.
        let t0 = Instant::now();
        while tab.slots_used() > 32 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "round {round}: {} slots in use",
                tab.slots_used()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    s.wait_stats("slots freed", |v| {
        v["slots_freed"].as_u64() >= Some(400 - 32)
    });
    // Every creation logged; only the root's first change written back (its directory only:
    // nothing was live).
    let keys = ["ns_ops", "ns_write_backs", "ns_dir_write_backs"];
    expect_counts(&s, pid, keys, (400, 1, 1), "after 400 creations");
    // What was logged through reused slots is recovered as it was.
    drop(a);
    recovery_keeps_the_tree(&root, &pm, &mut s);
    assert_eq!(fs::read_dir(root.join("m")).unwrap().count(), 400);
}

/// Past half of the table, the daemon frees idle directories' slots too (after the files'):
/// a directory that lost its slot lost what the log knew of its entries, so its next change
/// writes back (makes it durable by the lower's means) instead of being logged, and nothing
/// logged in it before is lost. 60 directories through a table of 64.
#[test]
fn a_directory_whose_slot_was_freed_writes_back_at_its_next_change() {
    let Some((_d, root, pm, mut s, mut a)) = served_small_table("dirslots") else {
        return;
    };
    let pid = a.pid();
    a.exec("for i in range(60): os.mkdir(os.path.join(d, 'm', 'r%d' % i))");
    // 62 directories hold slots: once their records expire, the daemon frees them until no
    // more than 32 are in use.
    s.wait_stats("directories' slots freed", |v| {
        v["slots_freed"].as_u64() >= Some(30)
    });
    a.exec("for i in range(60): open(os.path.join(d, 'm', 'r%d' % i, 'f'), 'w').close()");
    // Each creation is logged where its directory kept its slot, or made durable by the
    // lower's means (a write-back, or fsyncs of its directory where no slot was free for the
    // moment); the counters as the process left them (the table, not the stats file).
    let tab = pmstack::front::table::Table::open(&pmstack::front::paths(&root).1).unwrap();
    let c = proc_counters(&tab, pid);
    use pmstack::front::table::{P_NS_OPS, P_NS_SYNCS, P_UNLOGGED_NS};
    let (logged, written_back, alone) = (c[P_NS_OPS], c[P_NS_SYNCS], c[P_UNLOGGED_NS]);
    assert!(
        logged < 60 + 60 && logged + written_back + alone >= 1 + 60 + 60,
        "after the creations: {logged} logged, {written_back} written back, {alone} fsynced alone"
    );
    drop(a);
    recovery_keeps_the_tree(&root, &pm, &mut s);
    for i in 0..60 {
        assert!(root.join(format!("m/r{i}/f")).exists(), "m/r{i}/f");
    }
}

/// A daemon whose table has 64 slots, writing back every 100 ms, and a Python program under
/// `pmstack run` of it that made the directory `m` (the root was made outside the log: its
/// first change is written back; `m`, made by it, is clean from its birth).
fn served_small_table(name: &str) -> Option<(tempfile::TempDir, PathBuf, PathBuf, Serve, Py)> {
    let (d, root, pm, s) =
        served_tmp(name, &["--flush-interval-ms", "100", "--table-slots", "64"])?;
    let mut a = Py::spawn(s.run(), &root);
    a.exec("os.mkdir(os.path.join(d, 'm'))");
    Some((d, root, pm, s, a))
}

/// Kill the daemon of `root` and start it again: its recovery leaves the tree as it was.
fn recovery_keeps_the_tree(root: &Path, pm: &Path, s: &mut Serve) {
    recovery_keeps_the_tree_after(root, pm, s, || {});
}

/// `recovery_keeps_the_tree`, with `then` run between the kill and the recovery (the end of
/// processes still attached to the killed daemon: a new one refuses to start beside them).
fn recovery_keeps_the_tree_after(root: &Path, pm: &Path, s: &mut Serve, then: impl FnOnce()) {
    let before = tree(root);
    s.kill9();
    then();
    let mut s2 = Serve::start(root, pm, &[]);
    s2.stop();
    assert_eq!(tree(root), before, "recovery changed the tree");
    let _ = fs::remove_file(pm);
}

/// An attached process that finds no free slot for a file it opens for writing writes it
/// untracked, as a process outside `pmstack run` would. Once the file gets a slot (others'
/// slots freed) and another attached process syncs it, the daemon's vetting must count the
/// first process as a writer it cannot see: every sync of the file is real while it holds
/// the file, or a sync absorbed from the log would not cover its writes (and replay could
/// roll them back). Before, attached processes were taken for seen whatever they held, and
/// the second sync here was absorbed.
#[test]
fn an_attached_process_that_found_no_slot_is_a_writer_the_daemon_cannot_see() {
    let Some((_d, root, pm, s)) = served_tmp(
        "noslot",
        &["--flush-interval-ms", "3600000", "--table-slots", "16"],
    ) else {
        return;
    };
    for i in 0..16 {
        fs::write(root.join(format!("h{i}")), b"").unwrap();
    }
    fs::write(root.join("f"), b"").unwrap();
    // A: sixteen files open for writing take the sixteen slots; f finds none.
    let mut a = Py::spawn(s.run(), &root);
    a.exec("hs = [os.open(os.path.join(d, f'h{i}'), os.O_RDWR) for i in range(16)]");
    a.exec("ff = os.open(os.path.join(d, 'f'), os.O_RDWR)\nos.pwrite(ff, b'a' * 100, 0)");
    s.wait_stats("f found no slot", |v| {
        v["slot_claims_refused"].as_u64() >= Some(1)
    });
    // A lets the sixteen go: the daemon frees their slots (more than half are in use).
    a.exec("for h in hs:\n    os.close(h)");
    s.wait_stats("idle slots freed", |v| v["slots_freed"].as_u64() >= Some(1));
    // B opens f (it gets a slot now), waits for the daemon to vet it, and syncs it twice,
    // A writing in between through its untracked descriptor.
    let mut b = Py::spawn(s.run(), &root);
    b.exec("expect_syncs()\nfd = os.open(os.path.join(d, 'f'), os.O_RDWR)\nwait_vetted(1)");
    b.exec("os.pwrite(fd, b'b' * 10, 200)\nos.fsync(fd)");
    a.exec("os.pwrite(ff, b'c' * 100, 0)");
    b.exec("os.pwrite(fd, b'b' * 10, 300)\nos.fsync(fd)");
    let v = s.wait_stats("B's two syncs", |v| {
        proc_stats(v, b.pid()).is_some_and(|p| fsyncs(&p) >= 2)
    });
    let p = proc_stats(&v, b.pid()).unwrap();
    assert!(v["foreign_writers"].as_u64() >= Some(1), "{v}");
    assert_eq!(p["absorbed_fsync"], 0, "{v}");
    assert_eq!(p["real_syncs"], 2, "{v}");
    drop(a);
    drop(b);
    drop(s);
    let _ = fs::remove_file(&pm);
}

/// The daemon holds a descriptor for each open event it is answering (the kernel opens the
/// object for it), for each live attached process, for each object it writes back. Like the
/// mount, it raises its soft descriptor limit to the hard one when it starts. A daemon started
/// with the common default of 1,024 (a shell, a service manager) could otherwise run out
/// under load, and the kernel would then fail its programs' opens with EPERM.
#[test]
fn the_daemon_raises_its_descriptor_limit_when_it_starts() {
    if !common::can_mount() {
        return;
    }
    common::preload_built();
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap();
    let pm = shm_region("nofile");
    let child = Command::new("sh")
        .args([
            "-c",
            r#"ulimit -Sn 256 && exec "$0" serve "$1" --pm "$2" --log-level warn"#,
        ])
        .arg(common::bin())
        .arg(&root)
        .arg(&pm)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut s = Serve {
        child: Some(child),
        dir: root.clone(),
        pm,
    };
    common::wait_for_serve(&root);
    let pid = s.child.as_ref().unwrap().id();
    let limits = fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let v: Vec<&str> = line.split_whitespace().collect();
    let (soft, hard) = (v[3], v[4]);
    assert!(
        soft == hard && soft != "256",
        "the daemon kept a soft descriptor limit of {soft} (hard {hard})"
    );
    s.stop();
}
