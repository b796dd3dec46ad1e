//! Helpers for tests that mount for real.
#![allow(dead_code)]

use std::fs;
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
        panic!("no pmstack daemon for {}", self.mnt.display());
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
            if rel == ".pmstack-id" {
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
