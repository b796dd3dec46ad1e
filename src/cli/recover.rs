//! `pmstack recover`: replays a region's log onto its lower directory without mounting.

use super::host::{check_lower, open_region};
use anyhow::{bail, Result};
use pmstack::lower::creds;
use pmstack::lower::RealLower;
use pmstack::region::OpenOptions;
use std::fs;
use std::path::Path;

pub(super) fn recover_cmd(pm: &Path, lower: &Path) -> Result<()> {
    let lower = check_lower(lower)?;
    if !pm.exists() {
        bail!("PM region {} does not exist", pm.display());
    }
    let real = RealLower::open(&lower)?;
    // `recover` acts for whoever owns the region: its log is replayed with their rights.
    let owner = {
        use std::os::unix::fs::MetadataExt;
        creds::user_with_id(fs::metadata(pm)?.uid())?
    };
    let mut region = open_region(
        pm,
        &lower,
        &real,
        &OpenOptions {
            size: 0,
            areas: 16,
            take_over: false,
            acting_for: Some(&owner),
        },
    )?;
    let log = region.log().clone();
    let sum = region.recovery.take();
    log.set_clean(true);
    match sum {
        Some(s) => println!(
            "recovered {} namespace ops ({} already applied, {} objects re-created), {} file ops, {} bytes in {} ms; {} file(s) deleted after their records (nothing to replay into), {} object(s) without a binding",
            s.namespace_ops,
            s.namespace_skipped,
            s.recreated,
            s.file_ops,
            s.bytes_replayed,
            s.duration_ms,
            s.unresolved_files,
            s.unbound_fids.len()
        ),
        None => println!("nothing to recover: the region was clean"),
    }
    Ok(())
}
