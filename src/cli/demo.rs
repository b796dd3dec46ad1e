//! `pmstack demo`: a sync-heavy workload on a temporary lower alone and through a mount.

use super::host::{self_exe, tempfile_dir};
use anyhow::{bail, Result};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// One run of the sync-heavy workload in `dir`: `ops` times (4 KiB write at a random offset
/// of a 4 MiB file + fdatasync), then creates with file+dir fsync. Returns ops per second.
pub(super) fn workload(dir: &Path, ops: usize, seed: u64) -> Result<f64> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(dir.join("data.bin"))?;
    f.set_len(4 << 20)?;
    let buf = vec![seed as u8; 4096];
    let t0 = Instant::now();
    use std::os::unix::fs::FileExt;
    for _ in 0..ops {
        let off = rng.gen_range(0..1024u64) * 4096;
        f.write_all_at(&buf, off)?;
        f.sync_data()?;
    }
    let d = fs::File::open(dir)?;
    for k in 0..ops / 8 {
        let p = dir.join(format!("m{seed}-{k}"));
        let mut g = fs::File::create(&p)?;
        g.write_all(b"mail")?;
        g.sync_all()?;
        d.sync_all()?;
        fs::remove_file(&p)?;
    }
    Ok((ops + ops / 8) as f64 / t0.elapsed().as_secs_f64())
}

pub(super) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

pub(super) fn demo(dir: &Path, ops: usize, reps: usize) -> Result<()> {
    let base = tempfile_dir(dir)?;
    let lower = base.join("lower");
    let mnt = base.join("mnt");
    let plain = base.join("plain");
    for d in [&lower, &mnt, &plain] {
        fs::create_dir_all(d)?;
    }
    let pm = base.join("region.pm");
    let pm = if Path::new("/dev/shm").is_dir() {
        PathBuf::from(format!("/dev/shm/pmstack-demo-{}.pm", std::process::id()))
    } else {
        pm
    };
    println!(
        "pmstack demo: lower {} (on {}), PM {} (emulated)",
        lower.display(),
        dir.display(),
        pm.display()
    );
    let st = std::process::Command::new(self_exe())
        .args(["mount", "--pm"])
        .arg(&pm)
        .arg(&lower)
        .arg(&mnt)
        .status()?;
    if !st.success() {
        let _ = fs::remove_dir_all(&base);
        bail!("mount failed");
    }
    let res = (|| -> Result<(f64, f64)> {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for r in 0..reps {
            // Interleaved: lower alone, then through pmstack, same workload and seed.
            a.push(workload(&plain, ops, r as u64)?);
            b.push(workload(&mnt, ops, r as u64)?);
            println!(
                "  round {}: lower alone {:.0} ops/s, through pmstack {:.0} ops/s",
                r + 1,
                a[r],
                b[r]
            );
        }
        Ok((median(&mut a), median(&mut b)))
    })();
    let expect = fs::read(mnt.join("data.bin")).ok();
    let st = std::process::Command::new(self_exe())
        .arg("umount")
        .arg(&mnt)
        .status()?;
    let (a, b) = res?;
    if !st.success() {
        bail!("umount failed");
    }
    let got = fs::read(lower.join("data.bin"))?;
    let ok = expect.as_deref() == Some(got.as_slice());
    let _ = fs::remove_file(&pm);
    let _ = fs::remove_dir_all(&base);
    println!("sync-heavy workload (4 KiB write + fdatasync, create + fsync(file) + fsync(dir)); median of {reps}:");
    println!("  lower alone:      {a:>10.0} ops/s");
    println!("  through pmstack:  {b:>10.0} ops/s");
    println!("  ratio pmstack / lower: {:.2}x", b / a);
    println!(
        "  after unmount, lower holds exactly what was written: {}",
        if ok { "yes" } else { "NO" }
    );
    if !ok {
        bail!("lower content differs from what was written through the mount");
    }
    Ok(())
}
