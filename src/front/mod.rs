//! The zero-round-trip front end: programs run under `pmstack run` with a preload library
//! and work directly on the lower directory; `pmstack serve` owns the PM region.
//!
//! - [`table`]: the table shared by the daemon and every attached process.
//! - [`client`]: what the library does for a write, a sync, a truncate.
//! - [`ns`]: namespace operations and directory fsync of attached processes.
//! - [`open`]: which descriptors the library tracks, which flags the kernel sees, which
//!   paths lie under the served directory (the decisions the preload library makes).
//! - [`serve`]: the daemon: recovery, the attach socket, write-back, reclaiming the areas of
//!   processes that died.
//! - [`settle`]: directories whose every change a whole-file-system write-back made durable.
//! - [`sys`]: raw system calls that never come back into the library.

pub mod client;
pub mod ns;
pub mod open;
pub mod serve;
pub mod settle;
pub mod sys;
pub mod table;
pub mod watch;

use std::path::{Path, PathBuf};

/// Where the daemon serving `root` listens and keeps its table (one per lower directory).
pub fn paths(root: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let id = crate::lower::id_of(root);
    (
        PathBuf::from(format!("/run/pmstack/serve-{id}.sock")),
        PathBuf::from(format!("/dev/shm/pmstack-serve-{id}.table")),
        PathBuf::from(format!("/run/pmstack/serve-{id}.json")),
    )
}

/// Whether `dir`'s change time tells every change of it apart: after a read of it, each
/// change gives a new one. `pmstack run` tells its own directory changes from others' (a
/// process outside it, a call the library does not see) by the change time recorded after
/// its last logged one (`ns`); a change in the same clock tick would leave that time as it
/// was and go unseen. Linux's multigrain timestamps (6.13 on, on ext4, XFS and Btrfs) make
/// every change after a read fine-grained; older kernels, and file systems without them
/// (tmpfs on this one), keep coarse times of a few milliseconds.
///
/// Measured, not looked up: eight rounds of a read of the time, a creation of a probe name
/// in `dir`, a read, its removal and a read; coarse if any change left the time unchanged.
/// The probe name goes whatever happens.
pub fn ctime_fine(dir: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let ct = |p: &Path| std::fs::metadata(p).map(|m| (m.ctime(), m.ctime_nsec()));
    let probe = dir.join(format!(".pmstack-ctime-probe-{}", std::process::id()));
    let r = (|| {
        for _ in 0..8 {
            let c0 = ct(dir)?;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&probe)?;
            let c1 = ct(dir)?;
            std::fs::remove_file(&probe)?;
            let c2 = ct(dir)?;
            if c1 == c0 || c2 == c1 {
                return Ok(false);
            }
        }
        Ok(true)
    })();
    let _ = std::fs::remove_file(&probe);
    r
}

#[cfg(test)]
mod tests {
    /// ext4 and XFS on this kernel (6.13 or later) keep fine change times; tmpfs does not.
    /// Both answers are checked where the machine has them (`/var/tmp` on ext4, `/dev/shm`).
    #[test]
    fn ctime_probe_tells_fine_from_coarse_change_times() {
        let fine = tempfile::tempdir_in("/var/tmp").unwrap();
        let coarse = tempfile::tempdir_in("/dev/shm").unwrap();
        let kernel = rustix::system::uname();
        let release = kernel.release().to_string_lossy().into_owned();
        let mut v = release
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|x| x.parse::<u32>().ok());
        let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
        #[allow(clippy::unnecessary_cast)] // f_type is not i64 on every target
        let ext4_xfs_btrfs = rustix::fs::statfs(fine.path())
            .is_ok_and(|st| [0xEF53, 0x5846_5342, 0x9123_683E].contains(&(st.f_type as i64)));
        if (major, minor) >= (6, 13) && ext4_xfs_btrfs {
            assert!(
                super::ctime_fine(fine.path()).unwrap(),
                "ext4 /var/tmp on {release} has coarse change times"
            );
        }
        // tmpfs has no multigrain timestamps (checked on 6.18): a change in the same tick as
        // the last read keeps the time.
        assert!(
            !super::ctime_fine(coarse.path()).unwrap(),
            "tmpfs in /dev/shm on {release} has fine change times"
        );
        // Nothing left behind.
        assert_eq!(std::fs::read_dir(fine.path()).unwrap().count(), 0);
        assert_eq!(std::fs::read_dir(coarse.path()).unwrap().count(), 0);
    }
}
