//! pmstack over distributed file systems' client mounts: GlusterFS (a two-brick replica
//! volume) and JuiceFS (SQLite metadata, a local bucket), set up by `scripts/lowers`. Each
//! runs the kill -9 tests, the reference-model test and recovery after the client was
//! remounted (through the mount, and through `pmstack run`, whose daemon fsyncs each changed
//! object there). In CI (CI=true) a missing file system is a failure; elsewhere the test says
//! what is missing and returns.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// One distributed file system under a temporary directory, torn down on drop.
struct Lower {
    dir: PathBuf,
    mnt: PathBuf,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/lowers")
}

/// `scripts/lowers CMD ARG DIR`, which must succeed.
fn lowers(args: &[&str], dir: &Path) {
    let out = Command::new(script()).args(args).arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "scripts/lowers {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Lower {
    fn up(kind: &str) -> Option<Lower> {
        let tool = if kind == "glusterfs" {
            "glusterd"
        } else {
            "juicefs"
        };
        let have = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !have {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("CI: {kind} is not installed (scripts/lowers install)");
            }
            eprintln!("note: {kind} is not installed (scripts/lowers install); skipped");
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix(&format!("pmstack-{kind}-"))
            .tempdir_in("/var/tmp")
            .unwrap()
            .keep();
        lowers(&["up", kind], &dir);
        let mnt = dir.join("mnt");
        Some(Lower { dir, mnt })
    }

    fn remount(&self) {
        lowers(&["remount"], &self.dir);
    }

    /// A fresh directory on the distributed file system.
    fn subdir(&self, name: &str) -> PathBuf {
        let d = self.mnt.join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}

impl Drop for Lower {
    fn drop(&mut self) {
        let _ = Command::new(script()).arg("down").arg(&self.dir).status();
    }
}

/// Another node (a second client of the file system, with a /run/pmstack of its own) is
/// refused while this one holds the lease: the file system itself enforces it.
fn second_node_is_refused(l: &Lower) {
    let dir = l.subdir("lease");
    let mut m = common::Mount::new(Some(dir));
    m.mount(&["--mode", "sync"]);
    lowers(&["mount2"], &l.dir);
    let mnt2 = m.base.path().join("node2");
    std::fs::create_dir_all(&mnt2).unwrap();
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount -t tmpfs pmstack-test /run/pmstack && \"$PMSTACK\" mount --pm /dev/shm/pmstack-test-node2-{}.pm {} {}",
            std::process::id(),
            l.dir.join("mnt2/lease").display(),
            mnt2.display()
        ))
        .env("PMSTACK", common::bin())
        .output()
        .unwrap();
    let _ = std::fs::remove_file(format!(
        "/dev/shm/pmstack-test-node2-{}.pm",
        std::process::id()
    ));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a second node mounted over a held lease"
    );
    assert!(err.contains("is in use by pmstack on host"), "{err}");
    m.umount();
    let _ = Command::new("umount").arg(l.dir.join("mnt2")).status();
}

fn all_over(kind: &str) {
    if !common::can_mount() {
        return;
    }
    let Some(l) = Lower::up(kind) else {
        return;
    };
    // PMSTACK_CRASH_SEED=N reruns the kill -9 rounds of a failing run (its message names
    // the seed of the round: the power-cut rounds use N, N+1, …) and nothing else.
    let fixed: Option<u64> = std::env::var("PMSTACK_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok());
    if fixed.is_none() {
        common::remount::recover_after_client_remount(&l.mnt, &|| l.remount());
        common::remount::recover_after_client_remount_under_run(&l.mnt, &|| l.remount());
        second_node_is_refused(&l);
        for mode in ["sync", "strict", "adaptive"] {
            common::model::run_mode(mode, Some(l.subdir(&format!("model-{mode}"))));
        }
    }
    let seed0: u64 = fixed.unwrap_or_else(rand::random);
    eprintln!("{kind}: kill -9 rounds from seed {seed0} (rerun: PMSTACK_CRASH_SEED={seed0})");
    let rounds: u64 = std::env::var("PMSTACK_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12)
        / 3;
    for r in 0..rounds.max(1) {
        let d = l.subdir(&format!("crash-power-{r}"));
        common::crash::run_once(seed0.wrapping_add(r), Some(d.clone()), true);
        std::fs::remove_dir_all(d).unwrap();
        let d = l.subdir(&format!("crash-kill-{r}"));
        common::crash::run_once(seed0.wrapping_add(1000 + r), Some(d.clone()), false);
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn over_glusterfs() {
    all_over("glusterfs");
}

#[test]
fn over_juicefs() {
    all_over("juicefs");
}
