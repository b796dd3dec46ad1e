//! Recovery after the lower's client was remounted (run by `tests/fuse_lower.rs` over bindfs
//! and by `tests/distributed.rs` over GlusterFS and JuiceFS).

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use super::{bin, Mount};

/// pmstack over `lower` (a FUSE client mount) absorbs fsynced creates and overwrites, is
/// killed with -9; the node "crashes": the file system below loses what pmstack wrote but
/// never made durable (modelled by undoing it through the client), and `remount` gives a new
/// client (new node numbers: every file handle of the old one is stale, or opens another
/// object once the new client hands the same number out). Recovery must find every object
/// the log names again and replay all of it, and only then call the region clean.
pub fn recover_after_client_remount(lower: &Path, remount: &dyn Fn()) {
    let work = lower.join(format!("remount-{}", std::process::id()));
    make_old(&work);
    let mut m = Mount::new(Some(lower.to_owned()));
    // Write-back far away: every acknowledged operation stays live in the log.
    m.mount(&["--mode", "sync", "--flush-interval-ms", "3600000"]);
    let top = m.mnt.join(work.file_name().unwrap());
    fs::create_dir(top.join("new")).unwrap();
    for k in 0..N {
        let f = fs::File::create(top.join(format!("new/{k}"))).unwrap();
        f.write_all_at(&content(k, 1), 0).unwrap();
        f.sync_all().unwrap();
        let g = fs::OpenOptions::new()
            .write(true)
            .open(top.join(format!("old/{k}")))
            .unwrap();
        g.write_all_at(&content(k, 2), 100).unwrap();
        g.sync_data().unwrap();
    }
    m.kill9();
    lose_and_recover(lower, &work, &m.pm, remount);
    let v = m.check_json();
    assert_eq!(v["clean"], serde_json::json!(true), "{v}");
    fs::remove_dir_all(&work).unwrap();
}

/// `recover_after_client_remount` through `pmstack run`: `pmstack serve` over `lower` (a FUSE
/// client mount, whose syncfs the kernel does not forward: the daemon fsyncs each changed
/// object), a program under `pmstack run` makes the same fsynced creates and overwrites,
/// the daemon is killed with -9, the file system below loses what was not durable, the client
/// is remounted, and recovery must replay all of it.
pub fn recover_after_client_remount_under_run(lower: &Path, remount: &dyn Fn()) {
    let name = format!("remount-run-{}", std::process::id());
    let work = lower.join(&name);
    make_old(&work);
    // One region per call: the tests of several lowers run at once in one process.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let pm = std::path::PathBuf::from(format!(
        "/dev/shm/pmstack-test-remount-run-{}-{}.pm",
        std::process::id(),
        CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _gone = super::RemoveOnDrop(pm.clone());
    // Write-back far away: every acknowledged operation stays live in the log. No watch for
    // writers outside `pmstack run`: the first sync of a new file is then absorbed at once.
    let mut served = super::Served::start(
        lower,
        &pm,
        &[
            "--pm-size",
            "64M",
            "--flush-interval-ms",
            "3600000",
            "--all-writers-attached",
        ],
    );
    // The first operation in a directory the daemon has not seen change is a write-back of
    // everything (it may hold changes the log lacks): `new` gets one, then the logged ones.
    // A file made before the daemon started is absorbed from its first sync (its baseline,
    // the file logged whole), once its name is known to be durable: `old` is synced first,
    // which writes back what it may hold that the log lacks (otherwise the first sync in it
    // would, and with it every record logged before, which the loss modelled below ignores).
    let script = r#"
import os, sys
top, n = sys.argv[1], int(sys.argv[2])
content = lambda k, tag: bytes(((i & 255) ^ tag ^ k) & 255 for i in range(3000 + 97 * k))
fd = os.open(top + "/old", os.O_RDONLY); os.fsync(fd); os.close(fd)
os.mkdir(top + "/new")
fd = os.open(top + "/new/warm", os.O_CREAT | os.O_WRONLY, 0o644); os.fsync(fd); os.close(fd)
for k in range(n):
    fd = os.open(f"{top}/new/{k}", os.O_CREAT | os.O_WRONLY, 0o644)
    os.pwrite(fd, content(k, 1), 0); os.fsync(fd); os.close(fd)
    fd = os.open(f"{top}/old/{k}", os.O_WRONLY)
    os.pwrite(fd, b"o" * 5000, 0); os.fsync(fd)
    os.pwrite(fd, content(k, 2), 100); os.fdatasync(fd); os.close(fd)
"#;
    let n = N.to_string();
    super::run_python(lower, script, &[work.as_os_str(), n.as_ref()]);
    // The model below (the lower loses every new name and byte the log holds) needs the
    // namespace operations logged, which needs the lower's directory change times fine
    // (`front::ctime_fine`; JuiceFS: `--skip-dir-mtime 0`, as scripts/lowers mounts it).
    let t0 = std::time::Instant::now();
    let fine = loop {
        if let Some(f) = super::served_stats(lower)["ctime_fine"].as_bool() {
            break f;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "no stats from serve"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(
        fine,
        "{}: its directory change times are coarse (JuiceFS: mount it with --skip-dir-mtime 0)",
        lower.display()
    );
    served.kill9();
    lose_and_recover(lower, &work, &pm, remount);
    let out = Command::new(bin())
        .args(["check", "--json", "--pm"])
        .arg(&pm)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert_eq!(v["clean"], serde_json::json!(true), "{v}");
    fs::remove_dir_all(&work).unwrap();
}

/// Files per directory in these tests.
const N: usize = 40;

/// What the test writes: file `k`'s bytes for `tag` (1: a new file, 2: an overwrite).
fn content(k: usize, tag: u8) -> Vec<u8> {
    (0..3000 + 97 * k)
        .map(|i| (i as u8) ^ tag ^ k as u8)
        .collect()
}

/// `work/old/0..N`, each 5000 bytes of `o`, made before pmstack runs.
fn make_old(work: &Path) {
    let _ = fs::remove_dir_all(work);
    fs::create_dir_all(work.join("old")).unwrap();
    for k in 0..N {
        fs::write(work.join(format!("old/{k}")), vec![b'o'; 5000]).unwrap();
    }
}

/// After pmstack (region `pm`) was killed: the node "crashes" (the lower loses the overwrites
/// and the new files' bytes, a quarter of the new files entirely), the client is remounted,
/// recovery runs, and every fsynced byte must be back.
fn lose_and_recover(lower: &Path, work: &Path, pm: &Path, remount: &dyn Fn()) {
    let mut want = BTreeMap::new();
    for k in 0..N {
        want.insert(format!("new/{k}"), content(k, 1));
        let mut o = vec![b'o'; 5000];
        let c = content(k, 2);
        if o.len() < 100 + c.len() {
            o.resize(100 + c.len(), 0);
        }
        o[100..100 + c.len()].copy_from_slice(&c);
        want.insert(format!("old/{k}"), o);
    }
    for k in 0..N {
        fs::write(work.join(format!("old/{k}")), vec![b'o'; 5000]).unwrap();
        if k % 4 == 0 {
            fs::remove_file(work.join(format!("new/{k}"))).unwrap();
        } else {
            fs::File::create(work.join(format!("new/{k}"))).unwrap();
        }
    }
    remount();
    // Programs on the node look names up first, so old handles could open the wrong objects.
    for k in (0..N).rev() {
        let _ = fs::metadata(work.join(format!("old/{k}")));
    }
    let out = Command::new(bin())
        .args(["recover", "--pm"])
        .arg(pm)
        .arg(lower)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "recover failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (name, bytes) in &want {
        let got = fs::read(work.join(name)).unwrap_or_default();
        assert!(
            &got == bytes,
            "{name}: {} bytes after recovery, want {} fsynced bytes; recover said: {}",
            got.len(),
            bytes.len(),
            String::from_utf8_lossy(&out.stdout)
        );
    }
}
