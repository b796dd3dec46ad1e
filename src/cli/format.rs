//! `pmstack format`: a new region for a lower directory.

use super::host::check_lower;
use anyhow::Result;
use std::path::Path;

pub(super) fn format_cmd(pm: &Path, size: u64, lower: &Path, force: bool) -> Result<()> {
    let lower = check_lower(lower)?;
    pmstack::region::format(pm, size, &lower, 16, force)?;
    println!(
        "formatted {} ({} MiB) for lower {}",
        pm.display(),
        size >> 20,
        lower.display()
    );
    Ok(())
}
