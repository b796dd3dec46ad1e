//! A tree of 200,000 files copied onto the mount (what rsync or cp -a of a source tree does)
//! and read back through it, with the daemon's descriptor count bounded: inode descriptors
//! are a cache that is reopened by file handle (`core::node`), so a mount serves trees far
//! larger than its descriptor limit. It used to keep one descriptor per inode the kernel
//! remembered and failed with "Too many open files".

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const DIRS: usize = 200;
const FILES: usize = 1000;

fn content(d: usize, f: usize) -> Vec<u8> {
    format!("{d}/{f}\n").repeat((d * 7 + f) % 40).into_bytes()
}

fn fd_count(pid: i32) -> usize {
    fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |r| r.count())
}

#[test]
fn a_tree_of_200000_files_copies_with_bounded_descriptors() {
    if !common::can_mount() {
        return;
    }
    let mut m = common::Mount::new(None);
    let src = m.base.path().join("src");
    for d in 0..DIRS {
        let dir = src.join(format!("d{d:03}"));
        fs::create_dir_all(&dir).unwrap();
        for f in 0..FILES {
            fs::write(dir.join(format!("f{f:04}")), content(d, f)).unwrap();
        }
    }
    m.mount(&[]);
    let pid = m.daemon_pid();
    // A file unlinked while a program holds it open lives on only through the daemon's
    // descriptors of it (the mount declines OPEN, so no handle holds one): eviction must
    // spare them, or the file is gone under the program.
    let held = m.mnt.join("held");
    let hf = fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&held)
        .unwrap();
    hf.write_all_at(b"kept while open", 0).unwrap();
    hf.sync_all().unwrap();
    fs::remove_file(&held).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(fd_count(pid), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let st = Command::new("cp")
        .arg("-a")
        .arg(&src)
        .arg(m.mnt.join("dst"))
        .status()
        .unwrap();
    assert!(st.success(), "cp -a onto the mount failed");
    // Read everything back through the mount (evicted inodes are reopened by handle).
    let mut n = 0;
    for d in 0..DIRS {
        for f in 0..FILES {
            let p = m.mnt.join(format!("dst/d{d:03}/f{f:04}"));
            assert_eq!(
                fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
                content(d, f)
            );
            n += 1;
        }
    }
    // The kernel's cached pages of the held file go, so it is read from the daemon again.
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    let mut buf = [0u8; 15];
    hf.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(
        &buf, b"kept while open",
        "the unlinked open file after evictions"
    );
    hf.write_all_at(b"KEPT", 0).unwrap();
    hf.sync_all().unwrap();
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    hf.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(&buf, b"KEPT while open");
    drop(hf);
    peak.fetch_max(fd_count(pid), Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let out = Command::new(common::bin())
        .args(["stat", "--json"])
        .arg(&m.mnt)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bound = v["node_fds_max"].as_u64().unwrap() as usize;
    let peak = peak.load(Ordering::Relaxed);
    eprintln!(
        "{n} files copied and read back; daemon descriptors: peak {peak}, inode cache bound {bound}, evicted {}",
        v["node_fds_evicted"]
    );
    assert_eq!(n, DIRS * FILES);
    assert!(
        bound < DIRS * FILES && v["node_fds_evicted"].as_u64().unwrap_or(0) > 0,
        "the test must make the inode cache evict: bound {bound}"
    );
    // The cache bound plus what is not inode descriptors (FUSE device, region, open files).
    assert!(
        peak <= bound + 512,
        "the daemon held {peak} descriptors (inode cache bound {bound})"
    );
    m.umount();
    assert_eq!(
        fs::read(m.lower.join("dst/d123/f0456")).unwrap(),
        content(123, 456)
    );
    let _ = fs::remove_dir_all(&src);
    let _ = fs::remove_dir_all(m.lower.join("dst"));
}
