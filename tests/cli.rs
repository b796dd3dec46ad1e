//! Command-line behaviour: bad input gets one clear line and changes nothing; signals and
//! umount drain the log; a second mount of one region is refused; PM-full falls back.

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(common::bin()).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn one_line_error(args: &[&str], needle: &str) {
    let (ok, err) = run(args);
    assert!(!ok, "{args:?} should fail");
    let lines: Vec<&str> = err.lines().filter(|l| !l.contains("warning")).collect();
    assert_eq!(lines.len(), 1, "{args:?}: expected one line, got {err:?}");
    assert!(
        lines[0].contains(needle),
        "{args:?}: {err:?} should mention {needle:?}"
    );
}

#[test]
fn bad_input_is_one_clear_line_and_writes_nothing() {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let p = |s: &str| d.path().join(s).to_string_lossy().to_string();
    fs::create_dir(p("lower")).unwrap();
    fs::create_dir(p("mnt")).unwrap();
    fs::write(p("file"), b"x").unwrap();
    one_line_error(&["mount", &p("missing"), &p("mnt")], "lower directory");
    one_line_error(&["mount", &p("file"), &p("mnt")], "not a directory");
    one_line_error(&["mount", &p("lower"), &p("nomnt")], "mountpoint");
    one_line_error(
        &[
            "mount",
            "-o",
            "bogus",
            "--pm",
            &p("r.pm"),
            &p("lower"),
            &p("mnt"),
        ],
        "mount option: key 'bogus': unknown key",
    );
    one_line_error(
        &[
            "format",
            "--pm",
            &p("r.pm"),
            "--size",
            "4K",
            "--lower",
            &p("lower"),
        ],
        "too small",
    );
    // Regions: truncated, wrong magic, corrupted superblock, bound to another directory.
    fs::write(p("junk.pm"), vec![7u8; 1 << 20]).unwrap();
    one_line_error(&["check", "--pm", &p("junk.pm")], "bad magic");
    let (ok, e) = run(&[
        "format",
        "--pm",
        &p("r.pm"),
        "--size",
        "1M",
        "--lower",
        &p("lower"),
    ]);
    assert!(ok, "{e}");
    let good = fs::read(p("r.pm")).unwrap();
    fs::write(p("trunc.pm"), &good[..100_000]).unwrap();
    one_line_error(&["check", "--pm", &p("trunc.pm")], "too small");
    let mut bad = good.clone();
    bad[30] ^= 0x10; // inside the uuid: covered by the superblock crc
    fs::write(p("bad.pm"), &bad).unwrap();
    one_line_error(&["check", "--pm", &p("bad.pm")], "checksum");
    let mut v = good.clone();
    v[8] = 9;
    fs::write(p("ver.pm"), &v).unwrap();
    one_line_error(&["check", "--pm", &p("ver.pm")], "version");
    fs::create_dir(p("other")).unwrap();
    fs::write(p("other/keep"), b"data").unwrap();
    if common::can_mount() {
        let before = fs::read_dir(p("other")).unwrap().count();
        one_line_error(
            &["mount", "--pm", &p("r.pm"), &p("other"), &p("mnt")],
            "no pmstack marker",
        );
        assert_eq!(
            fs::read_dir(p("other")).unwrap().count(),
            before,
            "nothing may be written to the wrong lower"
        );
        one_line_error(&["recover", "--pm", &p("bad.pm"), &p("lower")], "checksum");
    }
    // The corrupted images were not modified by any of this.
    assert_eq!(fs::read(p("bad.pm")).unwrap(), bad);
    let (ok, _) = run(&["check", "--pm", &p("r.pm")]);
    assert!(ok);
    // check says what the region is mapped from and the flush this CPU uses (the VM rig,
    // tests/vm, checks devdax, fsdax and eADR's "none").
    let out = Command::new(common::bin())
        .args(["check", "--json", "--pm", &p("r.pm")])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["pm_kind"], "emulated", "{v}");
    assert!(
        ["clwb", "clflushopt", "clflush", "none"].contains(&v["flush"].as_str().unwrap_or("")),
        "{v}"
    );
    let text = Command::new(common::bin())
        .args(["check", "--pm", &p("r.pm")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("PM: emulated") && text.contains("NOT a power loss"),
        "{text}"
    );
    // A character device that is not device-DAX is named as such.
    one_line_error(&["check", "--pm", "/dev/null"], "not a device-DAX device");
}

#[test]
fn second_mount_of_a_region_is_refused_and_sigterm_drains() {
    if !common::can_mount() {
        return;
    }
    let mut m = common::Mount::new(None);
    m.mount(&[]);
    let mnt2 = m.base.path().join("mnt2");
    fs::create_dir(&mnt2).unwrap();
    let (ok, err) = run(&[
        "mount",
        "--pm",
        m.pm.to_str().unwrap(),
        m.lower.to_str().unwrap(),
        mnt2.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("in use"), "{err}");
    let (ok, err) = run(&[
        "mount",
        "--pm",
        "/dev/shm/x.pm",
        m.lower.to_str().unwrap(),
        m.mnt.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("busy"), "{err}");
    let f = fs::File::create(m.mnt.join("f")).unwrap();
    f.write_all_at(&[5u8; 10000], 0).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let pid = m.daemon_pid();
    // SAFETY: plain kill.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    // SAFETY: probing only.
    while unsafe { libc::kill(pid, 0) } == 0 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    m.mounted = false;
    assert_eq!(fs::read(m.lower.join("f")).unwrap(), vec![5u8; 10000]);
    let chk = m.check_json();
    assert_eq!(chk["clean"], true, "{chk}");
    assert_eq!(chk["live_entries"], 0, "{chk}");
}

#[test]
fn pm_full_falls_back_to_the_lower_fsync_and_never_fails() {
    if !common::can_mount() {
        return;
    }
    let mut m = common::Mount::new(None);
    // 512 KiB region, write-back rarely: it fills, fsync falls back, nothing fails.
    m.mount(&["--pm-size", "512K", "--flush-interval-ms", "600000"]);
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .read(true)
        .open(m.mnt.join("big"))
        .unwrap();
    let mut expect = vec![0u8; 0];
    for i in 0..400u64 {
        let d = vec![(i % 250) as u8 + 1; 4096];
        f.write_all_at(&d, i * 4096).unwrap();
        f.sync_data().unwrap();
        expect.extend_from_slice(&d);
    }
    drop(f);
    std::thread::sleep(std::time::Duration::from_millis(1200)); // stats refresh every 500 ms
    let out = Command::new(common::bin())
        .args(["stat", "--json"])
        .arg(&m.mnt)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stats = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert!(
        v["real_syncs"].as_u64().unwrap() > 0 || v["writebacks"].as_u64().unwrap() > 0,
        "{v}"
    );
    m.umount();
    assert_eq!(fs::read(m.lower.join("big")).unwrap(), expect);
}

#[test]
fn concurrent_creates_renames_and_writes_lose_nothing() {
    if !common::can_mount() {
        return;
    }
    let mut m = common::Mount::new(None);
    m.mount(&["--flush-interval-ms", "50"]);
    fs::create_dir(m.mnt.join("shared")).unwrap();
    let hs: Vec<_> = (0..4)
        .map(|t| {
            let d = m.mnt.join("shared");
            std::thread::spawn(move || {
                for i in 0..150 {
                    let tmp = d.join(format!("tmp-{t}-{i}"));
                    let fin = d.join(format!("f-{t}-{i}"));
                    fs::write(&tmp, format!("{t}:{i}").repeat(100)).unwrap();
                    fs::File::open(&tmp).unwrap().sync_all().unwrap();
                    fs::rename(&tmp, &fin).unwrap();
                    if i % 3 == 0 {
                        fs::remove_file(d.join(format!("f-{t}-{}", i / 2))).ok();
                    }
                    // read back someone else's file
                    let _ = fs::read(d.join(format!("f-{}-{}", (t + 1) % 4, i)));
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    let through = common::tree(&m.mnt);
    m.umount();
    assert_eq!(common::tree(&m.lower), through);
    for t in 0..4 {
        let i = 149;
        assert_eq!(
            fs::read_to_string(m.lower.join(format!("shared/f-{t}-{i}"))).unwrap(),
            format!("{t}:{i}").repeat(100)
        );
    }
}

#[test]
fn allow_other_checks_permissions_and_new_files_belong_to_the_caller() {
    if !common::can_mount() {
        return;
    }
    let mut m = common::Mount::new(None);
    // The test tree must be reachable by an unprivileged user.
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(m.base.path(), fs::Permissions::from_mode(0o755)).unwrap();
    m.mount(&["-o", "allow_other"]);
    let shared = m.mnt.join("shared");
    fs::create_dir(&shared).unwrap();
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o777)).unwrap();
    fs::write(m.mnt.join("secret"), b"root only").unwrap();
    fs::set_permissions(m.mnt.join("secret"), fs::Permissions::from_mode(0o600)).unwrap();
    let as_nobody = |script: &str| {
        Command::new("setpriv")
            .args([
                "--reuid",
                "65534",
                "--regid",
                "65534",
                "--clear-groups",
                "sh",
                "-c",
                script,
            ])
            .output()
            .unwrap()
    };
    let out = as_nobody(&format!("echo hi > {}/f", shared.display()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    use std::os::unix::fs::MetadataExt;
    let md = fs::metadata(shared.join("f")).unwrap();
    assert_eq!(
        (md.uid(), md.gid()),
        (65534, 65534),
        "a new file belongs to its creator"
    );
    let out = as_nobody(&format!("cat {}/secret", m.mnt.display()));
    assert!(
        !out.status.success(),
        "the kernel must refuse a 0600 root file to another user"
    );
    m.umount();
    let md = fs::metadata(m.lower.join("shared/f")).unwrap();
    assert_eq!(md.uid(), 65534, "ownership reached the lower file system");
}

/// Open flags real programs use on existing files (SQLite opens with O_NOFOLLOW), in every
/// mode, and SQLite itself reopening its database.
#[test]
fn programs_open_flags_and_sqlite_reopen_work_in_every_mode() {
    if !common::can_mount() {
        return;
    }
    use std::os::unix::fs::OpenOptionsExt;
    for mode in ["sync", "strict", "adaptive", "passthrough"] {
        let mut m = common::Mount::new(None);
        m.mount(&["--mode", mode]);
        let p = m.mnt.join("f");
        fs::write(&p, b"0123456789").unwrap();
        for (what, flags) in [
            ("O_NOFOLLOW", libc::O_NOFOLLOW),
            ("O_NOATIME", libc::O_NOATIME),
            ("O_CLOEXEC|O_NOFOLLOW", libc::O_CLOEXEC | libc::O_NOFOLLOW),
            ("O_DSYNC|O_NOFOLLOW", libc::O_DSYNC | libc::O_NOFOLLOW),
        ] {
            let f = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(flags)
                .open(&p)
                .unwrap_or_else(|e| panic!("{mode}: open with {what}: {e}"));
            f.write_all_at(b"ab", 2).unwrap();
            f.sync_all().unwrap();
            let r = fs::OpenOptions::new()
                .read(true)
                .custom_flags(flags)
                .open(&p)
                .unwrap_or_else(|e| panic!("{mode}: read-only open with {what}: {e}"));
            let mut b = [0u8; 4];
            r.read_exact_at(&mut b, 0).unwrap();
            assert_eq!(&b, b"01ab", "{mode} {what}");
        }
        // SQLite: create, close, reopen, insert, read back (rollback journal and WAL).
        let script = "import sqlite3,sys\n\
            for j in ('DELETE','WAL'):\n\
            \x20   for k in range(3):\n\
            \x20       c=sqlite3.connect(sys.argv[1]+'/'+j+'.db',isolation_level=None)\n\
            \x20       c.execute('PRAGMA journal_mode='+j); c.execute('PRAGMA synchronous=FULL')\n\
            \x20       c.execute('CREATE TABLE IF NOT EXISTS t(v)'); c.execute('INSERT INTO t VALUES(?)',(k,))\n\
            \x20       assert c.execute('SELECT count(*) FROM t').fetchone()[0]==k+1\n\
            \x20       c.close()\n";
        let out = Command::new("python3")
            .args(["-c", script])
            .arg(&m.mnt)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{mode}: sqlite: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        m.umount();
    }
}

/// Commands never harm what they were not meant for: `format` does not overwrite a file that
/// is not a region, `umount` does not unmount another file system, and a mode combination
/// that cannot keep its promise is refused (issue "Lose nothing", B2).
#[test]
fn commands_refuse_what_they_were_not_meant_for() {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let p = |s: &str| d.path().join(s).to_string_lossy().to_string();
    fs::create_dir(p("lower")).unwrap();
    fs::create_dir(p("mnt")).unwrap();
    fs::write(p("precious.db"), b"user data that must survive").unwrap();
    one_line_error(
        &[
            "format",
            "--pm",
            &p("precious.db"),
            "--size",
            "1M",
            "--lower",
            &p("lower"),
        ],
        "is not a pmstack region",
    );
    assert_eq!(
        fs::read(p("precious.db")).unwrap(),
        b"user data that must survive"
    );
    one_line_error(
        &[
            "mount",
            "--mode",
            "strict",
            "--cache",
            "writeback",
            "--pm",
            &p("r.pm"),
            &p("lower"),
            &p("mnt"),
        ],
        "cannot be combined",
    );
    assert!(
        !Path::new(&p("r.pm")).exists(),
        "a refused mount left a region"
    );
    one_line_error(&["umount", &p("mnt")], "not a mount point");
    if common::can_mount() {
        // A tmpfs mounted at mnt: pmstack umount must leave it alone.
        assert!(std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1M", "tmpfs"])
            .arg(p("mnt"))
            .status()
            .unwrap()
            .success());
        one_line_error(&["umount", &p("mnt")], "not a pmstack mount");
        let still = fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .contains(&format!(" {} ", p("mnt")));
        let _ = std::process::Command::new("umount").arg(p("mnt")).status();
        assert!(still, "pmstack umount unmounted a tmpfs");
    }
}

/// The caller's umask is applied once (by the kernel or from the request), never again with
/// the daemon's: `umask 0; touch f; mkdir d` gives 0666 and 0777 as on the lower itself.
#[test]
fn the_callers_umask_is_applied_once_and_chown_updates_ctime() {
    if !common::can_mount() {
        return;
    }
    let mut m = common::Mount::new(None);
    m.mount(&[]);
    let mnt = m.mnt.to_string_lossy().to_string();
    let st = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask 0 && touch '{mnt}/f' && mkdir '{mnt}/d' && mkfifo '{mnt}/p' && umask 027 && touch '{mnt}/g' && mkdir '{mnt}/e'"
        ))
        .status()
        .unwrap();
    assert!(st.success());
    use std::os::unix::fs::PermissionsExt;
    let mode = |n: &str| fs::metadata(m.lower.join(n)).unwrap().permissions().mode() & 0o7777;
    assert_eq!(
        [mode("f"), mode("d"), mode("p"), mode("g"), mode("e")],
        [0o666, 0o777, 0o666, 0o640, 0o750]
    );
    // chown(f, -1, -1) updates ctime, as on the lower file system.
    use std::os::unix::fs::MetadataExt;
    let f = m.mnt.join("f");
    let before = fs::metadata(&f).unwrap().ctime_nsec() as i128
        + fs::metadata(&f).unwrap().ctime() as i128 * 1_000_000_000;
    std::thread::sleep(std::time::Duration::from_millis(20)); // past the coarse clock's tick
    std::os::unix::fs::chown(&f, None, None).unwrap();
    let md = fs::metadata(&f).unwrap();
    let after = md.ctime_nsec() as i128 + md.ctime() as i128 * 1_000_000_000;
    assert!(after > before, "chown(-1, -1) did not update ctime");
    m.umount();
}

/// A region larger than the free space of its file system (Docker's 64 MiB /dev/shm) is
/// refused with the free space named, and a refused first start leaves nothing behind: no
/// region file, no marker in the lower.
#[test]
fn a_region_larger_than_its_file_system_is_refused_and_nothing_is_left() {
    if !common::can_mount() {
        return;
    }
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let p = |s: &str| d.path().join(s).to_string_lossy().to_string();
    for s in ["shm", "lower", "mnt"] {
        fs::create_dir(p(s)).unwrap();
    }
    assert!(std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8M", "tmpfs"])
        .arg(p("shm"))
        .status()
        .unwrap()
        .success());
    let region = format!("{}/r.pm", p("shm"));
    one_line_error(
        &[
            "mount",
            "--pm",
            &region,
            "--pm-size",
            "64M",
            &p("lower"),
            &p("mnt"),
        ],
        "free",
    );
    one_line_error(
        &[
            "format",
            "--pm",
            &region,
            "--size",
            "64M",
            "--lower",
            &p("lower"),
        ],
        "free",
    );
    let left: Vec<_> = fs::read_dir(p("shm"))
        .unwrap()
        .chain(fs::read_dir(p("lower")).unwrap())
        .map(|e| e.unwrap().file_name())
        .collect();
    let _ = std::process::Command::new("umount").arg(p("shm")).status();
    assert!(left.is_empty(), "a refused command left {left:?}");
}

/// Operator mistakes get one line naming the problem and the fix, and leave nothing behind:
/// a region in a missing directory, a TOML syntax error (with its line), the mount helper's
/// --help, stacking pmstack on a pmstack mount, a mount by a user who may not take the lock.
#[test]
fn operator_mistakes_get_one_line_with_the_fix() {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let p = |s: &str| d.path().join(s).to_string_lossy().to_string();
    for s in ["lower", "mnt", "mnt2"] {
        fs::create_dir(p(s)).unwrap();
    }
    one_line_error(
        &["mount", "--pm", &p("missing/r.pm"), &p("lower"), &p("mnt")],
        "directory does not exist",
    );
    assert_eq!(
        fs::read_dir(p("lower")).unwrap().count(),
        0,
        "a marker was left"
    );
    fs::write(p("bad.toml"), "mode = \"sync\"\nflush_interval_ms = = 3\n").unwrap();
    one_line_error(
        &["mount", "--config", &p("bad.toml"), &p("lower"), &p("mnt")],
        "at line 2",
    );
    let helper = d.path().join("mount.fuse.pmstack");
    std::os::unix::fs::symlink(common::bin(), &helper).unwrap();
    let out = Command::new(&helper).arg("--help").output().unwrap();
    assert!(
        out.status.success()
            && String::from_utf8_lossy(&out.stdout).contains("usage: mount.fuse.pmstack"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    if !common::can_mount() {
        return;
    }
    let mut m = common::Mount::new(Some(d.path().join("lower")));
    m.mount(&[]);
    fs::create_dir(m.mnt.join("sub")).unwrap();
    one_line_error(
        &[
            "mount",
            "--pm",
            &p("r2.pm"),
            &m.mnt.join("sub").to_string_lossy(),
            &p("mnt2"),
        ],
        "stacking pmstack on pmstack is not supported",
    );
    m.umount();
    // A user who may not write /run/pmstack: refused, and no region or marker is left. The
    // binary and the directories must be reachable for that user: copies in a fresh 0755
    // directory.
    let other = PathBuf::from(format!(
        "/var/tmp/pmstack-test-nobody-{}",
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&other);
    fs::create_dir_all(&other).unwrap();
    let exe = other.join("pmstack");
    fs::copy(common::bin(), &exe).unwrap();
    for s in ["l", "m"] {
        fs::create_dir_all(other.join(s)).unwrap();
    }
    let st = Command::new("chown")
        .args(["-R", "nobody"])
        .arg(&other)
        .status()
        .unwrap();
    assert!(st.success());
    let region = format!("/dev/shm/pmstack-test-nobody-{}.pm", std::process::id());
    let out = Command::new("runuser")
        .args(["-u", "nobody", "--"])
        .arg(&exe)
        .args(["mount", "--pm", &region])
        .arg(other.join("l"))
        .arg(other.join("m"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let left = fs::read_dir(other.join("l")).unwrap().count();
    let region_left = Path::new(&region).exists();
    if out.status.success() {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(other.join("m"))
            .status();
    }
    let _ = fs::remove_file(&region);
    let _ = fs::remove_dir_all(&other);
    assert!(!out.status.success(), "nobody mounted: {err}");
    assert!(
        err.contains("as root"),
        "the refusal should say what to do: {err}"
    );
    assert!(!region_left, "a refused mount left its region");
    assert_eq!(left, 0, "a refused mount left a marker");
}

/// `cmd` as another node would run it: with a /run/pmstack of its own (a private mount
/// namespace), so only the lease inside the lower directory can tell the two apart.
fn on_other_node(script: &str) -> (bool, String) {
    fs::create_dir_all("/run/pmstack").unwrap();
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount -t tmpfs pmstack-test /run/pmstack && {script}"
        ))
        .env("PMSTACK", common::bin())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Two nodes over one directory of a shared file system would each absorb syncs the other
/// cannot see. The lease in the lower directory refuses a second node while the first holds
/// it, refuses to start over a node that crashed (its PM may hold acknowledged data) unless
/// the operator takes over, and then refuses the crashed node's stale log, which would roll
/// the newer data back.
#[test]
fn a_second_node_is_refused_and_a_crashed_nodes_log_is_not_replayed_over_a_take_over() {
    if !common::can_mount() {
        return;
    }
    let mut m = common::Mount::new(None);
    m.mount(&["--mode", "sync"]);
    fs::write(m.mnt.join("a"), b"node one").unwrap();
    let other_pm = format!("/dev/shm/pmstack-test-other-{}.pm", std::process::id());
    let mnt2 = m.base.path().join("mnt2");
    fs::create_dir_all(&mnt2).unwrap();
    let lower = m.lower.clone();
    let start2 = |extra: &str| {
        format!(
            "\"$PMSTACK\" mount --pm {other_pm} {extra} {} {} && \"$PMSTACK\" umount {}",
            lower.display(),
            mnt2.display(),
            mnt2.display()
        )
    };
    let (ok, err) = on_other_node(&start2(""));
    assert!(!ok, "a second node mounted a directory in use");
    assert!(err.contains("is in use by pmstack on host"), "{err}");
    // Node one dies with acknowledged data in its log.
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.mnt.join("a"))
        .unwrap();
    f.write_all_at(b"NODE ONE", 0).unwrap();
    f.sync_all().unwrap();
    drop(f);
    m.kill9();
    let (ok, err) = on_other_node(&start2(""));
    assert!(
        !ok,
        "a second node started over a crashed node's unreplayed log"
    );
    assert!(err.contains("did not shut down cleanly"), "{err}");
    assert!(err.contains("--take-over"), "{err}");
    // The operator gives node one's log up; node two works and leaves cleanly.
    let (ok, err) = on_other_node(&start2("--take-over"));
    assert!(ok, "take-over failed: {err}");
    // Node one comes back: replaying its log now would undo node two's work.
    let out = Command::new(common::bin())
        .args(["mount", "--pm"])
        .arg(&m.pm)
        .arg(&m.lower)
        .arg(&m.mnt)
        .output()
        .unwrap();
    assert!(!out.status.success(), "the stale log was replayed");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("was taken over by"), "{err}");
    let _ = fs::remove_file(&other_pm);
}

/// The dummy user `tests` (CI creates it: `.ci/run`); None outside CI when it is missing.
fn user_tests() -> Option<pmstack::lower::creds::Creds> {
    match pmstack::lower::creds::user_named("tests") {
        Ok(u) => Some(u),
        Err(e) => {
            assert!(
                std::env::var("CI").is_err(),
                "CI needs the user `tests` (useradd -M tests): {e}"
            );
            eprintln!("SKIPPED: no user `tests`");
            None
        }
    }
}

#[test]
fn a_users_log_is_replayed_with_that_users_rights() {
    if !common::can_mount() {
        return;
    }
    let Some(u) = user_tests() else { return };
    let chown = |p: &Path, uid: u32, gid: u32| {
        rustix::fs::chown(
            p,
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(gid)),
        )
        .unwrap()
    };
    let mut m = common::Mount::new(None);
    chown(&m.lower, u.uid, u.gid);
    fs::write(m.lower.join("roots"), b"safe....").unwrap();
    fs::write(m.lower.join("theirs"), b"safe....").unwrap();
    chown(&m.lower.join("theirs"), u.uid, u.gid);
    m.mount(&["--mode", "sync"]);
    for f in ["roots", "theirs"] {
        let h = fs::OpenOptions::new()
            .write(true)
            .open(m.mnt.join(f))
            .unwrap();
        h.write_all_at(b"LOGGED!!", 0).unwrap();
        h.sync_all().unwrap();
    }
    m.kill9();
    // As if the lower's page cache had been lost with the machine: only the log has them.
    for f in ["roots", "theirs"] {
        fs::write(m.lower.join(f), b"safe....").unwrap();
    }
    // The region now belongs to `tests` (as after `serve --user tests`): its log may hold
    // anything that user's programs wrote, so it is replayed with that user's rights.
    chown(&m.pm, u.uid, u.gid);
    let pm = m.pm.to_str().unwrap().to_string();
    let lower = m.lower.to_str().unwrap().to_string();
    let mnt = m.mnt.to_str().unwrap().to_string();
    let (ok, err) = run(&["mount", "--pm", &pm, &lower, &mnt]);
    assert!(!ok, "a mount opened a region that belongs to another user");
    assert!(err.contains("belongs to user tests"), "{err}");
    let (ok, err) = run(&["recover", "--pm", &pm, &lower]);
    assert!(!ok, "the user's log changed a file of root's: {err}");
    assert!(err.contains("with that user's rights"), "{err}");
    assert!(err.contains("ermission denied"), "{err}");
    assert_eq!(fs::read(m.lower.join("roots")).unwrap(), b"safe....");
    assert!(
        m.check_json()["live_entries"].as_u64().unwrap_or(0) > 0,
        "the log was discarded"
    );
    // Root's own region: the same log is replayed in full.
    chown(&m.pm, 0, 0);
    let (ok, err) = run(&["recover", "--pm", &pm, &lower]);
    assert!(ok, "{err}");
    for f in ["roots", "theirs"] {
        assert_eq!(fs::read(m.lower.join(f)).unwrap(), b"LOGGED!!", "{f}");
    }
}

/// A daemon outlives its terminal: `pmstack serve` whose stderr was a pipe that is now closed
/// (the terminal went away, the log reader exited) still stops cleanly on SIGTERM. It printed
/// its last line with `eprintln!`, which panics on a closed stderr; the panic skipped the
/// flag that stops its helper threads, and the daemon hung for good with its socket removed:
/// no program could attach, and the region stayed locked.
#[test]
fn serve_stops_cleanly_after_its_stderr_is_gone() {
    use std::io::BufRead;
    common::preload_built();
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let lower = d.path().join("lower");
    fs::create_dir(&lower).unwrap();
    let pm = d.path().join("r.pm");
    let mut child = Command::new(common::bin())
        .arg("serve")
        .arg(&lower)
        .arg("--pm")
        .arg(&pm)
        .args(["--pm-size", "64M", "--log-level", "warn"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Read until it serves, then close our end of its stderr.
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("serving") {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "serve exited early");
    }
    drop(err);
    // SAFETY: signalling our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    // A generous bound: a clean stop takes well under a second; a hang never ends.
    let t0 = std::time::Instant::now();
    let st = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > std::time::Duration::from_secs(120) {
            let _ = child.kill();
            panic!("serve did not exit after SIGTERM with its stderr closed");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(st.success(), "serve exited with {st}");
    common::remove_runtime_files(&lower, None);
    // The region was left clean: nothing to recover.
    let (ok, out) = run(&["check", "--pm", pm.to_str().unwrap()]);
    assert!(ok, "{out}");
}
