//! Operating pmstack like a file system: `mount -t fuse.pmstack`, an fstab line, the TOML
//! configuration, the Prometheus endpoint, the man pages.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{bin, can_mount, Mount};

/// Run this build's pmstack with `args`.
fn pmstack(args: &[&dyn AsRef<std::ffi::OsStr>]) -> std::process::Output {
    Command::new(bin())
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .unwrap()
}

/// The process (any name) whose command line names `mnt`.
fn daemon_for(mnt: &Path) -> Option<i32> {
    for e in fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmd) = fs::read(e.path().join("cmdline")) else {
            continue;
        };
        if cmd
            .split(|b| *b == 0)
            .any(|a| a == mnt.as_os_str().as_encoded_bytes())
        {
            return Some(pid);
        }
    }
    None
}

fn wait_daemon_gone(mnt: &Path) {
    let t0 = Instant::now();
    while daemon_for(mnt).is_some() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "daemon for {} did not exit",
            mnt.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// mountinfo lines for `mnt`: (source, fstype).
fn mounts_at(mnt: &Path) -> Vec<(String, String)> {
    let s = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let want = mnt.to_string_lossy().replace(' ', "\\040");
    s.lines()
        .filter(|l| l.split(' ').nth(4) == Some(want.as_str()))
        .map(|l| {
            let after: Vec<&str> = l.split(" - ").nth(1).unwrap().split(' ').collect();
            (after[1].to_string(), after[0].to_string())
        })
        .collect()
}

/// Whether every one of `tools` is installed (in CI a missing one is a failure; `packages`
/// name what provides them).
fn tools_present(tools: &[&str], packages: &str) -> bool {
    for tool in tools {
        if Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map(|o| !o.status.success())
            .unwrap_or(true)
        {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "{tool} is missing ({packages})"
            );
            eprintln!("SKIPPED: {tool} is missing");
            return false;
        }
    }
    true
}

/// The requests of kind `op` the daemon served (`pmstack stat --json`).
fn request_count(v: &serde_json::Value, op: &str) -> u64 {
    v["latency_us"][op]["count"].as_u64().unwrap_or(0)
}

/// `cmd` run by `sh -c`, as user `user` (its uid and gid, no supplementary groups:
/// `setpriv`) or as this process.
fn shell_as(user: Option<u32>, cmd: &str) -> std::process::Output {
    let mut c = Command::new(if user.is_some() { "setpriv" } else { "sh" });
    if let Some(u) = user {
        c.args([
            &format!("--reuid={u}"),
            &format!("--regid={u}"),
            "--clear-groups",
            "sh",
        ]);
    }
    c.args(["-c", cmd]);
    c.output().unwrap()
}

fn stat_json(mnt: &Path) -> serde_json::Value {
    let out = pmstack(&[&"stat", &"--json", &mnt]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn write_synced(path: &Path, data: &[u8]) {
    let f = fs::File::create(path).unwrap();
    f.write_all_at(data, 0).unwrap();
    f.sync_all().unwrap();
}

/// Installs /usr/sbin/mount.fuse.pmstack -> this build's binary for the test's duration.
struct Helper(bool);

impl Helper {
    fn install() -> Helper {
        let link = Path::new("/usr/sbin/mount.fuse.pmstack");
        let existed = fs::symlink_metadata(link).is_ok();
        let _ = fs::remove_file(link);
        std::os::unix::fs::symlink(bin(), link).expect("installing the mount helper link");
        Helper(!existed)
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        if self.0 {
            let _ = fs::remove_file("/usr/sbin/mount.fuse.pmstack");
        }
    }
}

#[test]
fn mount_t_fuse_pmstack_and_an_fstab_line_mount_for_real() {
    if !can_mount() {
        return;
    }
    let _h = Helper::install();
    let mut m = Mount::new(None);
    // mount(8) with a type: the helper gets LOWER MOUNTPOINT -o rw,…
    let out = Command::new("mount")
        .args(["-t", "fuse.pmstack"])
        .arg(&m.lower)
        .arg(&m.mnt)
        .arg("-o")
        .arg(format!(
            "pm={},mode=strict,flush_interval_ms=100,noatime",
            m.pm.display()
        ))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mount -t fuse.pmstack: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    m.mounted = true;
    assert_eq!(
        mounts_at(&m.mnt),
        vec![(
            m.lower.to_string_lossy().to_string(),
            "fuse.pmstack".to_string()
        )]
    );
    write_synced(&m.mnt.join("a"), b"through mount -t");
    assert_eq!(stat_json(&m.mnt)["mode"], "strict");
    // umount(8) unmounts; the daemon drains on its own.
    let st = Command::new("umount").arg(&m.mnt).status().unwrap();
    assert!(st.success());
    m.mounted = false;
    wait_daemon_gone(&m.mnt);
    assert_eq!(fs::read(m.lower.join("a")).unwrap(), b"through mount -t");
    let c = m.check_json();
    assert_eq!(c["clean"], true);
    assert_eq!(c["live_entries"], 0);

    // A bad option through mount(8): one line naming the key, nothing mounted.
    let out = Command::new("mount")
        .args(["-t", "fuse.pmstack"])
        .arg(&m.lower)
        .arg(&m.mnt)
        .args(["-o", "mode=fast"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "key 'mode': invalid value 'fast' (allowed: sync, strict, adaptive, passthrough)"
        ),
        "{err}"
    );
    assert!(mounts_at(&m.mnt).is_empty());

    // An fstab line, with the options systemd and mount(8) add.
    let fstab = m.base.path().join("fstab");
    fs::write(
        &fstab,
        format!(
            "# pmstack over a directory\n{}  {}  fuse.pmstack  pm={},mode=sync,nofail,_netdev,x-systemd.mount-timeout=30,defaults  0 0\n",
            m.lower.display(),
            m.mnt.display(),
            m.pm.display()
        ),
    )
    .unwrap();
    let out = Command::new("mount")
        .arg("--fstab")
        .arg(&fstab)
        .arg(&m.mnt)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mount via fstab: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    m.mounted = true;
    assert_eq!(stat_json(&m.mnt)["mode"], "sync");
    assert_eq!(fs::read(m.mnt.join("a")).unwrap(), b"through mount -t");
    write_synced(&m.mnt.join("b"), &vec![5u8; 100_000]);
    // `mount -a` sees the line as mounted already (the source matches) and does nothing.
    let out = Command::new("mount")
        .arg("--fstab")
        .arg(&fstab)
        .arg("-a")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mount -a: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(mounts_at(&m.mnt).len(), 1, "mount -a mounted it twice");
    // pmstack umount waits for the drain and says how much it wrote back.
    let out = pmstack(&[&"umount", &m.mnt]);
    assert!(out.status.success());
    m.mounted = false;
    let msg = String::from_utf8_lossy(&out.stderr);
    assert!(
        msg.contains("bytes of live log written back to the lower file system"),
        "{msg}"
    );
    assert!(
        daemon_for(&m.mnt).is_none(),
        "umount returned before the drain"
    );
    assert_eq!(fs::read(m.lower.join("b")).unwrap(), vec![5u8; 100_000]);
}

#[test]
fn config_file_sets_the_mount_flags_override_it_errors_name_the_key() {
    if !can_mount() {
        return;
    }
    let mut m = Mount::new(None);
    let cfg = m.base.path().join("pmstack.toml");
    // Bad value: one line naming file, key, value and the allowed values; nothing created.
    fs::write(&cfg, "mode = \"fast\"\n").unwrap();
    let out = pmstack(&[&"mount", &"--config", &cfg, &m.lower, &m.mnt]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.trim(),
        format!(
            "pmstack: config {}: key 'mode': invalid value 'fast' (allowed: sync, strict, adaptive, passthrough)",
            cfg.display()
        )
    );
    fs::write(&cfg, "flush_interval = 100\n").unwrap();
    let out = pmstack(&[&"mount", &"--config", &cfg, &m.lower, &m.mnt]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err
                .contains("key 'flush_interval': unknown key (known keys: lower, mountpoint, mode"),
        "{err}"
    );
    assert!(mounts_at(&m.mnt).is_empty());
    assert!(
        fs::read_dir(&m.lower).unwrap().next().is_none(),
        "nothing may be written to LOWER"
    );

    // A complete file: paths, mode, region, flush interval.
    fs::write(
        &cfg,
        format!(
            "lower = \"{}\"\nmountpoint = \"{}\"\npm = \"{}\"\npm_size = \"32M\"\nmode = \"adaptive\"\nflush_interval_ms = 250\nlog_level = \"info\"\n",
            m.lower.display(),
            m.mnt.display(),
            m.pm.display()
        ),
    )
    .unwrap();
    let out = pmstack(&[&"mount", &"--config", &cfg]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    m.mounted = true;
    assert_eq!(stat_json(&m.mnt)["mode"], "adaptive");
    assert_eq!(m.check_json()["region_bytes"], 32u64 << 20);
    write_synced(&m.mnt.join("x"), b"cfg");
    m.umount();
    // Flags win over the file.
    let out = pmstack(&[&"mount", &"--config", &cfg, &"--mode", &"strict"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    m.mounted = true;
    assert_eq!(stat_json(&m.mnt)["mode"], "strict");
    assert_eq!(fs::read(m.mnt.join("x")).unwrap(), b"cfg");
    m.umount();
    // And a flag's bad value names the flag.
    let out = pmstack(&[&"mount", &"--config", &cfg, &"--threads", &"0"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "pmstack: --threads: invalid value '0' (allowed: an integer from 1 to 64)"
    );
}

fn scrape(addr: &str, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let code = resp
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// A local address no one listens on now.
fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// GET /metrics (must answer 200): the parsed samples and the text.
fn metrics(addr: &str) -> (prometheus_parse::Scrape, String) {
    let (code, body) = scrape(addr, "/metrics");
    assert_eq!(code, 200, "{body}");
    let parsed = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
        .expect("parsable Prometheus text");
    (parsed, body)
}

fn sample(scrape: &prometheus_parse::Scrape, name: &str, op: Option<&str>) -> f64 {
    let s = scrape
        .samples
        .iter()
        .find(|s| s.metric == name && op.is_none_or(|o| s.labels.get("op") == Some(o)))
        .unwrap_or_else(|| panic!("{name} {op:?} missing"));
    match &s.value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => *v,
        prometheus_parse::Value::Histogram(b) => b
            .iter()
            .find(|c| c.less_than.is_infinite())
            .map(|c| c.count)
            .unwrap(),
        o => panic!("{name}: {o:?}"),
    }
}

#[test]
fn metrics_endpoint_serves_prometheus_text_that_moves_under_load() {
    if !can_mount() {
        return;
    }
    let addr = free_addr();
    let mut m = Mount::new(None);
    m.mount(&["--metrics-addr", &addr]);
    let (before, _) = metrics(&addr);
    let f = fs::File::create(m.mnt.join("data")).unwrap();
    for i in 0..50u64 {
        f.write_all_at(&[i as u8; 4096], i * 4096).unwrap();
        f.sync_data().unwrap();
    }
    drop(f);
    let (after, _) = metrics(&addr);
    let d = |n: &str, op: Option<&str>| sample(&after, n, op) - sample(&before, n, op);
    assert!(d("pmstack_absorbed_fsync_total", None) >= 50.0);
    assert!(d("pmstack_log_commits_total", None) >= 50.0);
    assert!(d("pmstack_request_duration_seconds", Some("fsync")) >= 50.0);
    assert!(d("pmstack_request_duration_seconds", Some("write")) >= 50.0);
    assert!(sample(&after, "pmstack_pm_bytes_used", None) > 0.0);
    assert!(sample(&after, "pmstack_pm_bytes_free", None) > 0.0);
    // `stat` shows the same counters, latency included (its file is refreshed twice a second).
    let t0 = Instant::now();
    let st = loop {
        let st = stat_json(&m.mnt);
        if st["absorbed_fsync"].as_u64().unwrap() >= 50 || t0.elapsed() > Duration::from_secs(5) {
            break st;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(st["absorbed_fsync"].as_u64().unwrap() >= 50);
    assert!(st["latency_us"]["fsync"]["count"].as_u64().unwrap() >= 50);
    assert_eq!(scrape(&addr, "/other").0, 404);
    // A port in use fails the mount cleanly.
    let mut m2 = Mount::new(None);
    let out = pmstack(&[
        &"mount",
        &"--pm",
        &m2.pm,
        &"--metrics-addr",
        &addr,
        &m2.lower,
        &m2.mnt,
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot listen"), "{err}");
    assert!(mounts_at(&m2.mnt).is_empty());
    m2.mounted = false;
    m.umount();
}

/// Over a local lower the kernel keeps what it looked up for longer than a second by
/// default (`attr_timeout = auto`: LOWER changes only through the mount): a tree looked
/// over again after a pause (`git status`, `make`, `ls -lR`) costs no LOOKUP or GETATTR
/// round trip per entry. With a 1 s timeout the second look asked again for every entry.
#[test]
fn a_tree_looked_over_again_after_a_pause_costs_no_round_trips() {
    if !can_mount() {
        return;
    }
    let mut m = Mount::new(None);
    let d = m.lower.join("tree");
    fs::create_dir(&d).unwrap();
    for i in 0..40 {
        fs::write(d.join(format!("f{i:02}")), vec![b'x'; i]).unwrap();
    }
    m.mount(&[]);
    let look = |mnt: &Path| {
        for i in 0..40 {
            let md = fs::symlink_metadata(mnt.join(format!("tree/f{i:02}"))).unwrap();
            assert_eq!(md.len(), i as u64);
        }
    };
    let counts = || {
        let v = stats_after_a_dir_sync(&m, &m.mnt);
        (request_count(&v, "lookup"), request_count(&v, "getattr"), v)
    };
    look(&m.mnt);
    let (lookups, getattrs, _) = counts();
    assert!(lookups >= 40, "the first look asks the daemon");
    // Longer than a 1 s timeout.
    std::thread::sleep(Duration::from_millis(1500));
    look(&m.mnt);
    let (lookups2, getattrs2, v) = counts();
    assert_eq!(
        (lookups2, getattrs2),
        (lookups, getattrs),
        "the second look asked the daemon again: stats {v}"
    );
    m.umount();
}

/// A POSIX ACL grants or refuses through the mount as on the lower (the kernel checks rights
/// by the ACLs, FUSE_POSIX_ACL; before, with `allow_other` it checked the mode bits alone
/// and refused a user an ACL lets in), an ACL set through the mount is the lower's, and
/// once read an object's ACL is the kernel's to answer (`ls -l` asked the daemon for it at
/// every entry, each time).
#[test]
fn posix_acls_decide_through_the_mount_as_on_the_lower_and_are_cached() {
    if !can_mount() {
        return;
    }
    if !tools_present(&["setpriv", "setfacl", "getfacl"], "util-linux, acl") {
        return;
    }
    let mut m = Mount::new(None);
    use std::os::unix::fs::PermissionsExt;
    // Another user reaches both trees.
    fs::set_permissions(m.base.path(), fs::Permissions::from_mode(0o755)).unwrap();
    m.mount(&["-o", "allow_other"]);
    let sh = |user: Option<u32>, cmd: &str| {
        let out = shell_as(user, cmd);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    };
    let (l, t) = (m.lower.display(), m.mnt.display());
    for (f, acl) in [("granted", "u:65534:r"), ("refused", "u:65534:---")] {
        // Mode bits that refuse user 65534; the ACL alone decides.
        let (ok, _) = sh(
            None,
            &format!("echo {f} > {l}/{f} && chmod 0600 {l}/{f} && setfacl -m {acl} {l}/{f}"),
        );
        assert!(ok, "setfacl on the lower");
        let lower = sh(Some(65534), &format!("cat {l}/{f}"));
        let mounted = sh(Some(65534), &format!("cat {t}/{f}"));
        assert_eq!(
            mounted, lower,
            "{f}: reading as user 65534 through the mount and on the lower"
        );
        assert_eq!(lower.0, f == "granted", "{f} on the lower");
    }
    // Set through the mount (and taken away again): the lower holds it, and the kernel's
    // check follows at once.
    let (ok, _) = sh(
        None,
        &format!("echo s > {l}/set && chmod 0600 {l}/set && setfacl -m u:65534:r {t}/set"),
    );
    assert!(ok);
    assert!(sh(None, &format!("getfacl -cn {l}/set"))
        .1
        .contains("user:65534:r--"));
    assert!(
        sh(Some(65534), &format!("cat {t}/set")).0,
        "granted through the mount"
    );
    assert!(sh(None, &format!("setfacl -m u:65534:--- {t}/set")).0);
    assert!(
        !sh(Some(65534), &format!("cat {t}/set")).0,
        "refused after the change"
    );
    // Read once, an ACL is answered by the kernel: asking again sends no GETXATTR.
    let xattrs = || request_count(&stats_after_a_dir_sync(&m, &m.mnt), "xattr");
    let acl_of = |f: &str| sh(None, &format!("getfacl -cn {t}/{f}")).1;
    let first = acl_of("granted");
    let a = xattrs();
    for _ in 0..5 {
        assert_eq!(acl_of("granted"), first);
    }
    assert_eq!(xattrs(), a, "the ACL was asked of the daemon again");
    assert!(first.contains("user:65534:r--"), "{first}");
    m.umount();
}

/// An absent name is cached as absent for the entry timeout (a negative entry): looking it up
/// again costs no round trip (seen here as a file made behind the mount's back staying
/// unseen); a create, rename or mkdir through the mount makes a name present at once.
#[test]
fn an_absent_name_is_looked_up_once_and_a_create_makes_it_present_at_once() {
    if !can_mount() {
        return;
    }
    let mut m = Mount::new(None);
    // A long timeout: the test must not depend on how fast it runs.
    m.mount(&["--attr-timeout", "3600"]);
    let name = m.mnt.join("journal");
    assert_eq!(
        fs::metadata(&name).unwrap_err().kind(),
        std::io::ErrorKind::NotFound
    );
    // Made in the lower directly: the kernel answers from its cache without asking.
    fs::write(m.lower.join("journal"), b"behind").unwrap();
    for _ in 0..3 {
        assert_eq!(
            fs::metadata(&name).unwrap_err().kind(),
            std::io::ErrorKind::NotFound,
            "the absence was cached"
        );
    }
    fs::remove_file(m.lower.join("journal")).unwrap();
    let other = m.mnt.join("other");
    assert!(fs::metadata(&other).is_err());
    fs::write(&other, b"x").unwrap();
    assert_eq!(fs::read(&other).unwrap(), b"x");
    fs::rename(&other, m.mnt.join("moved")).unwrap();
    assert!(fs::metadata(&other).is_err());
    assert_eq!(fs::read(m.mnt.join("moved")).unwrap(), b"x");
    fs::create_dir(&other).unwrap();
    assert!(fs::metadata(&other).unwrap().is_dir());
}

#[test]
fn man_pages_are_current() {
    let d = tempfile::tempdir().unwrap();
    let st = Command::new(bin())
        .args(["man", "--out"])
        .arg(d.path())
        .status()
        .unwrap();
    assert!(st.success());
    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/man");
    let mut n = 0;
    for e in fs::read_dir(d.path()).unwrap().flatten() {
        let want = fs::read(e.path()).unwrap();
        let have = fs::read(committed.join(e.file_name())).unwrap_or_default();
        assert!(
            want == have,
            "docs/man/{} is stale: run `cargo run --release -- man --out docs/man`",
            e.file_name().to_string_lossy()
        );
        n += 1;
    }
    assert!(n >= 8, "expected a page per subcommand, got {n}");
    let mount = fs::read_to_string(d.path().join("pmstack-mount.1")).unwrap();
    assert!(mount.contains("flush_interval_ms") && mount.contains("fuse.pmstack"));
}

#[test]
fn remount_after_kill9_detaches_the_dead_mount_and_recovers() {
    if !can_mount() {
        return;
    }
    let mut m = Mount::new(None);
    m.mount(&["--flush-interval-ms", "600000"]);
    write_synced(&m.mnt.join("kept"), b"acknowledged before the crash");
    let pid = daemon_for(&m.mnt).expect("daemon");
    // SAFETY: plain kill.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_daemon_gone(&m.mnt);
    // The dead mount is still there: the kernel answers ENOTCONN or ECONNABORTED.
    let e = fs::metadata(&m.mnt).unwrap_err().raw_os_error();
    assert!(
        matches!(e, Some(libc::ENOTCONN | libc::ECONNABORTED)),
        "{e:?}"
    );
    // Mounting again over it (what systemd's Restart= does) detaches it and recovers.
    let out = pmstack(&[&"mount", &"--pm", &m.pm, &m.lower, &m.mnt]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("dead pmstack mount"), "{err}");
    assert!(err.contains("recovering"), "{err}");
    assert_eq!(mounts_at(&m.mnt).len(), 1);
    assert_eq!(
        fs::read(m.mnt.join("kept")).unwrap(),
        b"acknowledged before the crash"
    );
    m.umount();
    assert_eq!(
        fs::read(m.lower.join("kept")).unwrap(),
        b"acknowledged before the crash"
    );
}

#[test]
fn serve_metrics_count_every_attached_process_and_export_recovery_from_the_start() {
    if !can_mount() {
        return;
    }
    let addr = free_addr();
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let root = fs::canonicalize(d.path()).unwrap().join("root");
    fs::create_dir(&root).unwrap();
    let pm = d.path().join("r.pm");
    // Without the watch for writers outside `pmstack run`, whose vetting of new files
    // decides (by timing) whether their first syncs are absorbed or real.
    let serve = common::Served::start(
        &root,
        &pm,
        &["--metrics-addr", &addr, "--all-writers-attached"],
    );
    let (before, _) = metrics(&addr);
    // Recovery metrics exist (as 0) although no recovery happened.
    assert_eq!(sample(&before, "pmstack_recovery_file_ops", None), 0.0);
    // Two programs, each 25 write+fsync, both gone before the scrape.
    for k in 0..2 {
        let out = Command::new(bin())
            .args(["run", "--require-daemon", "--root"])
            .arg(&root)
            .args(["--", "python3", "-c"])
            .arg(format!(
                "import os\nf=os.open('{}/f{k}', os.O_CREAT|os.O_WRONLY, 0o644)\nfor i in range(25):\n  os.pwrite(f, b'x'*4096, i*4096); os.fsync(f)\n",
                root.display()
            ))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (after, body) = metrics(&addr);
    let d = |n: &str| sample(&after, n, None) - sample(&before, n, None);
    // Every fsync of both (exited) processes is counted, once: absorbed or real.
    let absorbed = d("pmstack_absorbed_fsync_total");
    assert_eq!(absorbed + d("pmstack_real_syncs_total"), 50.0, "{body}");
    assert!(absorbed >= 40.0, "{body}");
    assert!(
        d("pmstack_bytes_logged_total") >= absorbed * 4096.0,
        "{body}"
    );
    assert_eq!(scrape(&addr, "/other").0, 404);
    serve.stop();
}

#[test]
fn pmstacks_own_files_are_never_world_writable() {
    if !can_mount() {
        return;
    }
    use std::os::unix::fs::MetadataExt;
    let started = std::time::SystemTime::now() - Duration::from_secs(1);
    let mut m = Mount::new(None);
    m.mount(&[]);
    // A creation through the mount sets the daemon's umask to 0 (lower objects get exactly
    // the mode asked for); files pmstack writes for itself afterwards must say their mode.
    fs::write(m.mnt.join("f"), b"x").unwrap();
    let stats = Path::new("/run/pmstack").join(format!(
        "{}.stats",
        pmstack::lower::id_of(&fs::canonicalize(&m.mnt).unwrap())
    ));
    let first = fs::metadata(&stats).unwrap().ino();
    // The stats file is replaced twice a second: wait for a replacement made after the create.
    let t0 = Instant::now();
    while fs::metadata(&stats).map(|m| m.ino()).unwrap_or(first) == first {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "stats never rewritten"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for p in [stats.clone(), stats.with_extension("json")] {
        let mode = fs::metadata(&p).unwrap().mode() & 0o777;
        assert_eq!(mode & 0o022, 0, "{} has mode {mode:o}", p.display());
    }
    // And whatever else this mount wrote there (older files may be other runs').
    for e in fs::read_dir("/run/pmstack").unwrap().flatten() {
        let md = e.metadata().unwrap();
        if md.modified().unwrap() >= started {
            let mode = md.mode() & 0o777;
            assert_eq!(mode & 0o002, 0, "{} has mode {mode:o}", e.path().display());
        }
    }
    // The host's lock on the lower directory, named after its marker.
    let id = fs::read_to_string(m.lower.join(pmstack::lower::MARKER)).unwrap();
    let lock = Path::new("/run/pmstack").join(format!("lower-{}.lock", id.trim()));
    assert!(lock.exists(), "{} missing while mounted", lock.display());
    m.umount();
    // A clean unmount leaves nothing of this mount behind (an empty daemon log included).
    for p in [
        stats.with_extension("stats"),
        stats.with_extension("log"),
        lock,
    ] {
        assert!(!p.exists(), "{} left behind", p.display());
    }
    // And the lower directory can be taken again.
    m.mount(&[]);
    m.umount();
}

/// Under FUSE_HANDLE_KILLPRIV_V2 the kernel no longer asks for `security.capability` before
/// every write (a round trip each) and leaves dropping privileges to pmstack: a write or a
/// truncate by another user drops set-user-ID, set-group-ID (with group execute) and the file
/// capability, as on the lower file system; root's writes keep the mode bits.
#[test]
fn writes_by_other_users_drop_privileges_as_on_the_lower_without_a_round_trip() {
    privileges_after_writes("allow_other");
}

/// The same with the kernel's writeback cache: it writes pages back after the write returned
/// (a suid or sgid file's writes still come through at once, for the daemon to drop them).
#[test]
fn writes_through_the_writeback_cache_drop_privileges_as_on_the_lower() {
    privileges_after_writes("allow_other,cache=writeback");
}

fn privileges_after_writes(opts: &str) {
    if !can_mount() {
        return;
    }
    if !tools_present(&["setpriv", "setcap", "getcap"], "util-linux, libcap2-bin") {
        return;
    }
    let mut m = Mount::new(None);
    use std::os::unix::fs::PermissionsExt;
    // Another user reaches both trees.
    fs::set_permissions(m.base.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let native = m.base.path().join("native");
    fs::create_dir(&native).unwrap();
    m.mount(&["-o", opts]);
    let sh = |user: Option<u32>, cmd: &str| {
        let out = shell_as(user, cmd);
        assert!(out.status.success(), "{cmd}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let xattr_requests = |mnt: &Path| stat_json(mnt)["latency_us"]["xattr"]["count"].as_u64();
    let before = xattr_requests(&m.mnt);
    let mut seen = Vec::new();
    for dir in [&native, &m.mnt] {
        let d = dir.display();
        // (name, what user 65534 does to it)
        let cases = [
            ("w", format!("echo x >> {d}/w")),
            ("t", format!("truncate -s 1 {d}/t")),
        ];
        for (name, cmd) in &cases {
            sh(None, &format!(
                "echo a > {d}/{name} && chown 65534:65534 {d}/{name} && chmod 06775 {d}/{name} && setcap cap_net_raw+ep {d}/{name}"
            ));
            sh(Some(65534), cmd);
        }
        // Root's writes keep everything (CAP_FSETID).
        sh(None, &format!(
            "echo a > {d}/r && chmod 06775 {d}/r && setcap cap_net_raw+ep {d}/r && for i in $(seq 100); do echo y >> {d}/r; done"
        ));
        let got: Vec<String> = ["w", "t", "r"]
            .iter()
            .map(|n| {
                let mode = fs::metadata(dir.join(n)).unwrap().permissions().mode() & 0o7777;
                let cap = sh(None, &format!("getcap {d}/{n} | sed 's/.* //'"));
                format!("{n} {mode:o} [{cap}]")
            })
            .collect();
        seen.push(got);
    }
    assert_eq!(
        seen[0], seen[1],
        "privileges after writes: the lower's (left) and the mount's (right)"
    );
    // Any write drops the capability; root's keep set-user-ID and set-group-ID.
    assert_eq!(seen[0][2], "r 6775 []", "root keeps the mode bits");
    assert!(seen[0][0].starts_with("w 775 []"), "{:?}", seen[0]);
    // Root's 100 writes asked nothing about xattrs (setcap and getcap did: a handful).
    let after = xattr_requests(&m.mnt);
    assert!(
        after.unwrap_or(0) - before.unwrap_or(0) < 50,
        "xattr requests {before:?} -> {after:?}: the kernel still asks before every write"
    );
    m.umount();
}

/// A mount (default options) with a new directory `d` in it; None where mounting is not
/// possible here (`can_mount`).
fn mounted_with_dir() -> Option<(Mount, std::path::PathBuf)> {
    if !can_mount() {
        return None;
    }
    let mut m = Mount::new(None);
    m.mount(&[]);
    let d = m.mnt.join("d");
    fs::create_dir(&d).unwrap();
    Some((m, d))
}

/// The names in an open directory stream, from where it stands to its end ("." and ".."
/// left out), sorted.
fn stream_names(dir: *mut libc::DIR) -> Vec<String> {
    let mut v = Vec::new();
    loop {
        // SAFETY: `dir` is an open stream; readdir's entry is valid until the next call.
        let e = unsafe { libc::readdir(dir) };
        if e.is_null() {
            break;
        }
        // SAFETY: d_name is a NUL-terminated name.
        let n = unsafe { std::ffi::CStr::from_ptr((*e).d_name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        if n != "." && n != ".." {
            v.push(n);
        }
    }
    v.sort();
    v
}

/// A directory stream rewound by rewinddir sees the directory as it is then. POSIX: rewinddir
/// "shall also cause the directory stream to refer to the current state of the corresponding
/// directory, as a call to opendir() would have done". The mount once listed a directory at
/// OPENDIR and served that list until the stream was closed; READDIR now reads the lower
/// from the position asked (its own cookies), so a pass from the start sees the directory as
/// it is then.
#[test]
fn a_rewound_directory_stream_sees_the_directory_as_it_is_then() {
    use std::os::unix::ffi::OsStrExt;
    let Some((mut m, d)) = mounted_with_dir() else {
        return;
    };
    fs::write(d.join("a"), b"").unwrap();
    let c = std::ffi::CString::new(d.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid path.
    let dir = unsafe { libc::opendir(c.as_ptr()) };
    assert!(!dir.is_null(), "opendir {}", d.display());
    assert_eq!(stream_names(dir), ["a"]);
    fs::write(d.join("b"), b"").unwrap();
    fs::remove_file(d.join("a")).unwrap();
    // SAFETY: an open stream.
    unsafe { libc::rewinddir(dir) };
    let after = stream_names(dir);
    // SAFETY: an open stream, closed once.
    unsafe { libc::closedir(dir) };
    assert_eq!(after, ["b"], "the stream after rewinddir");
    m.umount();
}

/// A directory opened only to be fsynced (a mail delivery, SQLite's rollback journal) costs
/// one round trip, the FSYNCDIR: where the kernel checks the caller's rights (as root here)
/// the mount declines OPENDIR once, and the kernel sends no OPENDIR or RELEASEDIR again.
/// And a listing made without OPENDIR is whole (READDIR is served from the lower's own
/// positions, nothing kept per open directory).
#[test]
fn a_directory_opened_to_be_synced_costs_one_round_trip() {
    let Some((mut m, d)) = mounted_with_dir() else {
        return;
    };
    // More entries than one READDIR reply holds.
    for i in 0..500 {
        fs::write(d.join(format!("f{i:03}")), b"").unwrap();
    }
    for _ in 0..50 {
        fs::File::open(&d).unwrap().sync_all().unwrap();
    }
    let mut names: Vec<String> = fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let want: Vec<String> = (0..500).map(|i| format!("f{i:03}")).collect();
    assert_eq!(names, want, "the listing through the mount");
    // The daemon writes its stats out twice a second: until they show the syncs.
    let count = request_count;
    let t0 = Instant::now();
    let v = loop {
        let out = pmstack(&[&"stat", &"--json", &m.mnt]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        if count(&v, "fsyncdir") >= 50 || t0.elapsed() > Duration::from_secs(60) {
            break v;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let count = |op: &str| count(&v, op);
    assert_eq!(count("fsyncdir"), 50, "stats: {v}");
    assert!(
        count("open") <= 1,
        "OPENDIR is still sent for each open of a directory: {} OPEN/OPENDIR requests",
        count("open")
    );
    m.umount();
}

/// A directory of `n` files of distinct sizes (`f000` holds 0 bytes, `f001` 1, ...), a
/// subdirectory and a symbolic link, made in the lower before the mount (so the kernel has
/// none of them cached), then mounted.
fn mounted_over_a_listed_dir(n: usize) -> Option<(Mount, std::path::PathBuf)> {
    if !can_mount() {
        return None;
    }
    let mut m = Mount::new(None);
    let d = m.lower.join("d");
    fs::create_dir(&d).unwrap();
    for i in 0..n {
        fs::write(d.join(format!("f{i:03}")), vec![b'x'; i]).unwrap();
    }
    fs::create_dir(d.join("sub")).unwrap();
    std::os::unix::fs::symlink("f001", d.join("link")).unwrap();
    m.mount(&[]);
    let d = m.mnt.join("d");
    Some((m, d))
}

/// What a listing and a stat of each entry show: per name, its type, size and inode number
/// as the directory entry gives it and as stat gives it.
fn listed(d: &Path) -> Vec<(String, bool, bool, u64, u64, u64)> {
    use std::os::unix::fs::{DirEntryExt, MetadataExt};
    let mut v: Vec<_> = fs::read_dir(d)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let md = fs::symlink_metadata(e.path()).unwrap();
            let t = e.file_type().unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                t.is_dir(),
                t.is_symlink(),
                md.len(),
                e.ino(),
                md.ino(),
            )
        })
        .collect();
    v.sort();
    v
}

/// The mount's stats once they show what was done before `marker` (they are written out
/// twice a second): `marker` fsyncs a directory through the mount, which is counted after
/// everything before it.
fn stats_after_a_dir_sync(m: &Mount, dir: &Path) -> serde_json::Value {
    let before = request_count(&stat_json(&m.mnt), "fsyncdir");
    fs::File::open(dir).unwrap().sync_all().unwrap();
    let t0 = Instant::now();
    loop {
        let v = stat_json(&m.mnt);
        if request_count(&v, "fsyncdir") > before {
            return v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the stats never showed the directory sync: {v}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Listing a directory and stating what it holds (`ls -l`, `du`, `find -ls`, `rsync`,
/// `git status`) costs no LOOKUP round trip per entry: READDIRPLUS gives each entry's node
/// and attributes with the listing. And what it gives is what the lower holds: the same
/// names, types and sizes, and inode numbers that agree between the entry and its stat.
#[test]
fn listing_a_directory_and_stating_its_entries_costs_no_lookup_per_entry() {
    let Some((mut m, d)) = mounted_over_a_listed_dir(600) else {
        return;
    };
    let lookups = |v: &serde_json::Value| request_count(v, "lookup");
    let before = lookups(&stats_after_a_dir_sync(&m, &m.mnt));
    let got = listed(&d);
    let after = lookups(&stats_after_a_dir_sync(&m, &m.mnt));
    let want: Vec<_> = listed(&m.lower.join("d"))
        .into_iter()
        .map(|(n, dir, sym, len, _, _)| (n, dir, sym, len))
        .collect();
    let got_no_ino: Vec<_> = got
        .iter()
        .map(|(n, dir, sym, len, _, _)| (n.clone(), *dir, *sym, *len))
        .collect();
    assert_eq!(got_no_ino, want, "the listing and stats through the mount");
    for (n, _, _, _, entry_ino, stat_ino) in &got {
        assert_eq!(
            entry_ino, stat_ino,
            "{n}: the entry's inode number and its stat's"
        );
    }
    // "d" itself may be looked up; its 602 entries must not be, one by one.
    assert!(
        after - before <= 10,
        "{} LOOKUP requests to list and stat 602 entries",
        after - before
    );
    m.umount();
}

/// Every entry READDIRPLUS gives is a lookup the kernel counts and returns with FORGET, and
/// one that did not fit in a reply is not counted: once the kernel forgets every inode
/// (drop_caches), the daemon holds none but the root's.
#[test]
fn the_inodes_a_listing_gave_the_kernel_are_all_forgotten_with_it() {
    let Some((mut m, d)) = mounted_over_a_listed_dir(600) else {
        return;
    };
    // More entries than one reply holds: several replies end with one that did not fit.
    assert_eq!(listed(&d).len(), 602);
    let open = |m: &Mount| stat_json(&m.mnt)["node_fds_open"].as_u64().unwrap();
    let t0 = Instant::now();
    loop {
        fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
        // The kernel's FORGETs are sent as it evicts; the stats are written twice a second.
        let v = stats_after_a_dir_sync(&m, &m.mnt);
        if v["node_fds_open"].as_u64().unwrap() <= 1 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the daemon still holds {} inode descriptors after the kernel forgot every inode",
            open(&m)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    m.umount();
}
