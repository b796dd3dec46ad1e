//! `pmstack check`: what a region holds, and whether it is sound.

use anyhow::{anyhow, bail, Result};
use pmstack::engine::scan;
use pmstack::pmem::mapped::MappedRegion;
use pmstack::pmem::{Durability, Pmem};
use std::path::Path;

pub(super) fn check(pm: &Path, json: bool, entries: bool) -> Result<()> {
    let r = MappedRegion::open(pm, 0)?;
    let s = scan(&r).map_err(|e| anyhow!("PM region {}: {e}", pm.display()))?;
    let plan = s.plan(&r);
    let live: Vec<_> = s.live_entries().collect();
    let mut per_file: std::collections::BTreeMap<u64, usize> = Default::default();
    for e in &live {
        *per_file.entry(e.rec.fid()).or_default() += 1;
    }
    let used = s.used_pages().len();
    let mut problems: Vec<String> = s.problems.iter().map(ToString::to_string).collect();
    if let Err(p) = &plan {
        if !s.problems.contains(p) {
            problems.push(p.to_string());
        }
    }
    let out = serde_json::json!({
        "version": s.sb.version,
        "region_bytes": s.sb.region_bytes,
        "uuid": uuid::Uuid::from_bytes(s.sb.uuid).to_string(),
        "lower_id": uuid::Uuid::from_bytes(s.sb.lower_id).to_string(),
        "pm_kind": r.kind().name(),
        "flush": r.flush_name(),
        "clean": s.clean,
        "checkpoint_lsn": s.checkpoint,
        "max_lsn": s.max_lsn,
        "live_entries": live.len(),
        "live_bytes": plan.as_ref().map(|p| p.live_bytes()).unwrap_or(0),
        "pages_used": used,
        "per_file_entries": per_file,
        // Live records that name no lower object: recovery reports and saves them.
        "unbound_fids": plan.as_ref().map(|p| p.unbound.clone()).unwrap_or_default(),
        "problems": problems,
    });
    if json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "region {}: version {}, {} MiB, {}",
            pm.display(),
            s.sb.version,
            s.sb.region_bytes >> 20,
            if s.clean {
                "clean"
            } else {
                "NOT clean (recovery needed)"
            }
        );
        println!(
            "  PM: {} ({}), flush: {}",
            r.kind().name(),
            match r.durability() {
                Durability::PowerFailSafe => "survives power loss",
                _ => "survives a crash of pmstack, NOT a power loss",
            },
            out["flush"].as_str().unwrap_or("?")
        );
        println!(
            "  live entries: {}, live bytes: {}, pages in use: {}",
            live.len(),
            out["live_bytes"],
            used
        );
        for p in &problems {
            println!("  problem: {p}");
        }
        if let Ok(p) = &plan {
            if !p.unbound.is_empty() {
                println!(
                    "  warning: live records of {} object(s) name no lower object (file ids {:?}); recovery applies everything else and saves these",
                    p.unbound.len(),
                    p.unbound
                );
            }
        }
        if entries {
            for e in &live {
                let mut r = format!("{:?}", e.rec);
                r.truncate(160);
                println!(
                    "  lsn {:>8} area {:>2} page {:>6} +{:<4} {r}",
                    e.lsn, e.area, e.page, e.off
                );
            }
        }
    }
    if !problems.is_empty() {
        bail!("{} problem(s) found in {}", problems.len(), pm.display());
    }
    Ok(())
}
