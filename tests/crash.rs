//! Kill -9 tests against a real mount, with a power-loss model applied to the lower directory
//! before recovery (the test itself: `common/crash.rs`).

mod common;

use std::fs;

use common::crash::run_once;
use common::LoopFs;

#[test]
fn kill9_with_power_loss_on_the_lower() {
    if !common::can_mount() {
        return;
    }
    let base = tempfile::Builder::new()
        .prefix("pmstack-crash-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let lfs = LoopFs::new(base.path());
    let rounds: u64 = std::env::var("PMSTACK_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let seed0: u64 = rand::random();
    for r in 0..rounds {
        let lower = lfs.as_ref().map(|l| l.dir.join(format!("round{r}")));
        if let Some(l) = &lower {
            fs::create_dir_all(l).unwrap();
        }
        run_once(seed0.wrapping_add(r), lower.clone(), true);
        if let Some(l) = lower {
            fs::remove_dir_all(l).unwrap();
        }
    }
}

#[test]
fn kill9_while_write_back_and_gc_run() {
    if !common::can_mount() {
        return;
    }
    let rounds: u64 = std::env::var("PMSTACK_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let seed0: u64 = rand::random();
    for r in 0..rounds / 2 {
        run_once(seed0.wrapping_add(r), None, false);
    }
}
