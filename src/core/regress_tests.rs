//! Regression tests for the losses the independent crash campaign found (issue "Lose
//! nothing", B1–B7): each drives the core (no FUSE) over a real lower directory and the
//! crash-simulating PM, crashes, recovers, and checks the contract. Each fails on the code
//! before its fix.

use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::recover::{recover, RecoverError, RecoverySummary};
use super::{Core, Mode};
use crate::engine::{Log, Record};
use crate::lower::RealLower;
use crate::pmem::sim::SimPmem;

struct Rig {
    _dir: tempfile::TempDir,
    lower: PathBuf,
    sim: Arc<SimPmem>,
    core: Arc<Core>,
}

fn rig() -> Rig {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let lower = dir.path().join("lower");
    fs::create_dir(&lower).unwrap();
    let (sim, core) = crate::sim::core_on_sim_pm(&lower, 512, 2, Mode::Sync);
    Rig {
        _dir: dir,
        lower,
        sim,
        core,
    }
}

/// The PM a crash leaves (what was flushed and fenced), opened and recovered onto `onto`.
fn recover_image(
    img: Vec<u8>,
    onto: &Path,
) -> (Arc<SimPmem>, Result<RecoverySummary, RecoverError>) {
    let pm = Arc::new(SimPmem::from_image(img));
    let (log, scan) = Log::open(pm.clone()).unwrap();
    let r = recover(&log, &scan, &RealLower::open(onto).unwrap(), &|_, _| {});
    (pm, r)
}

fn write_synced(c: &Core, parent: u64, name: &str, data: &[u8]) -> (u64, u64) {
    let (i, _, fh) = c
        .create(parent, OsStr::new(name), 0o644, libc::O_RDWR, 0, 0)
        .unwrap();
    assert_eq!(c.write(fh, 0, data).unwrap(), data.len());
    c.fsync(i.ino, Some(fh), true).unwrap();
    (i.ino, fh)
}

/// B1: an inode the kernel forgets and looks up again keeps its log identity, so an
/// acknowledged rmdir through the new inode is not undone by the old identity's create.
#[test]
fn forgotten_inodes_keep_their_identity_and_their_removals_stay_removed() {
    let r = rig();
    let c = &r.core;
    let dir = libc::S_IFDIR | 0o755;
    let (d, _) = c.mknod(1, OsStr::new("D"), dir, 0, None, 0, 0).unwrap();
    let (sub, _) = c
        .mknod(d.ino, OsStr::new("sub"), dir, 0, None, 0, 0)
        .unwrap();
    let (d_fid, sub_ino, d_ino) = (d.fid, sub.ino, d.ino);
    drop((d, sub));
    // The kernel evicts both (drop_caches), then looks them up again.
    c.forget(sub_ino, 1);
    c.forget(d_ino, 1);
    let (d2, _) = c.lookup(1, OsStr::new("D")).unwrap();
    assert_eq!(d2.fid, d_fid, "an object looked up again must keep its fid");
    let (sub2, _) = c.lookup(d2.ino, OsStr::new("sub")).unwrap();
    let (d2_ino, _) = (d2.ino, sub2.ino);
    c.remove(d2_ino, OsStr::new("sub"), true).unwrap();
    // kill -9: the lower keeps everything, PM what was committed.
    let (_, sum) = recover_image(r.sim.persisted_image(), &r.lower);
    sum.unwrap();
    assert!(r.lower.join("D").is_dir());
    assert!(
        !r.lower.join("D/sub").exists(),
        "an acknowledged rmdir came back after recovery"
    );
}

/// B1 with data: fsynced writes before and after an eviction both survive a power cut
/// that loses every unsynced byte of the lower file.
#[test]
fn fsynced_data_survives_eviction_and_power_cut() {
    let r = rig();
    let c = &r.core;
    let a = vec![b'A'; 8192];
    let (ino, fh) = write_synced(c, 1, "f", &a);
    let fid = c.inode(ino).unwrap().fid;
    c.release(fh);
    c.forget(ino, 1);
    let (i2, _) = c.lookup(1, OsStr::new("f")).unwrap();
    assert_eq!(i2.fid, fid);
    let fh2 = c.open(i2.ino, libc::O_RDWR).unwrap();
    c.write(fh2, 4000, &[b'B'; 300]).unwrap();
    c.fsync(i2.ino, Some(fh2), true).unwrap();
    // Power cut: nothing of the file's data was ever made durable by the lower.
    fs::OpenOptions::new()
        .write(true)
        .open(r.lower.join("f"))
        .unwrap()
        .set_len(0)
        .unwrap();
    let (_, sum) = recover_image(r.sim.persisted_image(), &r.lower);
    sum.unwrap();
    let mut want = a.clone();
    want[4000..4300].fill(b'B');
    assert_eq!(fs::read(r.lower.join("f")).unwrap(), want);
}

/// B5: an acknowledged unlink of one of two hard links, lost by the lower in a power cut, is
/// replayed: the name goes, the other stays.
#[test]
fn a_lost_unlink_of_a_hard_link_is_replayed() {
    let r = rig();
    let c = &r.core;
    let (ino, fh) = write_synced(c, 1, "a", b"hello");
    c.release(fh);
    c.link(ino, 1, OsStr::new("b")).unwrap();
    c.remove(1, OsStr::new("b"), false).unwrap();
    // Power cut: the lower lost the unlink (it still has both names).
    fs::hard_link(r.lower.join("a"), r.lower.join("b")).unwrap();
    let (_, sum) = recover_image(r.sim.persisted_image(), &r.lower);
    sum.unwrap();
    assert!(!r.lower.join("b").exists(), "the unlinked name is back");
    let md = fs::metadata(r.lower.join("a")).unwrap();
    assert_eq!(
        (md.nlink(), fs::read(r.lower.join("a")).unwrap()),
        (1, b"hello".to_vec())
    );
}

/// B4: recovery killed after it re-created a lost file but before it wrote the file's data,
/// then recovery again: the data is there (the re-created object was bound in the log).
#[test]
fn recovery_interrupted_after_recreating_a_file_loses_nothing() {
    let r = rig();
    let c = &r.core;
    let data: Vec<u8> = (0..10_000u32).map(|k| (k % 251) as u8).collect();
    write_synced(c, 1, "f", &data);
    let dir = libc::S_IFDIR | 0o755;
    let (d, _) = c.mknod(1, OsStr::new("d"), dir, 0, None, 0, 0).unwrap();
    write_synced(c, d.ino, "g", b"in a new directory");
    // Power cut: the lower lost every creation.
    fs::remove_file(r.lower.join("f")).unwrap();
    fs::remove_dir_all(r.lower.join("d")).unwrap();
    let img = r.sim.persisted_image();
    // First recovery, killed (here: a panic) right after the namespace phase.
    let pm = Arc::new(SimPmem::from_image(img));
    let (log, scan) = Log::open(pm.clone()).unwrap();
    let lower = RealLower::open(&r.lower).unwrap();
    let killed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        recover(&log, &scan, &lower, &|done, total| {
            if done < total {
                panic!("killed during recovery");
            }
        })
    }));
    assert!(killed.is_err());
    drop((log, scan));
    // Second recovery from what PM kept.
    let (_, sum) = recover_image(pm.persisted_image(), &r.lower);
    sum.unwrap();
    assert_eq!(fs::read(r.lower.join("f")).unwrap(), data);
    assert_eq!(
        fs::read(r.lower.join("d/g")).unwrap(),
        b"in a new directory".to_vec()
    );
    let names: Vec<_> = fs::read_dir(&r.lower)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with(".pmstack-") && n != crate::lower::MARKER)
        .collect();
    assert!(names.is_empty(), "recovery left temporary names: {names:?}");
}

/// B7: recovery onto a copy of the lower (same marker, other inodes) is refused and writes
/// nothing, to the copy or to the original.
#[test]
fn recovery_onto_a_copy_of_the_lower_is_refused_and_writes_nothing() {
    let r = rig();
    let c = &r.core;
    write_synced(c, 1, "f", b"acknowledged");
    let copy = r.lower.parent().unwrap().join("copy");
    assert!(std::process::Command::new("cp")
        .arg("-a")
        .arg(&r.lower)
        .arg(&copy)
        .status()
        .unwrap()
        .success());
    // Make the lower state differ so a replay anywhere would show.
    fs::write(r.lower.join("f"), b"x").unwrap();
    fs::write(copy.join("f"), b"y").unwrap();
    let (_, sum) = recover_image(r.sim.persisted_image(), &copy);
    let e = sum.expect_err("recovery onto a copy must be refused");
    assert!(e.to_string().contains("copy"), "{e}");
    assert_eq!(fs::read(copy.join("f")).unwrap(), b"y");
    assert_eq!(fs::read(r.lower.join("f")).unwrap(), b"x");
}

/// `recover` itself refuses a directory its region is not bound to (no marker, or another
/// one) and writes nothing there, so every caller of the library is protected, not only the
/// commands that open regions through `region::Region`; the log is kept for the right one.
#[test]
fn recovery_onto_another_directory_is_refused_by_the_library() {
    let r = rig();
    write_synced(&r.core, 1, "f", b"acknowledged");
    let other = r.lower.parent().unwrap().join("other");
    fs::create_dir(&other).unwrap();
    let img = r.sim.persisted_image();
    let (_, sum) = recover_image(img.clone(), &other);
    let e = sum.expect_err("a directory without a marker must be refused");
    assert!(matches!(e, RecoverError::UnmarkedLower { .. }), "{e}");
    crate::lower::write_marker(&other, [9; 16]).unwrap();
    let (_, sum) = recover_image(img.clone(), &other);
    let e = sum.expect_err("a directory with another marker must be refused");
    assert!(matches!(e, RecoverError::ForeignLower { .. }), "{e}");
    let names: Vec<_> = fs::read_dir(&other)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        names,
        [crate::lower::MARKER],
        "nothing may be written there"
    );
    fs::remove_file(r.lower.join("f")).unwrap();
    let (_, sum) = recover_image(img, &r.lower);
    sum.unwrap();
    assert_eq!(fs::read(r.lower.join("f")).unwrap(), b"acknowledged");
}

/// B3: live records whose binding is gone (a log written by the racy client) do not make the
/// region unrecoverable: everything else is applied, they are reported.
#[test]
fn records_without_a_binding_are_reported_and_the_rest_recovers() {
    let r = rig();
    let c = &r.core;
    write_synced(c, 1, "f", b"kept");
    {
        let log = c.log.as_ref().unwrap();
        let mut a = log.area();
        a.append(
            &Record::Data {
                fid: 987_654,
                off: 0,
                bytes: b"orphan".to_vec(),
            },
            None,
        )
        .unwrap();
        a.commit();
    }
    fs::remove_file(r.lower.join("f")).unwrap();
    let (_, sum) = recover_image(r.sim.persisted_image(), &r.lower);
    let sum = sum.unwrap();
    assert_eq!(sum.unbound_fids, vec![987_654]);
    assert_eq!(sum.unplaced.len(), 1);
    assert_eq!(fs::read(r.lower.join("f")).unwrap(), b"kept");
}

/// A symlink whose target is PATH_MAX long (4,095 bytes) with a NAME_MAX name is created,
/// logged and recovered (it made the daemon panic: "entry payload too large").
#[test]
fn path_max_symlink_targets_are_logged_and_recovered() {
    let r = rig();
    let c = &r.core;
    let target: Vec<u8> = (0..4095u32).map(|k| b'a' + (k % 26) as u8).collect();
    let name = "l".repeat(255);
    c.mknod(
        1,
        OsStr::new(&name),
        libc::S_IFLNK | 0o777,
        0,
        Some(&target),
        0,
        0,
    )
    .unwrap();
    // Power cut: the lower lost the creation.
    fs::remove_file(r.lower.join(&name)).unwrap();
    let (_, sum) = recover_image(r.sim.persisted_image(), &r.lower);
    sum.unwrap();
    assert_eq!(
        fs::read_link(r.lower.join(&name))
            .unwrap()
            .into_os_string()
            .into_encoded_bytes(),
        target
    );
}

/// Dirty bytes (written, not yet logged) that a fallocate moves (INSERT_RANGE) are logged
/// before it, so the Fallocate entry replays the move on top of them. Logged after it, at the
/// offsets they had, the bytes moved past the old dirty range were never logged: an fsynced
/// file lost them when the lower lost its unsynced state.
#[test]
fn dirty_bytes_moved_by_fallocate_survive_a_power_cut() {
    let r = rig();
    let c = &r.core;
    let (i, _, fh) = c
        .create(1, OsStr::new("f"), 0o644, libc::O_RDWR, 0, 0)
        .unwrap();
    c.write_back().unwrap(); // the empty file is durable in the lower
    let a: Vec<u8> = (0..8192u32).map(|k| (k % 251) as u8 + 1).collect();
    assert_eq!(c.write(fh, 0, &a).unwrap(), a.len()); // lazy: dirty, not logged
    const FALLOC_FL_INSERT_RANGE: i32 = 0x20;
    c.fallocate(fh, i.ino, 0, 4096, FALLOC_FL_INSERT_RANGE)
        .unwrap();
    c.fsync(i.ino, Some(fh), false).unwrap();
    let mut want = vec![0u8; 4096];
    want.extend_from_slice(&a);
    assert_eq!(fs::read(r.lower.join("f")).unwrap(), want);
    // Power cut: the lower keeps only what was durable (the empty file).
    fs::write(r.lower.join("f"), b"").unwrap();
    let (_, sum) = recover_image(r.sim.persisted_image(), &r.lower);
    sum.unwrap();
    assert_eq!(fs::read(r.lower.join("f")).unwrap(), want);
}

/// An fsync logs dirty bytes from the copy kept at write time, not by reading them back from
/// the lower file system (milliseconds per read on a network lower); what it logs is the
/// bytes last written to each offset, also when a logged (eager) write overwrote dirty ones.
#[test]
fn fsync_logs_dirty_bytes_without_reading_them_back() {
    let r = rig();
    let c = &r.core;
    // As on a network lower (a local one reads back instead).
    c.keep_copies
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let (i, _, fh) = c
        .create(1, OsStr::new("f"), 0o644, libc::O_RDWR, 0, 0)
        .unwrap();
    c.write_back().unwrap();
    let mut want = vec![0u8; 20000];
    for (k, (off, len)) in [(0u64, 5000usize), (3000, 9000), (100, 50), (15000, 5000)]
        .into_iter()
        .enumerate()
    {
        let d = vec![k as u8 + 1; len];
        c.write(fh, off, &d).unwrap();
        want[off as usize..off as usize + len].copy_from_slice(&d);
    }
    c.fsync(i.ino, Some(fh), true).unwrap();
    // A second round where the file turned eager (small writes) meets dirty bytes.
    for k in 0..4u64 {
        let d = vec![0xA0 + k as u8; 10];
        c.write(fh, 4096 * k + 7, &d).unwrap();
        want[(4096 * k + 7) as usize..(4096 * k + 17) as usize].copy_from_slice(&d);
        c.fsync(i.ino, Some(fh), true).unwrap();
    }
    c.write(fh, 6000, &[0x55; 3000]).unwrap();
    want[6000..9000].copy_from_slice(&[0x55; 3000]);
    c.fsync(i.ino, Some(fh), true).unwrap();
    assert_eq!(
        c.stats
            .readback_bytes
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "fsync read dirty bytes back from the lower"
    );
    fs::write(r.lower.join("f"), b"").unwrap();
    let (_, sum) = recover_image(r.sim.persisted_image(), &r.lower);
    sum.unwrap();
    assert_eq!(fs::read(r.lower.join("f")).unwrap(), want);
}

/// An attribute change is logged before the lower sees it; one the lower refuses (here a
/// fallocate mode no file system accepts: a punched hole must keep the size) must not stay
/// in the log: replayed after a crash it would fail (recovery could not finish) or, for a
/// change that could be made, apply what the caller was told did not happen. The refusal
/// writes the object back, which expires the record; recovery then replays nothing of the
/// file and its fsynced bytes are intact. Also checks the order: a truncate's record is in
/// the log by the time the lower has the new size.
#[test]
fn a_refused_attribute_change_never_replays() {
    let r = rig();
    let data = vec![7u8; 3 * 4096];
    let (i, fh) = write_synced(&r.core, 1, "f", &data);
    let e = r
        .core
        .fallocate(fh, i, 0, 4096, libc::FALLOC_FL_PUNCH_HOLE)
        .unwrap_err();
    assert!(
        matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)),
        "{e}"
    );
    // The lower's view: the file as it was (a power cut now keeps what write-back synced).
    let (_, res) = recover_image(r.sim.persisted_image(), &r.lower);
    let sum = res.expect("recovery finishes: no refused change is replayed");
    assert_eq!(sum.errors.len(), 0, "{sum:?}");
    assert_eq!(fs::read(r.lower.join("f")).unwrap(), data);
    // A truncate that the lower accepts: its record is durable in PM once it returns, so
    // recovery onto a lower that lost the truncate (its old size back) applies it.
    let r = rig();
    let (ino2, _) = write_synced(&r.core, 1, "g", &data);
    r.core
        .setattr(ino2, None, None, None, Some(4096), None, None)
        .unwrap();
    fs::write(r.lower.join("g"), &data).unwrap();
    let (_, res) = recover_image(r.sim.persisted_image(), &r.lower);
    res.unwrap();
    assert_eq!(fs::read(r.lower.join("g")).unwrap(), data[..4096].to_vec());
}

/// The VM rig (seed 734971817, `pmstack run` on fsdax): a power cut kept a directory and a
/// file in it that the log had removed (file, then directory), and recovery removed the
/// names the log removed in the order they first appeared: the directory first, which failed
/// with ENOTEMPTY, and the region could not be recovered. Removals now go on while any of
/// them makes progress, so a directory goes after what it holds.
#[test]
fn a_lost_rmdir_of_a_directory_with_lost_unlinks_inside_is_replayed() {
    use std::sync::atomic::{AtomicU8, Ordering};
    let r = rig();
    let c = &r.core;
    let (d, _) = c
        .mknod(1, OsStr::new("d"), libc::S_IFDIR | 0o755, 0, None, 0, 0)
        .unwrap();
    let (_, fh) = write_synced(c, d.ino, "f", b"inside");
    c.release(fh);
    // The power cut keeps the file and the directory. Each removal's first fence comes after
    // its intent is logged and before the lower sees it: there the file's object is kept by
    // a name outside the directory, and the directory's object is taken aside, an empty
    // stand-in left to be removed.
    let lower = r.lower.clone();
    let stage = Arc::new(AtomicU8::new(0));
    let st = stage.clone();
    r.sim.on_capture(Box::new(move || {
        match st.swap(0, Ordering::SeqCst) {
            1 => fs::hard_link(lower.join("d/f"), lower.join("keep-f")).unwrap(),
            2 => {
                fs::rename(lower.join("d"), lower.join("keep-d")).unwrap();
                fs::create_dir(lower.join("d")).unwrap();
            }
            _ => {}
        }
        0
    }));
    r.sim.capture_at_fences(1.0, 1, 1);
    stage.store(1, Ordering::SeqCst);
    c.remove(d.ino, OsStr::new("f"), false).unwrap();
    assert!(r.lower.join("keep-f").exists());
    stage.store(2, Ordering::SeqCst);
    c.remove(1, OsStr::new("d"), true).unwrap();
    assert!(r.lower.join("keep-d").exists());
    let _ = r.sim.take_images();
    // What the lower kept: the directory and the file in it, both removed by the log.
    fs::rename(r.lower.join("keep-d"), r.lower.join("d")).unwrap();
    fs::hard_link(r.lower.join("keep-f"), r.lower.join("d/f")).unwrap();
    fs::remove_file(r.lower.join("keep-f")).unwrap();
    let (_, sum) = recover_image(r.sim.persisted_image(), &r.lower);
    sum.unwrap();
    assert!(!r.lower.join("d").exists(), "the removed directory is back");
}

/// Over a lower that ignores syncfs (a FUSE or network client), whose fsync of a file need not
/// make the file's name durable: a sync that falls back to the lower's own (PM full) of a file
/// whose creation is still in the log writes a write-back record, and recovery then takes the
/// creation for made durable (`ReplayPlan::durable_creations`). The directories changed since
/// the last write-back must be synced before that record, or a power cut of the lower takes
/// the name, and the fsynced bytes with it. Fails without the directory syncs in
/// `write_back_file` (the same fault under `pmstack run` was found by the simulator:
/// `sim::run_tests`).
#[test]
fn a_fallback_sync_of_a_new_file_over_a_lower_that_ignores_syncfs_syncs_its_directories() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let lower = dir.path().join("lower");
    fs::create_dir(&lower).unwrap();
    let (_sim, core) = crate::sim::core_on_sim_lower(&lower, 64, 2, Mode::Sync, true);
    let (d, _) = core
        .mknod(1, OsStr::new("d"), libc::S_IFDIR | 0o755, 0, None, 0, 0)
        .unwrap();
    let dirs = Arc::new(AtomicUsize::new(0));
    let seen = dirs.clone();
    crate::lower::real::watch_syncs(Some(Box::new(move |fd| {
        let st = crate::lower::real::fstat(fd).unwrap();
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            seen.fetch_add(1, Ordering::Relaxed);
        }
    })));
    // More than the region holds: the fsync falls back.
    let data = vec![5u8; 1 << 20];
    // (The test's own thread: a panic leaves the watch behind with it.)
    write_synced(&core, d.ino, "f", &data);
    crate::lower::real::watch_syncs(None);
    assert!(
        core.stats.real_syncs.load(Ordering::Relaxed) > 0,
        "the fsync did not fall back: {:?}",
        core.stats.real_syncs
    );
    assert!(
        dirs.load(Ordering::Relaxed) > 0,
        "the fallback synced no directory: f's name may not be durable"
    );
}
