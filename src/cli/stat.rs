//! `pmstack stat`: the counters of a running mount or served directory.

use super::host::state_path;
use super::out::human_stats;
use anyhow::{anyhow, bail, Result};
use std::fs;
use std::path::Path;

pub(super) fn stat(mp: &Path, json: bool) -> Result<()> {
    let mp = fs::canonicalize(mp)?;
    let s = fs::read_to_string(state_path(&mp).with_extension("stats"))
        .or_else(|_| fs::read_to_string(pmstack::front::paths(&mp).2))
        .map_err(|_| {
            anyhow!(
                "{} is neither a pmstack mount nor a served directory (no stats found)",
                mp.display()
            )
        })?;
    let v: serde_json::Value = serde_json::from_str(&s)?;
    // The numbers are only current while their daemon runs: a mount's state file, or the
    // served directory's stats, name its pid.
    let pid = fs::read_to_string(state_path(&mp))
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|s| s["pid"].as_u64())
        .or_else(|| v["pid"].as_u64());
    if let Some(pid) = pid {
        let alive = fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
            c.split(|b| *b == 0)
                .next()
                .is_some_and(|a| a.ends_with(b"pmstack"))
        });
        if !alive {
            bail!(
                "the pmstack daemon of {} (pid {pid}) is gone; its last numbers are stale. Start it again (`pmstack mount` or `pmstack serve`): a crashed daemon's log is recovered at the next start",
                mp.display()
            );
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", human_stats(&v, 0));
    }
    Ok(())
}
