//! The kill -9 test against a real mount (run by `tests/crash.rs` and `tests/distributed.rs`), with a power-loss model applied to the lower directory
//! before recovery.
//!
//! The daemon runs with write-back disabled (a one-hour flush interval), so the lower file
//! system is never asked to make anything durable after the mount: any mix of the lower's
//! state at mount time and its current state is a state a power cut could have left. After the
//! kill, the test rewinds the lower to such a mix (per page: current or old content; per new
//! file: kept or its creation lost; sizes rewound), remounts (recovery replays the PM log),
//! and checks the contract: every acknowledged byte and rename present, nothing torn, no
//! garbage. The kernel drops its inode and dentry caches every 30 ms during the load.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{power_cut, snapshot};
use rand::{Rng, SeedableRng};

const REC: u64 = 8192;

fn pattern(t: usize, i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| ((t as u64 * 131 + i * 31 + k as u64 * 7) % 251) as u8 + 1)
        .collect()
}

fn rec_len(t: usize, i: u64) -> usize {
    1 + ((t as u64 * 7919 + i * 104729) % 6000) as usize
}

/// `rewind`: apply the power-loss model to the lower (write-back disabled during the run);
/// otherwise a process crash only, with write-back every 20 ms racing the workload (and a
/// small region, so watermark-triggered write-back and GC run too).
pub fn run_once(seed: u64, lower: Option<PathBuf>, rewind: bool) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut m = super::Mount::new(lower);
    // Pre-existing files, durable before the mount.
    for k in 0..3 {
        fs::write(m.lower.join(format!("pre-{k}")), vec![b'p'; 20000]).unwrap();
    }
    for e in fs::read_dir(&m.lower).unwrap().flatten() {
        let n = e.file_name();
        let n = n.to_string_lossy();
        if n.starts_with("w") || n.starts_with("r") || n.starts_with("n") {
            fs::remove_file(e.path()).unwrap();
        }
    }
    Command::new("sync").status().unwrap();
    if rewind {
        m.mount(&[
            "--flush-interval-ms",
            "3600000",
            "--pm-size",
            "512M",
            "--threads",
            "2",
        ]);
    } else {
        m.mount(&[
            "--flush-interval-ms",
            "20",
            "--pm-size",
            "2M",
            "--threads",
            "2",
        ]);
    }
    let old = snapshot(&m.lower);

    let stop = Arc::new(AtomicBool::new(false));
    let threads = 3usize;
    let acked: Arc<Vec<AtomicI64>> =
        Arc::new((0..threads + 2).map(|_| AtomicI64::new(-1)).collect());
    let mut hs = Vec::new();
    for t in 0..threads {
        let (stop, acked, mnt) = (stop.clone(), acked.clone(), m.mnt.clone());
        hs.push(std::thread::spawn(move || {
            let mut oo = fs::OpenOptions::new();
            oo.read(true).write(true).create(true);
            if t == 2 {
                oo.custom_flags(libc::O_SYNC);
            }
            let Ok(f) = oo.open(mnt.join(format!("w{t}"))) else {
                return;
            };
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let d = pattern(t, i, rec_len(t, i));
                if f.write_all_at(&d, i * REC).is_err() {
                    return;
                }
                if t == 2 || i % 2 == 1 {
                    if t != 2 && f.sync_data().is_err() {
                        return;
                    }
                    acked[t].store(i as i64, Ordering::SeqCst);
                }
                if t == 0 && i % 4 == 0 {
                    // create, fsync, rename, fsync(dir): a mail-server delivery
                    let n = mnt.join(format!("n{i}"));
                    let r = mnt.join(format!("r{i}"));
                    let ok = fs::write(&n, pattern(9, i, 300)).is_ok()
                        && fs::File::open(&n).and_then(|g| g.sync_all()).is_ok()
                        && fs::rename(&n, &r).is_ok()
                        && fs::File::open(&mnt).and_then(|g| g.sync_all()).is_ok();
                    if !ok {
                        return;
                    }
                    acked[threads].store(i as i64, Ordering::SeqCst);
                }
                if t == 1 && i % 3 == 0 {
                    // overwrite a pre-existing file in place, fsync
                    let k = (i / 3) % 3;
                    let Ok(g) = fs::OpenOptions::new()
                        .write(true)
                        .open(mnt.join(format!("pre-{k}")))
                    else {
                        return;
                    };
                    let ok = g.write_all_at(&pattern(7, i, 5000), (i % 4) * 3000).is_ok()
                        && g.sync_data().is_ok();
                    if !ok {
                        return;
                    }
                    acked[threads + 1].store(i as i64, Ordering::SeqCst);
                }
                i += 1;
            }
        }));
    }
    // The kernel evicts inodes and dentries while the load runs (FUSE FORGET of closed files,
    // looked up again by the next open): object identity must not depend on it.
    {
        let stop = stop.clone();
        hs.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
                std::thread::sleep(Duration::from_millis(30));
            }
        }));
    }
    std::thread::sleep(Duration::from_millis(rng.gen_range(150..900)));
    m.kill9();
    stop.store(true, Ordering::SeqCst);
    for h in hs {
        h.join().unwrap();
    }
    let acked: Vec<i64> = acked.iter().map(|a| a.load(Ordering::SeqCst)).collect();
    if rewind {
        power_cut(&m.lower, &old, &mut rng);
    }
    m.mount(&[]);

    // Every acknowledged record is present; nothing else is garbage.
    for (t, &acked_t) in acked.iter().enumerate().take(threads) {
        let data = fs::read(m.mnt.join(format!("w{t}"))).unwrap_or_default();
        let mut i = 0u64;
        while (i * REC) < data.len() as u64 || (i as i64) <= acked_t {
            let want = pattern(t, i, rec_len(t, i));
            let s = (i * REC) as usize;
            let got = data.get(s..(s + want.len()).min(data.len())).unwrap_or(&[]);
            if (i as i64) <= acked_t {
                assert_eq!(got, &want[..], "seed {seed}: thread {t} record {i} was acknowledged (acked up to {}) but is not intact", acked_t);
            } else {
                for (k, b) in got.iter().enumerate() {
                    assert!(
                        *b == 0 || *b == want[k],
                        "seed {seed}: thread {t} record {i} byte {k} is garbage ({b})"
                    );
                }
            }
            i += 1;
        }
    }
    for i in (0..=acked[threads]).step_by(4).filter(|i| *i >= 0) {
        let got = fs::read(m.mnt.join(format!("r{i}")));
        assert_eq!(
            got.ok(),
            Some(pattern(9, i as u64, 300)),
            "seed {seed}: acknowledged rename r{i} missing or torn"
        );
    }
    if acked[threads + 1] >= 0 {
        // The last acknowledged overwrite of each pre-file is present.
        let mut last: BTreeMap<u64, u64> = BTreeMap::new();
        let mut i = 0;
        while i as i64 <= acked[threads + 1] {
            if i % 3 == 0 {
                last.insert((i / 3) % 3, i);
            }
            i += 1;
        }
        for (k, i) in last {
            let data = fs::read(m.mnt.join(format!("pre-{k}"))).unwrap();
            let off = ((i % 4) * 3000) as usize;
            let want = pattern(7, i, 5000);
            // A later (unacknowledged or acknowledged) overwrite may cover it; check the bytes
            // only where no later overwrite of the same file could have landed.
            let later = (i + 3..=acked[threads + 1] as u64 + 3)
                .step_by(3)
                .any(|j| (j / 3) % 3 == k);
            if !later {
                assert_eq!(
                    &data[off..off + 5000],
                    &want[..],
                    "seed {seed}: acknowledged overwrite of pre-{k} (i={i}) lost"
                );
            }
        }
    }
    let through = super::tree(&m.mnt);
    m.umount();
    let chk = m.check_json();
    assert_eq!(chk["live_entries"], 0, "{chk}");
    let mut lower = super::tree(&m.lower);
    lower.remove("lost+found");
    let mut through = through;
    through.remove("lost+found");
    assert_eq!(
        lower, through,
        "seed {seed}: lower after clean unmount differs from what the mount showed"
    );
}
