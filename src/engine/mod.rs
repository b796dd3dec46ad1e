//! The PM log engine: format, records, append/commit, expiry, GC and the recovery scan.
//! It knows nothing about FUSE or paths: files are fids, names are bytes.

pub mod format;
pub mod log;
pub mod record;
pub mod scan;

#[cfg(test)]
mod crash_tests;

pub use log::{AreaGuard, Log, LogError};
pub use record::{AttrOp, NodeKind, NsOp, Record, NAMESPACE_FID, ROOT_FID};
pub use scan::{scan, FileOp, ReplayPlan, Scan};
