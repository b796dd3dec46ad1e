//! The file system exerciser (fsx-rs: `cargo install --locked fsx`): a seeded random sequence
//! of reads, writes, mmap reads and writes, truncates, fallocate, hole punching, sendfile,
//! copy_file_range, fadvise, fsync and close/reopen on one file, every read checked against
//! the exerciser's own model. Run on the plain lower (to prove the configuration is supported
//! there), through the mount in every mode, and under `pmstack run`. Also: O_DIRECT I/O
//! through the mount, which used to fail with EINVAL.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

const CONFIG: &str = "flen = 1048576
[opsize]
max = 131072
[weights]
close_open = 1
read = 10
write = 10
mapread = 5
mapwrite = 5
invalidate = 1
truncate = 2
fsync = 2
fdatasync = 2
posix_fallocate = 1
punch_hole = 1
sendfile = 1
posix_fadvise = 1
copy_file_range = 1
";

/// Run `ops` operations of seed `seed` on `file` (optionally under `pmstack run --root`).
fn exercise(bin: &Path, cfg: &Path, file: &Path, seed: u64, ops: u64, run_root: Option<&Path>) {
    let artifacts = file.parent().unwrap().join(format!(
        "fsx-artifacts-{}",
        file.file_name().unwrap().to_string_lossy()
    ));
    let _ = fs::create_dir_all(&artifacts);
    let out = common::maybe_run(bin, run_root)
        .arg("-f")
        .arg(cfg)
        .arg("-N")
        .arg(ops.to_string())
        .arg("-S")
        .arg(seed.to_string())
        .arg("-P")
        .arg(&artifacts)
        .arg(file)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("A-OK"),
        "fsx seed {seed} on {} ({}):\n{}",
        file.display(),
        out.status,
        text.lines().rev().take(30).collect::<Vec<_>>().join("\n")
    );
    let _ = fs::remove_dir_all(&artifacts);
}

#[test]
fn fsx_runs_clean_through_the_mount_in_every_mode_and_under_pmstack_run() {
    if !common::can_mount() {
        return;
    }
    let Some(bin) = common::cargo_tool("fsx") else {
        return;
    };
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let cfg = d.path().join("fsx.toml");
    fs::write(&cfg, CONFIG).unwrap();
    let seed: u64 = rand::random::<u32>() as u64;
    let ops = 20_000;
    exercise(&bin, &cfg, &d.path().join("plain.f"), seed, ops, None);
    for mode in ["sync", "strict", "adaptive", "passthrough"] {
        let mut m = common::Mount::new(None);
        m.mount(&["--mode", mode]);
        exercise(&bin, &cfg, &m.mnt.join("f"), seed, ops, None);
        m.umount();
    }
    // pmstack run
    let root = fs::canonicalize(d.path()).unwrap().join("served");
    fs::create_dir(&root).unwrap();
    let serve = common::Served::start(&root, &d.path().join("served.pm"), &[]);
    exercise(&bin, &cfg, &root.join("f"), seed, ops, Some(&root));
    serve.stop();
}

/// O_DIRECT reads and writes (aligned, as O_DIRECT requires) work through the mount in every
/// mode, plain and with O_DSYNC, and read back what was written.
#[test]
fn o_direct_io_works_through_the_mount() {
    if !common::can_mount() {
        return;
    }
    let layout = std::alloc::Layout::from_size_align(65536, 4096).unwrap();
    // SAFETY: a non-zero-sized layout; freed below.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!ptr.is_null());
    // SAFETY: `ptr` points to 65536 bytes we own.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, 65536) };
    for mode in ["sync", "strict", "passthrough"] {
        let mut m = common::Mount::new(None);
        m.mount(&["--mode", mode]);
        for (k, dsync) in [(0u8, false), (1, true)] {
            for (i, b) in buf.iter_mut().enumerate() {
                *b = (i as u8).wrapping_mul(7).wrapping_add(k + 1);
            }
            let want = buf.to_vec();
            let p = m.mnt.join(format!("direct{k}"));
            let flags = libc::O_DIRECT | if dsync { libc::O_DSYNC } else { 0 };
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(flags)
                .open(&p)
                .unwrap();
            f.write_all(buf)
                .unwrap_or_else(|e| panic!("{mode}: O_DIRECT write: {e}"));
            drop(f);
            buf.fill(0);
            let mut g = fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(&p)
                .unwrap();
            g.read_exact(buf)
                .unwrap_or_else(|e| panic!("{mode}: O_DIRECT read: {e}"));
            assert_eq!(&buf[..], &want[..], "{mode}: read back differs");
        }
        m.umount();
    }
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(ptr, layout) };
}
