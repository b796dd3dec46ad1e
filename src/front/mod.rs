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
//! - [`sys`]: raw system calls that never come back into the library.

pub mod client;
pub mod ns;
pub mod open;
pub mod serve;
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
