//! pmstack over a lower that is itself a FUSE file system (bindfs over ext4 here; GlusterFS,
//! JuiceFS and SeaweedFS clients are FUSE too). The kernel does not forward syncfs(2) to FUSE
//! file systems, so a write-back that trusts syncfs expires log entries whose data the file
//! system underneath never made durable (issue "Lose nothing", B6).

mod common;

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{bin, can_mount, LoopFs, Mount};

/// bindfs of `src` at `dst`, unmounted on drop.
struct BindFs(PathBuf);

impl BindFs {
    fn new(src: &Path, dst: &Path) -> BindFs {
        fs::create_dir_all(dst).unwrap();
        let st = Command::new("bindfs").arg(src).arg(dst).status();
        match st {
            Ok(s) if s.success() => BindFs(dst.to_owned()),
            other => panic!(
                "bindfs is needed for the FUSE-lower tests (apt-get install bindfs): {other:?}"
            ),
        }
    }
}

impl Drop for BindFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// `pmstack stat --json` of the served directory `dir` (null if it answers nothing).
/// Wake the daemon serving `bind` until it has made `n` more write-backs (at most a minute).
fn woken_write_backs(bind: &Path, n: u64) {
    let writebacks = || pmstack_stat(bind)["writebacks"].as_u64().unwrap_or(0);
    let w0 = writebacks();
    let table = pmstack::front::table::Table::open(&pmstack::front::paths(bind).1).unwrap();
    let t0 = Instant::now();
    while writebacks() < w0 + n {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no write-back within a minute of waking the daemon"
        );
        table
            .w(pmstack::front::table::H_WAKE)
            .store(1, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn pmstack_stat(dir: &Path) -> serde_json::Value {
    let out = Command::new(common::bin())
        .args(["stat", "--json"])
        .arg(dir)
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or_default()
}

/// A scratch directory under /var/tmp (removed on drop) with an empty `src` in it.
fn scratch_with_src(prefix: &str) -> (tempfile::TempDir, PathBuf) {
    let base = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/var/tmp")
        .unwrap();
    let src = base.path().join("src");
    fs::create_dir_all(&src).unwrap();
    (base, src)
}

/// Pages of `path` in the page cache that are dirty or under write-back (cachestat(2)).
fn unsynced_pages(path: &Path) -> u64 {
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct CacheStat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    let f = fs::File::open(path).unwrap();
    let range = Range { off: 0, len: 0 };
    let mut cs = CacheStat::default();
    // SAFETY: valid descriptor and pointers to structs of the kernel's layout.
    let r = unsafe {
        libc::syscall(
            451, // cachestat
            f.as_raw_fd(),
            &range as *const Range,
            &mut cs as *mut CacheStat,
            0,
        )
    };
    assert_eq!(r, 0, "cachestat: {}", std::io::Error::last_os_error());
    cs.nr_dirty + cs.nr_writeback
}

fn writebacks(mnt: &Path) -> u64 {
    let out = Command::new(bin())
        .args(["stat", "--json"])
        .arg(mnt)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["writebacks"].as_u64().unwrap_or(0)
}

#[test]
fn write_back_over_a_fuse_lower_makes_every_changed_object_durable() {
    if !can_mount() {
        return;
    }
    let base = tempfile::Builder::new()
        .prefix("pmstack-fuselower-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let Some(ext4) = LoopFs::new(base.path()) else {
        return; // not CI, and no loop devices: LoopFs said so
    };
    let bind = BindFs::new(&ext4.dir, &base.path().join("bind"));
    let mut m = Mount::new(Some(bind.0.clone()));
    m.mount(&["--flush-interval-ms", "100"]);
    let data: Vec<u8> = (0..65536u32).map(|k| (k % 253) as u8).collect();
    let f = fs::File::create(m.mnt.join("f")).unwrap();
    f.write_all_at(&data, 0).unwrap();
    f.sync_data().unwrap(); // absorbed: the bytes reach ext4's page cache, unsynced
    fs::create_dir(m.mnt.join("d")).unwrap();
    let g = fs::File::create(m.mnt.join("d/g")).unwrap();
    g.write_all_at(&data[..10_000], 0).unwrap();
    g.sync_all().unwrap();
    // Two write-backs after the syncs: the log entries of both files have expired.
    let w0 = writebacks(&m.mnt);
    let t0 = Instant::now();
    while writebacks(&m.mnt) < w0 + 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no write-back within a minute"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // What the log no longer holds must be durable in the file system under the FUSE lower.
    for p in [ext4.dir.join("f"), ext4.dir.join("d/g")] {
        assert_eq!(
            unsynced_pages(&p),
            0,
            "{} has dirty pages in ext4 after write-back expired its log entries",
            p.display()
        );
    }
    drop((f, g));
    m.umount();
    assert_eq!(fs::read(ext4.dir.join("f")).unwrap(), data);
}

/// Over a FUSE lower, file handles name the client's in-memory nodes: after the client is
/// remounted (what follows any node crash on a distributed file system) they are stale, or
/// open another object once the new client has handed out the same node number. Recovery must
/// still find every object the log names (by its recorded inode number) and replay all of it,
/// never take a stale handle for "deleted" (issue "Lose nothing", last item; "distributed
/// lowers").
#[test]
fn recovery_after_the_lower_client_was_remounted_replays_everything() {
    if !can_mount() {
        return;
    }
    over_remountable_bindfs(
        "pmstack-fuseremount-",
        common::remount::recover_after_client_remount,
    );
}

/// Run `test` over bindfs of a scratch directory, with a remount of bindfs for its `remount`.
fn over_remountable_bindfs(prefix: &str, test: fn(&Path, &dyn Fn())) {
    let (base, src) = scratch_with_src(prefix);
    let dst = base.path().join("bind");
    let bind = std::cell::RefCell::new(Some(BindFs::new(&src, &dst)));
    test(&dst, &|| {
        bind.borrow_mut().take();
        *bind.borrow_mut() = Some(BindFs::new(&src, &dst));
    });
}

/// The same through `pmstack run`: `pmstack serve` over the FUSE lower, killed with -9, the
/// client remounted before recovery.
#[test]
fn recovery_under_pmstack_run_after_the_lower_client_was_remounted_replays_everything() {
    if !can_mount() {
        return;
    }
    over_remountable_bindfs(
        "pmstack-fuseremount-run-",
        common::remount::recover_after_client_remount_under_run,
    );
}

/// The file handle the kernel gives for `p` (`name_to_handle_at`): on a FUSE file system it
/// carries the client's node id for the object.
fn handle_of(p: &Path) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // struct file_handle: handle_bytes (u32), handle_type (i32), then the handle.
    let mut buf = vec![0u8; 8 + 128];
    buf[..4].copy_from_slice(&128u32.to_ne_bytes());
    let mut mount_id: libc::c_int = 0;
    // SAFETY: a valid C string, a buffer of the size it declares, a valid out-pointer.
    let r = unsafe {
        libc::syscall(
            libc::SYS_name_to_handle_at,
            libc::AT_FDCWD,
            c.as_ptr(),
            buf.as_mut_ptr(),
            &mut mount_id,
            0,
        )
    };
    assert_eq!(
        r,
        0,
        "name_to_handle_at {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
    let n = u32::from_ne_bytes(buf[..4].try_into().unwrap()) as usize;
    buf.truncate(8 + n);
    buf
}

/// A file the kernel forgot (drop_caches) keeps its log identity when it is looked up again,
/// even though the FUSE lower then hands out another file handle for it (its client forgot
/// the object too, and numbers it anew). It got a new identity, so an acknowledged rename
/// after that named an object the log never created: after a power cut that lost the
/// creation, recovery re-made the file under its old name and the rename was lost (found
/// over GlusterFS under load: "acknowledged rename r40 missing").
#[test]
fn a_forgotten_file_keeps_its_identity_when_the_fuse_lower_renumbers_it() {
    if !can_mount() {
        return;
    }
    let (base, src) = scratch_with_src("pmstack-fuseforget-");
    let bind = BindFs::new(&src, &base.path().join("bind"));
    let mut m = Mount::new(Some(bind.0.clone()));
    m.mount(&["--flush-interval-ms", "3600000"]);
    let data: Vec<u8> = (0..300u32).map(|k| (k % 251) as u8 + 1).collect();
    {
        let f = fs::File::create(m.mnt.join("n")).unwrap();
        f.write_all_at(&data, 0).unwrap();
        f.sync_all().unwrap();
    }
    // Until bindfs numbers the file anew: the mount forgot it, and then bindfs did.
    let before = handle_of(&bind.0.join("n"));
    let t0 = Instant::now();
    while handle_of(&bind.0.join("n")) == before {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "bindfs kept the file's handle through a minute of drop_caches: this test cannot show what it is for"
        );
        fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
        std::thread::sleep(Duration::from_millis(10));
    }
    fs::rename(m.mnt.join("n"), m.mnt.join("r")).unwrap();
    fs::File::open(&m.mnt).unwrap().sync_all().unwrap();
    m.kill9();
    // The power cut: the lower lost the creation (and so the rename).
    fs::remove_file(src.join("r")).unwrap();
    m.mount(&[]);
    assert_eq!(
        fs::read(m.mnt.join("r")).ok(),
        Some(data),
        "the acknowledged rename was lost"
    );
    assert!(
        !m.mnt.join("n").exists(),
        "the file is back under its old name"
    );
    m.umount();
}

/// `pmstack serve` over a FUSE lower (issue "Over distributed file systems"): syncfs does not
/// reach it, so the daemon's write-back fsyncs each object the programs logged something
/// about (their files, the directories of their namespace operations), opening it by handle.
/// After two write-backs, nothing the log expired may be left unsynced in the file system
/// under the FUSE lower; the region then recovers to the same bytes after a kill -9.
#[test]
fn serve_over_a_fuse_lower_makes_every_changed_object_durable_at_write_back() {
    if !can_mount() {
        return;
    }
    let Some(mut o) = ServedOverBindfs::start("serve", &["--flush-interval-ms", "100"]) else {
        return; // not CI, and no loop devices: LoopFs said so
    };
    let (bind, ext4) = (o.bind.0.clone(), o.ext4.dir.clone());
    // A program under `pmstack run`: a file written and fsynced, a directory made, a file in
    // it written and fsynced, renamed, and the directory fsynced. And a file written without
    // a sync, then synced once two write-backs passed its write: the sync logs nothing of
    // bytes a write-back is taken to have made durable.
    let script = r#"
import json, os, sys, time
d, stats = sys.argv[1], sys.argv[2]
data = bytes((k % 253) for k in range(65536))
os.close(os.open(d + "/first", os.O_CREAT | os.O_WRONLY, 0o644))
fd = os.open(d + "/f", os.O_CREAT | os.O_WRONLY, 0o644); os.write(fd, data); os.fsync(fd); os.close(fd)
os.mkdir(d + "/d")
fd = os.open(d + "/d/g", os.O_CREAT | os.O_WRONLY, 0o644); os.write(fd, data[:10000]); os.fsync(fd); os.close(fd)
os.rename(d + "/d/g", d + "/d/h")
fd = os.open(d + "/d", os.O_RDONLY); os.fsync(fd); os.close(fd)
fd = os.open(d + "/lazy", os.O_CREAT | os.O_WRONLY, 0o644); os.write(fd, data[:100]); os.fsync(fd)
os.pwrite(fd, data[:20000], 0)
# The daemon's stats file (read, not a `pmstack stat`: a fork makes the library's syncs real).
def wb():
    try:
        with open(stats) as f:
            return json.load(f).get("writebacks", 0)
    except (OSError, ValueError):
        return 0
# A record now and then (a write and sync of another file): the daemon writes back every
# flush interval while records are live, but a lazy write alone waits for the kernel's own
# age of dirty pages (30 s).
w0, t0 = wb(), time.monotonic()
while wb() < w0 + 2:
    assert time.monotonic() - t0 < 60, "no write-back within a minute"
    t = os.open(d + "/tick", os.O_CREAT | os.O_WRONLY, 0o644); os.write(t, b"t"); os.fsync(t); os.close(t)
    time.sleep(0.05)
os.fsync(fd); os.close(fd)
"#;
    let stats = pmstack::front::paths(&bind).2;
    common::run_python(&bind, script, &[bind.as_os_str(), stats.as_os_str()]);
    let stat = || pmstack_stat(&bind);
    assert_eq!(stat()["syncfs_trusted"], false, "{}", stat());
    // Woken: with nothing live left, the periodic write-back waits for the kernel's age of
    // dirty pages (30 s).
    woken_write_backs(&bind, 2);
    let s = stat();
    assert!(
        s["totals"]["absorbed_fsync"].as_u64().unwrap_or(0) > 0,
        "no fsync was absorbed, so nothing was left for write-back: {s}"
    );
    for p in [ext4.join("f"), ext4.join("d/h"), ext4.join("lazy")] {
        assert_eq!(
            unsynced_pages(&p),
            0,
            "{} has dirty pages in ext4 after write-back expired its log entries",
            p.display()
        );
    }
    assert!(s["objects_synced"].as_u64().unwrap_or(0) > 0, "{s}");
    // f's creation was logged (the one of `first` wrote the directory back) and its first
    // sync was real (the first of the process): f's name was made durable with it, since the
    // lower's fsync of a file need not (`F_BORN_UNSYNCED`).
    assert!(s["totals"]["name_syncs"].as_u64().unwrap_or(0) > 0, "{s}");
    o.served.kill9();
    let st = Command::new(common::bin())
        .arg("recover")
        .arg("--pm")
        .arg(&o.pm.0)
        .arg(&bind)
        .status()
        .unwrap();
    assert!(st.success(), "pmstack recover: {st}");
    let data: Vec<u8> = (0..65536u32).map(|k| (k % 253) as u8).collect();
    assert_eq!(fs::read(ext4.join("f")).unwrap(), data);
    assert_eq!(fs::read(ext4.join("d/h")).unwrap(), data[..10000]);
    assert_eq!(fs::read(ext4.join("lazy")).unwrap(), data[..20000]);
    assert!(!ext4.join("d/g").exists());
}

/// Write-back of `pmstack run` over a FUSE lower whose client forgot a file the log names:
/// the file handle the program noted no longer opens (bindfs numbers the file anew), and the
/// daemon must find the file by inode number and fsync it, never take it for deleted. Before,
/// the write-back skipped it and expired its records with its bytes still dirty below.
#[test]
fn serve_write_back_finds_a_file_the_fuse_lower_renumbered() {
    if !can_mount() {
        return;
    }
    // Write-back only when woken below; no watch for writers outside `pmstack run`, so that
    // the syncs of the new file are absorbed at once.
    let Some(o) = ServedOverBindfs::start(
        "renumber",
        &["--flush-interval-ms", "3600000", "--all-writers-attached"],
    ) else {
        return; // not CI, and no loop devices: LoopFs said so
    };
    let (bind, ext4) = (o.bind.0.clone(), o.ext4.dir.clone());
    let script = r#"
import os, sys
fd = os.open(sys.argv[1] + "/f", os.O_CREAT | os.O_WRONLY, 0o644)
os.write(fd, bytes((k % 253) for k in range(65536))); os.fsync(fd)
os.pwrite(fd, bytes(200 for k in range(30000)), 4096); os.fsync(fd); os.close(fd)
"#;
    common::run_python(&bind, script, &[bind.as_os_str()]);
    assert!(
        unsynced_pages(&ext4.join("f")) > 0,
        "the file's bytes are already durable below: this test cannot show what it is for"
    );
    // Until bindfs numbers the file anew: the kernel forgot it, and then bindfs did.
    let before = handle_of(&bind.join("f"));
    let t0 = Instant::now();
    while handle_of(&bind.join("f")) == before {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "bindfs kept the file's handle through a minute of drop_caches: this test cannot show what it is for"
        );
        fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
        std::thread::sleep(Duration::from_millis(10));
    }
    woken_write_backs(&bind, 1);
    assert_eq!(
        unsynced_pages(&ext4.join("f")),
        0,
        "the file has dirty pages in ext4 after write-back expired its log entries"
    );
    o.served.stop();
}

/// `pmstack run` over a FUSE lower keeps the directories of its recent namespace operations
/// open, as over a local one, and knows them again by the handle of the path (`ns::dirs`,
/// `KnownBy::Handle`), never by the inode number, which bindfs takes from the file system
/// under it. Before, no directory was kept over a FUSE lower: each logged creation or removal
/// opened its directory anew (an open, a stat, a handle and a close: four round trips to
/// GlusterFS). A directory removed and made again under the same name by a program outside
/// `pmstack run` (on the file system under bindfs, until ext4 gives the new one the old inode
/// number) then takes the next creation, logged: bindfs names its nodes by path, so there the
/// kept node is the new directory's; a lower that names them by inode (GlusterFS, by GFID)
/// gives the new one another handle (the unit test `elsewhere_a_directory_is_known_by_the_
/// handle_of_its_path` shows that a new directory is not taken for a kept one).
#[test]
fn over_a_fuse_lower_directories_are_kept_and_known_again_by_handle() {
    if !can_mount() {
        return;
    }
    let Some(o) = ServedOverBindfs::start("dirs", &["--flush-interval-ms", "3600000"]) else {
        return; // not CI, and no loop devices: LoopFs said so
    };
    let (bind, ext4) = (o.bind.0.clone(), o.ext4.dir.clone());
    let script = r#"
import os, stat, sys
d, below = sys.argv[1], sys.argv[2]
def dir_fds():
    out = []
    for n in os.listdir('/proc/self/fd'):
        try:
            t = os.readlink('/proc/self/fd/' + n)
            st = os.stat('/proc/self/fd/' + n)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and t.startswith(d + '/'):
            out.append(t)
    return out
def touch(p):
    os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
os.mkdir(d + '/p')
A = d + '/p/a'
os.mkdir(A)
for i in range(5):
    touch(A + '/x%d' % i)
assert A in dir_fds(), dir_fds()
ino = os.stat(A).st_ino
# Outside pmstack run (the file system under bindfs): the directory goes, and one is made at
# its name, until ext4 gives the new one the old inode number (or a few tries).
for i in range(5):
    os.unlink(below + '/p/a/x%d' % i)
for attempt in range(20):
    os.rmdir(below + '/p/a')
    os.mkdir(below + '/p/a')
    if os.stat(below + '/p/a').st_ino == ino:
        break
print('same inode number: %s' % (os.stat(A).st_ino == ino), file=sys.stderr)
touch(A + '/y')
fd = os.open(A + '/z', os.O_CREAT | os.O_WRONLY, 0o644)
os.write(fd, b'in the new directory'); os.fsync(fd); os.close(fd)
assert sorted(os.listdir(A)) == ['y', 'z'], os.listdir(A)
assert sorted(os.listdir(below + '/p/a')) == ['y', 'z'], os.listdir(below + '/p/a')
"#;
    common::run_python(&bind, script, &[bind.as_os_str(), ext4.as_os_str()]);
    // mkdir p, mkdir a, five creations, y and z: logged (the first one in the root writes
    // the namespace back, and so does the first in the directory made again outside). The
    // daemon adds a process's counts to its totals once it has seen it exit.
    let stat = || pmstack_stat(&bind);
    let t0 = Instant::now();
    while stat()["totals"]["ns_ops"].as_u64().unwrap_or(0) < 6 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "namespace operations logged: {}",
            stat()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        fs::read(ext4.join("p/a/z")).unwrap(),
        b"in the new directory"
    );
    assert!(ext4.join("p/a/y").exists() && !ext4.join("p/a/x0").exists());
    o.served.stop();
}

/// ext4 on a loop device, bindfs over it, and `pmstack serve` over the bindfs mount with a
/// region of its own; undone in the order of the fields (the daemon first).
struct ServedOverBindfs {
    served: common::Served,
    pm: common::RemoveOnDrop,
    bind: BindFs,
    ext4: LoopFs,
    _base: tempfile::TempDir,
}

impl ServedOverBindfs {
    /// None: no loop devices outside CI (`LoopFs` said so).
    fn start(name: &str, extra: &[&str]) -> Option<ServedOverBindfs> {
        let base = tempfile::Builder::new()
            .prefix(&format!("pmstack-fuselower-{name}-"))
            .tempdir_in("/var/tmp")
            .unwrap();
        let ext4 = LoopFs::new(base.path())?;
        let bind = BindFs::new(&ext4.dir, &base.path().join("bind"));
        let pm = common::RemoveOnDrop(PathBuf::from(format!(
            "/dev/shm/pmstack-test-fuselower-{name}-{}.pm",
            std::process::id()
        )));
        let args: Vec<&str> = ["--pm-size", "64M"].iter().chain(extra).copied().collect();
        let served = common::Served::start(&bind.0, &pm.0, &args);
        Some(ServedOverBindfs {
            served,
            pm,
            bind,
            ext4,
            _base: base,
        })
    }
}
