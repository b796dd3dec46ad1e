//! Kill -9 tests against a real mount, with a power-loss model applied to the lower directory
//! before recovery (the test itself: `common/crash.rs`).

mod common;

use std::fs;

use common::crash::run_once;
use common::LoopFs;

#[test]
fn kill9_with_power_loss_on_the_lower() {
    if !common::can_mount() {
        return;
    }
    let base = tempfile::Builder::new()
        .prefix("pmstack-crash-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let lfs = LoopFs::new(base.path());
    let rounds: u64 = std::env::var("PMSTACK_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let seed0: u64 = rand::random();
    for r in 0..rounds {
        let lower = lfs.as_ref().map(|l| l.dir.join(format!("round{r}")));
        if let Some(l) = &lower {
            fs::create_dir_all(l).unwrap();
        }
        run_once(seed0.wrapping_add(r), lower.clone(), true);
        if let Some(l) = lower {
            fs::remove_dir_all(l).unwrap();
        }
    }
}

#[test]
fn kill9_while_write_back_and_gc_run() {
    if !common::can_mount() {
        return;
    }
    let rounds: u64 = std::env::var("PMSTACK_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let seed0: u64 = rand::random();
    for r in 0..rounds / 2 {
        run_once(seed0.wrapping_add(r), None, false);
    }
}

/// An O_SYNC write through a sync mount is logged before it reaches the lower; when the lower
/// then refuses it (no space left), the program is told it failed, and its record must not
/// stand: replayed after a crash (once there is room again), it wrote bytes nobody was told
/// were written. The lower is a 32 MiB ext4 image filled up from outside the mount.
#[test]
fn bytes_of_a_write_the_lower_refused_are_never_replayed() {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if !common::can_mount() {
        return;
    }
    let base = tempfile::Builder::new()
        .prefix("pmstack-enospc-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let Some(lfs) = LoopFs::of("ext4", 32 << 20, base.path()) else {
        return;
    };
    let lower = lfs.dir.join("lower");
    fs::create_dir(&lower).unwrap();
    let mut m = common::Mount::new(Some(lower.clone()));
    m.mount(&[]);
    // Fill the file system, beside the mount's lower directory.
    let filler = lfs.dir.join("filler");
    {
        let mut f = fs::File::create(&filler).unwrap();
        let chunk = vec![0x5au8; 1 << 20];
        while f.write_all(&chunk).and_then(|_| f.sync_all()).is_ok() {}
        let _ = f.sync_all();
    }
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .custom_flags(libc::O_SYNC)
        .open(m.mnt.join("f"))
        .unwrap();
    let refused = f.write_all(&vec![b'r'; 4 << 20]);
    assert!(refused.is_err(), "the full file system took 4 MiB");
    drop(f);
    let had = fs::metadata(lower.join("f")).unwrap().len();
    m.kill9();
    // Room again: a replay of the refused write would now succeed.
    fs::remove_file(&filler).unwrap();
    m.mount(&[]);
    let len = fs::metadata(m.mnt.join("f")).unwrap().len();
    m.umount();
    assert_eq!(
        len, had,
        "recovery wrote bytes of a write the lower refused ({had} bytes before the crash)"
    );
}
