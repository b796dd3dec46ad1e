//! A file whose name the lower may not have made durable yet (a program outside `pmstack run`
//! made it, and nothing synced its directory since), then synced by an attached process: the
//! first sync is absorbed (its whole file logged, `Client::log_baseline`) instead of the
//! lower's own fsync, which would have committed the name with the journal. Over the crash
//! simulator's PM and a real lower directory, with the power cut the fault model allows: the
//! names the lower did not commit are gone, and so is a file's data it did not sync.

use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;

use super::procs::{attach_processes, close, counters, open_path};
use super::ScratchDir;
use crate::engine::Log;
use crate::front::table::{DEFAULT_SLOTS, P_ABSORBED_FSYNC, P_ABSORBED_OSYNC};
use crate::lower::RealLower;
use crate::pmem::sim::SimPmem;

/// `out/f`, both made by a program that is not attached and synced by nobody, then written
/// and fsynced by an attached one. Before 2026-11-28 the absorbed sync left the names to the
/// lower's next journal commit, and a power cut before it lost the file and its acknowledged
/// bytes: recovery found no object for the records' handle.
#[test]
fn a_file_made_outside_and_synced_under_run_keeps_its_name_through_a_power_cut() {
    for in_subdir in [false, true] {
        file_made_outside_then_synced(in_subdir, false);
    }
}

/// The same with the bytes written through an O_SYNC descriptor, absorbed as they are
/// written (logged before the lower sees them), and no fsync.
#[test]
fn a_file_made_outside_and_written_o_sync_under_run_keeps_its_name_through_a_power_cut() {
    for in_subdir in [false, true] {
        file_made_outside_then_synced(in_subdir, true);
    }
}

fn file_made_outside_then_synced(in_subdir: bool, o_sync: bool) {
    let dir = ScratchDir::new();
    let (lower, sim, d) =
        super::run::serve_sim(&dir.0, |l| RealLower::open(l).unwrap(), DEFAULT_SLOTS);
    let table_path = dir.0.join("table");
    // Everything so far (the marker) is durable: the power cut below takes back only what
    // comes after.
    RealLower::open(&lower).unwrap().syncfs().unwrap();
    let (pids, clients) = attach_processes(false, &table_path, d.table.epoch(), &sim, &lower);
    let c = &clients[0];

    // The program outside: no sync at all.
    let top = if in_subdir {
        lower.join("out")
    } else {
        lower.clone()
    };
    if in_subdir {
        fs::create_dir(&top).unwrap();
    }
    let f = top.join("f");
    fs::write(&f, b"outside").unwrap();
    let before = counters(&d.table, &pids);
    let absorbed_now = || {
        let w = d.table.counters_of(pids[0]).unwrap();
        w[P_ABSORBED_FSYNC] + w[P_ABSORBED_OSYNC]
    };
    let absorbed_before = absorbed_now();

    // The attached program: a write after those bytes, and an fsync (or the write through an
    // O_SYNC descriptor).
    let o = open_path(c, f.as_os_str().as_bytes(), o_sync, libc::O_RDWR);
    let mut bytes = crate::front::sys::Aligned::zeroed(6);
    bytes.copy_from_slice(b"synced");
    let n = c
        .write(
            &o.t,
            o.fd,
            crate::front::sys::ProgramBytes::of(&bytes),
            Some(7),
            false,
        )
        .unwrap();
    assert_eq!(n, 6);
    if !o_sync {
        c.fsync(&o.t, o.fd).unwrap();
    }
    assert_eq!(
        absorbed_now() - absorbed_before,
        1,
        "the sync is absorbed (what this test is about)"
    );
    let after = counters(&d.table, &pids);
    // The power cut, now: PM as flushed; the lower as far as something committed it. A real
    // sync of a file, or of a directory, or a syncfs (a namespace write-back) commits the
    // journal of a local file system, and with it every name made before.
    let img = sim.persisted_image();
    let file_synced = after.0 > before.0;
    let names_committed = file_synced || after.1 > before.1 || after.4 > before.4;
    close(c, o.fd);
    drop(clients);
    drop(d);
    if !names_committed {
        if in_subdir {
            fs::remove_dir_all(&top).unwrap();
        } else {
            fs::remove_file(&f).unwrap();
        }
    } else if !file_synced {
        // Named, but its bytes were never synced by the lower.
        lose_bytes(&f);
    }

    let sum = recover_image(img, &lower);
    let got = fs::read(&f).unwrap_or_else(|e| {
        panic!(
            "in_subdir {in_subdir}, O_SYNC {o_sync}: the synced file is gone after recovery ({e}; names committed: {names_committed}; {sum:?})"
        )
    });
    if o_sync {
        // The bytes before the write were never synced: the lower may have lost them (a
        // zeroed hole then), and the write is there.
        assert_eq!(
            &got[7..],
            b"synced",
            "in_subdir {in_subdir}, O_SYNC: {sum:?}"
        );
        assert!(
            &got[..7] == b"outside" || got[..7] == [0; 7],
            "in_subdir {in_subdir}, O_SYNC: {got:?} {sum:?}"
        );
    } else {
        assert_eq!(got, b"outsidesynced", "in_subdir {in_subdir}: {sum:?}");
    }
}

/// A daemon over the crash simulator's PM that lets processes that synced nothing run their
/// namespace operations as the lower's own (`H_UNSYNCED_NS`), a directory `d` made durable,
/// and two attached processes: `clients[0]` has synced nothing, `clients[1]` logs.
struct QuietAndLogging {
    dir: ScratchDir,
    lower: std::path::PathBuf,
    sub: std::path::PathBuf,
    sim: Arc<SimPmem>,
    d: crate::front::serve::Daemon,
    pids: Vec<u64>,
    clients: Vec<crate::front::client::Client>,
}

impl QuietAndLogging {
    fn new() -> QuietAndLogging {
        use crate::front::table::H_UNSYNCED_NS;
        use std::sync::atomic::Ordering;
        let dir = ScratchDir::new();
        let (lower, sim, d) =
            super::run::serve_sim(&dir.0, |l| RealLower::open(l).unwrap(), DEFAULT_SLOTS);
        d.table.w(H_UNSYNCED_NS).store(1, Ordering::Release);
        let sub = lower.join("d");
        fs::create_dir(&sub).unwrap();
        RealLower::open(&lower).unwrap().syncfs().unwrap();
        let table_path = dir.0.join("table");
        let (pids, clients) = attach_processes(true, &table_path, d.table.epoch(), &sim, &lower);
        clients[1].assume_synced();
        QuietAndLogging {
            dir,
            lower,
            sub,
            sim,
            d,
            pids,
            clients,
        }
    }

    /// The namespace target of `name` in `d`, as `c` finds it.
    fn target(&self, c: &crate::front::client::Client, name: &str) -> crate::front::ns::Target {
        super::procs::target(c, self.sub.join(name).as_os_str().as_bytes().to_vec())
    }

    /// The processes detached and the daemon gone: the lower, and what holds it.
    fn stop(self) -> (std::path::PathBuf, ScratchDir) {
        drop(self.clients);
        drop(self.d);
        (self.lower, self.dir)
    }
}

/// A directory's attribute change by a process that logs its namespace operations (an
/// untar giving directories their modes back, a `chmod`), with a namespace operation of a
/// process that synced nothing, run as the lower's own (`Client::unsynced_allowed`), in the
/// same directory between the attribute call's stat before and its stat after: the change
/// time recorded as logged must not follow the call over the unlogged creation, or the
/// directory is taken for clean and the next logged change there is not written back first
/// (a replayed record could then undo the unlogged change). The stats are taken around the
/// call by the library without the namespace lock, so the interleaving is real.
#[test]
fn an_unlogged_creation_during_a_directory_attribute_change_leaves_the_directory_unclean() {
    use crate::front::table::P_NS_SYNCS;
    let q = QuietAndLogging::new();
    let (d, pids, sub) = (&q.d, &q.pids, &q.sub);
    let (quiet, logs) = (&q.clients[0], &q.clients[1]);
    let target = |c: &crate::front::client::Client, name: &str| q.target(c, name);
    let create = |c: &crate::front::client::Client, name: &str| {
        let (fd, _, made) = c
            .create(
                &target(c, name),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o644,
                false,
            )
            .unwrap();
        assert!(made);
        // SAFETY: the descriptor the creation returned, not used again.
        unsafe { libc::close(fd) };
    };
    let ns_syncs = |pid: u64| d.table.counters_of(pid).unwrap()[P_NS_SYNCS];
    // The logging process's first creation in d writes d back (its change before, the
    // directory's own making, is not in the log) and leaves it clean.
    create(logs, "a");
    let syncs = ns_syncs(pids[1]);
    create(logs, "b");
    assert_eq!(
        ns_syncs(pids[1]),
        syncs,
        "a clean directory's creation writes nothing back"
    );
    // Their records expired (a live one naming d as a parent keeps every creation there
    // logged), d stays clean.
    d.write_back().unwrap();
    // The attribute call, with the unlogged creation between its stats.
    let dfd = fs::File::open(sub).unwrap();
    let st = || crate::front::sys::fstat(std::os::fd::AsRawFd::as_raw_fd(&dfd)).unwrap();
    let unlogged = logs.unlogged_ns_ops();
    let before = st();
    // Distinct change times (the lower's clock may not tick between two calls).
    std::thread::sleep(std::time::Duration::from_millis(5));
    create(quiet, "unlogged");
    assert_eq!(
        logs.unlogged_ns_ops(),
        unlogged + 1,
        "the quiet process ran its creation as the lower's own"
    );
    std::thread::sleep(std::time::Duration::from_millis(5));
    let fd = std::os::fd::AsRawFd::as_raw_fd(&dfd);
    // SAFETY: a descriptor this test holds open.
    let r = unsafe { libc::fchmod(fd, 0o750) };
    assert_eq!(r, 0);
    logs.dir_attrs_changed(unlogged, &before, &st());
    // The next logged change in d writes the unlogged creation back first.
    create(logs, "c");
    assert_eq!(
        ns_syncs(pids[1]),
        syncs + 1,
        "the directory was taken for clean over a change the log lacks"
    );
}

/// A file born through the log (its name durable), renamed by a process that synced nothing
/// (run as the lower's own, unlogged: `Client::unsynced_allowed`), then written and fsynced
/// by a process that logs, through the descriptor it created the file with (`reopen`: false)
/// or one opened by the new name. The absorbed fsync stands in for the lower's own, which
/// would have committed the rename with the journal: after a power cut the file must be
/// there under its new name with the synced bytes. Found 2026-12-04 by the crash simulator
/// (seed 4253722727292697009, `--mode run`): the file came back under its old name.
#[test]
fn a_file_renamed_by_a_process_that_synced_nothing_keeps_its_new_name_once_fsynced() {
    for reopen in [false, true] {
        renamed_unlogged_then_synced(reopen);
    }
}

fn renamed_unlogged_then_synced(reopen: bool) {
    let q = QuietAndLogging::new();
    let (pids, sub) = (&q.pids, q.sub.clone());
    let (quiet, logs) = (&q.clients[0], &q.clients[1]);
    let target = |c: &crate::front::client::Client, name: &str| q.target(c, name);
    let create = |name: &str| {
        logs.create(
            &target(logs, name),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
            0o644,
            false,
        )
        .unwrap()
    };
    // The first creation in d writes d back (its making is not in the log) and leaves it
    // clean: the next is logged.
    let (a, _, _) = create("a");
    // SAFETY: the descriptor the creation returned, not used again.
    unsafe { libc::close(a) };
    let (fd, born, made) = logs
        .create(
            &target(logs, "f"),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
            0o644,
            false,
        )
        .unwrap();
    assert!(made);
    let born_t = logs
        .track_born(fd, false, born.expect("the creation was logged"))
        .unwrap();
    // The creation's record expired: its name is the lower's, durable.
    q.d.write_back().unwrap();
    let unlogged = logs.unlogged_ns_ops();
    quiet
        .rename(&target(quiet, "f"), &target(quiet, "g"), 0)
        .unwrap();
    assert_eq!(
        logs.unlogged_ns_ops(),
        unlogged + 1,
        "the quiet process ran its rename as the lower's own (what this test is about)"
    );
    let before = counters(&q.d.table, pids);
    let absorbed_now = || q.d.table.counters_of(pids[1]).unwrap()[P_ABSORBED_FSYNC];
    let absorbed_before = absorbed_now();
    let g = sub.join("g");
    let reopened = reopen.then(|| open_path(logs, g.as_os_str().as_bytes(), false, libc::O_RDWR));
    let (t, wfd) = match &reopened {
        Some(o) => (&o.t, o.fd),
        None => (&born_t, fd),
    };
    let mut bytes = crate::front::sys::Aligned::zeroed(6);
    bytes.copy_from_slice(b"synced");
    let n = logs
        .write(
            t,
            wfd,
            crate::front::sys::ProgramBytes::of(&bytes),
            Some(0),
            false,
        )
        .unwrap();
    assert_eq!(n, 6);
    logs.fsync(t, wfd).unwrap();
    let after = counters(&q.d.table, pids);
    let absorbed = absorbed_now() - absorbed_before;
    // The power cut: PM as flushed; the lower as far as something committed it (a real sync
    // of a file or directory, or a namespace write-back, commits the journal and every name).
    let img = q.sim.persisted_image();
    let file_synced = after.0 > before.0;
    let names_committed =
        file_synced || after.1 > before.1 || after.3 > before.3 || after.4 > before.4;
    assert!(
        absorbed == 1 || file_synced,
        "reopen {reopen}: the fsync was neither absorbed nor real"
    );
    if let Some(o) = reopened {
        close(logs, o.fd);
    }
    close(logs, fd);
    drop(born_t);
    let (lower, _dir) = q.stop();
    let now = if names_committed {
        g.clone()
    } else {
        let f = sub.join("f");
        fs::rename(&g, &f).unwrap();
        f
    };
    if !file_synced {
        lose_bytes(&now);
    }
    let sum = recover_image(img, &lower);
    let got = fs::read(&g).unwrap_or_else(|e| {
        panic!(
            "reopen {reopen}: the fsynced file is not under its new name after recovery ({e}; names committed: {names_committed}; {sum:?})"
        )
    });
    assert_eq!(got, b"synced", "reopen {reopen}: {sum:?}");
}

/// The power cut's loss of a file's bytes the lower never synced (made empty: the files here
/// had none synced).
fn lose_bytes(path: &std::path::Path) {
    fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(0)
        .unwrap();
}

/// Recovery of the PM image `img` onto `lower`.
fn recover_image(img: Vec<u8>, lower: &std::path::Path) -> crate::core::recover::RecoverySummary {
    let (log2, s2) = Log::open(Arc::new(SimPmem::from_image(img))).unwrap();
    crate::core::recover::recover(&log2, &s2, &RealLower::open(lower).unwrap(), &|_, _| {}).unwrap()
}
