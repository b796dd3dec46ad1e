//! Helpers for tests that mount for real.
#![allow(dead_code)]

pub mod crash;
pub mod model;
pub mod remount;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::FileExt;

use rand::Rng;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_pmstack")
}

/// Whether real mounts can run here. In CI (CI=true) a missing prerequisite is a failure.
pub fn can_mount() -> bool {
    let root = rustix::process::geteuid().is_root();
    let fuse = Path::new("/dev/fuse").exists();
    if root && fuse {
        return true;
    }
    let why = format!("mount tests need root and /dev/fuse (root: {root}, /dev/fuse: {fuse})");
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{why}");
    }
    eprintln!("SKIPPED: {why}");
    false
}

pub struct Mount {
    pub base: tempfile::TempDir,
    pub lower: PathBuf,
    pub mnt: PathBuf,
    pub pm: PathBuf,
    pub mounted: bool,
}

impl Mount {
    /// A fresh lower (on the disk unless `lower` is given) and mountpoint.
    pub fn new(lower: Option<PathBuf>) -> Mount {
        let base = tempfile::Builder::new()
            .prefix("pmstack-test-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let lower = lower.unwrap_or_else(|| base.path().join("lower"));
        let mnt = base.path().join("mnt");
        fs::create_dir_all(&lower).unwrap();
        fs::create_dir_all(&mnt).unwrap();
        let pm = PathBuf::from(format!(
            "/dev/shm/pmstack-test-{}-{}.pm",
            std::process::id(),
            base.path().file_name().unwrap().to_string_lossy()
        ));
        Mount {
            base,
            lower,
            mnt,
            pm,
            mounted: false,
        }
    }

    pub fn mount(&mut self, args: &[&str]) {
        let out = Command::new(bin())
            .arg("mount")
            .arg("--pm")
            .arg(&self.pm)
            .args(args)
            .arg(&self.lower)
            .arg(&self.mnt)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mount failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.mounted = true;
    }

    pub fn umount(&mut self) {
        let out = Command::new(bin())
            .arg("umount")
            .arg(&self.mnt)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "umount failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.mounted = false;
    }

    pub fn daemon_pid(&self) -> i32 {
        // The daemon is the process whose command line names our mountpoint.
        for e in fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(cmd) = fs::read(e.path().join("cmdline")) else {
                continue;
            };
            let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
            if args.iter().any(|a| *a == b"mount")
                && args
                    .iter()
                    .any(|a| *a == self.mnt.as_os_str().as_encoded_bytes())
                && args.first().is_some_and(|a| a.ends_with(b"pmstack"))
            {
                return pid;
            }
        }
        // Gone: what it last said (its log is removed with the mount's runtime files).
        let said = fs::canonicalize(&self.mnt)
            .map(|m| {
                let id = pmstack::lower::id_of(&m);
                fs::read_to_string(format!("/run/pmstack/{id}.log")).unwrap_or_default()
            })
            .unwrap_or_default();
        let mut from = said.len().saturating_sub(3000);
        while !said.is_char_boundary(from) {
            from += 1;
        }
        let tail = &said[from..];
        panic!(
            "no pmstack daemon for {}; its log ends: {tail:?}",
            self.mnt.display()
        );
    }

    /// SIGKILL the daemon and detach the dead mount.
    pub fn kill9(&mut self) {
        let pid = self.daemon_pid();
        // SAFETY: plain kill.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let t0 = Instant::now();
        // SAFETY: probing only.
        while unsafe { libc::kill(pid, 0) } == 0 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let c = std::ffi::CString::new(self.mnt.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid C string; lazy detach of a dead FUSE mount.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        self.mounted = false;
    }

    pub fn check_json(&self) -> serde_json::Value {
        let out = Command::new(bin())
            .args(["check", "--json", "--pm"])
            .arg(&self.pm)
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("check output: {}", String::from_utf8_lossy(&out.stderr)))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new(bin()).arg("umount").arg(&self.mnt).output();
        }
        let c = std::ffi::CString::new(self.mnt.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid C string.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        let _ = fs::remove_file(&self.pm);
        remove_runtime_files(&self.lower, Some(&self.mnt));
    }
}

/// Remove what pmstack keeps in /run/pmstack for a mount at `mnt` (its state, last stats and
/// log) or a `pmstack serve` of `lower` (its socket and last stats) once they are gone, and
/// the lower's lock file if nobody holds it: a daemon killed by a test leaves them, and tests
/// make a new directory each time.
pub fn remove_runtime_files(lower: &Path, mnt: Option<&Path>) {
    let run = Path::new("/run/pmstack");
    if let Some(mp) = mnt.and_then(|m| fs::canonicalize(m).ok()) {
        let id = pmstack::lower::id_of(&mp);
        for ext in ["json", "stats", "log"] {
            let _ = fs::remove_file(run.join(format!("{id}.{ext}")));
        }
    }
    // As given where it is gone already (a temporary directory dropped first).
    let lower = fs::canonicalize(lower).unwrap_or_else(|_| lower.to_path_buf());
    let (sock, _, stats) = pmstack::front::paths(&lower);
    let _ = fs::remove_file(sock);
    let _ = fs::remove_file(stats);
    let id = fs::read_to_string(lower.join(pmstack::lower::MARKER))
        .ok()
        .and_then(|t| pmstack::lower::parse_marker(&t));
    if let Some(id) = id {
        let lock = run.join(format!("lower-{}.lock", uuid::Uuid::from_bytes(id)));
        if let Ok(f) = fs::File::open(&lock) {
            use std::os::fd::AsRawFd;
            // SAFETY: plain flock on an owned descriptor. Removed only while held here: a
            // live owner's lock stays.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                let _ = fs::remove_file(&lock);
            }
        }
    }
}

/// A snapshot of a tree: path -> (kind, mode, size, nlink, content hash or link target, xattrs).
pub fn tree(root: &Path) -> std::collections::BTreeMap<String, String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = std::collections::BTreeMap::new();
    fn walk(root: &Path, dir: &Path, out: &mut std::collections::BTreeMap<String, String>) {
        let mut ents: Vec<_> = fs::read_dir(dir).unwrap().flatten().collect();
        ents.sort_by_key(|e| e.file_name());
        for e in ents {
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().to_string();
            if pmstack::lower::is_internal(rel.as_bytes()) {
                continue;
            }
            let md = fs::symlink_metadata(&p).unwrap();
            let ft = md.file_type();
            let what = if ft.is_dir() {
                walk(root, &p, out);
                "dir".to_string()
            } else if ft.is_symlink() {
                format!("link->{}", fs::read_link(&p).unwrap().display())
            } else if ft.is_file() {
                format!("file crc={:08x}", crc32c::crc32c(&fs::read(&p).unwrap()))
            } else {
                "special".to_string()
            };
            let mut xattrs = String::new();
            if !ft.is_symlink() {
                for k in xattr_list(&p) {
                    xattrs.push_str(&format!(" {k}"));
                }
            }
            let size = if ft.is_dir() { 0 } else { md.size() };
            out.insert(
                rel,
                format!(
                    "{what} mode={:o} size={size} nlink={}{xattrs}",
                    md.mode() & 0o7777,
                    md.nlink()
                ),
            );
        }
    }
    walk(root, root, &mut out);
    out
}

fn xattr_list(p: &Path) -> Vec<String> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let mut buf = vec![0u8; 4096];
    // SAFETY: valid pointers.
    let n = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr() as *mut _, buf.len()) };
    if n <= 0 {
        return vec![];
    }
    let mut v: Vec<String> = buf[..n as usize]
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).to_string())
        .filter(|s| s.starts_with("user."))
        .collect();
    v.sort();
    v
}

/// An ext4 file system on a loop-mounted image, as the issue asks for the lower.
pub struct LoopFs {
    pub img: PathBuf,
    pub dir: PathBuf,
}

impl LoopFs {
    pub fn new(base: &Path) -> Option<LoopFs> {
        LoopFs::of("ext4", 2 << 30, base)
    }

    /// A loop-mounted file system of type `fs` (its mkfs takes `-q -f`/`-q -F`) in an image
    /// of `size` bytes (sparse) under `base`.
    pub fn of(fs: &str, size: u64, base: &Path) -> Option<LoopFs> {
        let img = base.join("lower.img");
        let dir = base.join(fs);
        fs::create_dir_all(&dir).ok()?;
        let f = fs::File::create(&img).ok()?;
        f.set_len(size).ok()?;
        let force = if fs.starts_with("ext") { "-F" } else { "-f" };
        let ok = Command::new(format!("mkfs.{fs}"))
            .args(["-q", force])
            .arg(&img)
            .status()
            .ok()?
            .success()
            && Command::new("mount")
                .args(["-o", "loop"])
                .arg(&img)
                .arg(&dir)
                .status()
                .ok()?
                .success();
        if !ok {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("CI: cannot create a loop-mounted {fs} lower (mkfs.{fs} / mount -o loop failed)");
            }
            eprintln!("note: no loop-mounted {fs} here");
            return None;
        }
        Some(LoopFs { img, dir })
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        let _ = fs::remove_file(&self.img);
    }
}

/// Snapshot of the lower: relative path -> content (regular files only).
pub fn snapshot(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut m = BTreeMap::new();
    for e in fs::read_dir(root).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if pmstack::lower::is_internal(n.as_bytes()) || n == "lost+found" {
            continue;
        }
        if e.file_type().unwrap().is_file() {
            m.insert(n, fs::read(e.path()).unwrap());
        }
    }
    m
}

/// Rewind the lower to a state a power cut could leave, given that nothing was made durable
/// since `old` was taken.
pub fn power_cut(root: &Path, old: &BTreeMap<String, Vec<u8>>, rng: &mut impl Rng) {
    let now = snapshot(root);
    for (name, cur) in &now {
        let p = root.join(name);
        match old.get(name) {
            None => {
                if rng.gen_bool(0.4) {
                    fs::remove_file(&p).unwrap(); // its creation never reached the disk
                    continue;
                }
                // Unsynced page writes of a new file may be lost: holes/zeros, size rewound.
                let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
                for pg in 0..cur.len().div_ceil(4096) {
                    if rng.gen_bool(0.3) {
                        let end = ((pg + 1) * 4096).min(cur.len());
                        f.write_all_at(&vec![0; end - pg * 4096], (pg * 4096) as u64)
                            .unwrap();
                    }
                }
                if rng.gen_bool(0.3) {
                    f.set_len(rng.gen_range(0..=cur.len() as u64) / 4096 * 4096)
                        .unwrap();
                }
            }
            Some(prev) => {
                let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
                for pg in 0..cur.len().max(prev.len()).div_ceil(4096) {
                    if rng.gen_bool(0.5) {
                        let s = pg * 4096;
                        let e = ((pg + 1) * 4096).min(prev.len());
                        if s < e {
                            f.write_all_at(&prev[s..e], s as u64).unwrap();
                        }
                    }
                }
                if rng.gen_bool(0.5) {
                    f.set_len(prev.len() as u64).unwrap();
                }
            }
        }
    }
    // Sync our own rewinding so the remount sees it (this is the test harness, not pmstack).
    Command::new("sync").status().unwrap();
}

/// An installed test tool (`cargo install --locked NAME`): on PATH or in ~/.cargo/bin. In CI
/// a missing tool is a failure.
pub fn cargo_tool(name: &str) -> Option<PathBuf> {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let found = std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .map(PathBuf::from)
        .chain([PathBuf::from(home).join(".cargo/bin")])
        .map(|d| d.join(name))
        .find(|p| p.exists());
    if found.is_none() {
        let why = format!("{name} is not installed (cargo install --locked {name}; .ci/run does)");
        assert!(!std::env::var("CI").is_ok_and(|v| v == "true"), "CI: {why}");
        eprintln!("SKIPPED: {why}");
    }
    found
}

/// Build the preload library beside the pmstack binary (`cargo test` builds binaries, not
/// the workspace's cdylib).
pub fn preload_built() {
    static ONCE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        let bin = Path::new(bin());
        let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        c.args(["build", "-p", "pmstack-preload"])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if bin.parent().is_some_and(|p| p.ends_with("release")) {
            c.arg("--release");
        }
        assert!(
            c.status().expect("running cargo build").success(),
            "building libpmstack_preload.so failed"
        );
        assert!(bin.with_file_name("libpmstack_preload.so").exists());
    });
}

/// `pmstack serve DIR --pm PM EXTRA…`, returned once its socket accepts connections.
pub fn start_serve(dir: &Path, pm: &Path, extra: &[&str]) -> std::process::Child {
    preload_built();
    let child = Command::new(bin())
        .arg("serve")
        .arg(dir)
        .arg("--pm")
        .arg(pm)
        .args(extra)
        .args(["--log-level", "warn"])
        .stdin(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for_serve(dir);
    child
}

/// Wait until a `serve` of `dir` answers on its socket (at most 30 s).
pub fn wait_for_serve(dir: &Path) {
    let sock = pmstack::front::paths(dir).0;
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "serve did not come up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The stats a `serve` of `dir` writes (null until it wrote them).
pub fn served_stats(dir: &Path) -> serde_json::Value {
    let s = fs::read_to_string(pmstack::front::paths(dir).2).unwrap_or_default();
    serde_json::from_str(&s).unwrap_or_default()
}

/// SIGTERM a `serve` and check that it stopped cleanly (the final write-back ran).
pub fn stop_serve(mut child: std::process::Child) {
    // SAFETY: signalling our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = child.wait().unwrap();
    assert!(st.success(), "serve exited with {st}");
}

/// A command running `program` plain, or under `pmstack run --root ROOT` when given.
pub fn maybe_run(program: &Path, run_root: Option<&Path>) -> Command {
    match run_root {
        Some(root) => {
            let mut c = Command::new(bin());
            c.arg("run").arg("--root").arg(root).arg("--").arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// A `serve` that is killed if the test fails before it stops it (nothing left running).
/// The daemon's shared table (in /dev/shm) is removed with it, also after a kill -9, and so
/// are its last stats. The second field is the served directory.
pub struct Served(pub Option<std::process::Child>, PathBuf);

impl Served {
    pub fn start(dir: &Path, pm: &Path, extra: &[&str]) -> Served {
        Served(Some(start_serve(dir, pm, extra)), dir.to_path_buf())
    }

    /// SIGTERM and a clean exit (`stop_serve`); the daemon's last stats.
    pub fn stop(mut self) -> serde_json::Value {
        if let Some(c) = self.0.take() {
            stop_serve(c);
        }
        served_stats(&self.1)
    }

    /// SIGKILL, as a crash.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
            let _ = fs::remove_file(pmstack::front::paths(&self.1).1);
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.kill9();
        remove_runtime_files(&self.1, None);
    }
}

/// A file removed on drop (also after a failure): a PM region a test made.
pub struct RemoveOnDrop(pub PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Run a Python `script` with `args` under `pmstack run --root ROOT`; it must succeed.
pub fn run_python(root: &Path, script: &str, args: &[&std::ffi::OsStr]) {
    let st = maybe_run(Path::new("python3"), Some(root))
        .arg("-c")
        .arg(script)
        .args(args)
        .status()
        .unwrap();
    assert!(st.success(), "the program under pmstack run failed: {st}");
}

/// Child processes killed and reaped when dropped, however the test ends (a failed assertion
/// must not leave them running).
pub struct Reaped(pub Vec<std::process::Child>);

impl std::ops::Deref for Reaped {
    type Target = Vec<std::process::Child>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        for k in &mut self.0 {
            let _ = k.kill();
            let _ = k.wait();
        }
    }
}
