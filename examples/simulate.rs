//! The long run of the deterministic crash simulator (`pmstack::sim`): many seeded histories
//! through the mount's core in each PM mode and through `pmstack run`'s client and daemon
//! (`--mode run`), each crashed at a fence (PM keeps flushed lines and any
//! subset of dirty words; the lower is rewound to a power-cut state), recovered (sometimes
//! with a recovery killed half-way first), and checked against the contract.
//!
//!     cargo run --release --example simulate -- --seeds 100000 --jobs 2
//!
//! Prints what it covered; a violation prints the one-line command that reproduces it and
//! the run exits non-zero.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use clap::Parser;
use pmstack::core::Mode;
use pmstack::sim::{run_history, run_history_preload, Coverage, Kinds};

#[derive(Parser)]
#[command(about = "Run the deterministic crash simulator and print its coverage")]
struct Args {
    /// Histories to run (one crash image each), spread over the modes.
    #[arg(long, default_value_t = 1000)]
    seeds: u64,
    /// First seed (default: random); seeds are consecutive from here.
    #[arg(long)]
    seed: Option<u64>,
    /// sync, strict, adaptive (the mount), run (`pmstack run`), or all (round robin).
    #[arg(long, default_value = "all")]
    mode: String,
    /// Operations per history.
    #[arg(long, default_value_t = 50)]
    ops: usize,
    /// Histories run at once (each is independent).
    #[arg(long, default_value_t = 1)]
    jobs: u64,
    /// Leave hard links out of the histories (the histories of seeds found before they were
    /// in them by default).
    #[arg(long, conflicts_with = "links")]
    no_links: bool,
    /// Hard links in the histories (the default; kept so older reproduce lines still run).
    #[arg(long, hide = true)]
    links: bool,
    /// Leave fallocate out of the histories (the histories of seeds found before it was in
    /// them)
    #[arg(long)]
    no_fallocate: bool,
    /// Leave directories out of the histories (the histories of seeds found before they were
    /// in them)
    #[arg(long)]
    no_dirs: bool,
    /// The lower under the histories: `local` (its syncfs makes everything durable),
    /// `syncfs-ignored` (as FUSE and network lowers: only what is synced object by object),
    /// or `both` (alternating).
    #[arg(long, default_value = "both")]
    lower: String,
    /// Run every operation of the mount's histories on one thread, and the `pmstack run`
    /// histories in one process (the histories of seeds found before each operation had a
    /// thread of its own, or a run history two processes)
    #[arg(long)]
    no_threads: bool,
    /// Keep every rmdir of the mount's histories (the histories of seeds found before a
    /// power cut could take one back)
    #[arg(long)]
    no_lost_rmdirs: bool,
    /// Leave the changes of programs that are not attached out of the `pmstack run`
    /// histories (the histories of seeds found before they had them)
    #[arg(long)]
    no_outside: bool,
    /// End every history in a power cut (the histories of seeds found before some ended in
    /// a kill of the processes)
    #[arg(long)]
    no_kills: bool,
    /// Leave RENAME_EXCHANGE out of the `pmstack run` histories (the histories of seeds found
    /// before they had it)
    #[arg(long)]
    no_exchanges: bool,
    /// Open every descriptor of the `pmstack run` histories for reading and writing (the
    /// histories of seeds found before some were write-only)
    #[arg(long)]
    no_write_only: bool,
    /// Open no descriptor of the `pmstack run` histories O_APPEND (the histories of seeds
    /// found before some were)
    #[arg(long)]
    no_appends: bool,
    /// Open no descriptor of the `pmstack run` histories O_DIRECT (the histories of seeds
    /// found before some were)
    #[arg(long)]
    no_direct: bool,
    /// Let no process of the `pmstack run` histories run its namespace operations as the
    /// lower's own (the histories of seeds found before one could)
    #[arg(long)]
    no_unsynced_names: bool,
    /// Have the program that is not attached sync every file it makes (the histories of
    /// seeds found before it made some it left unsynced)
    #[arg(long)]
    no_unsynced_outside: bool,
    /// Have the program that is not attached sync every rename it makes (the histories of
    /// seeds found before it left some unsynced)
    #[arg(long)]
    no_unsynced_renames: bool,
    /// Have the program that is not attached sync every removal it makes (the histories of
    /// seeds found before it left some unsynced)
    #[arg(long)]
    no_unsynced_removals: bool,
    /// Have a lower that ignores syncfs commit every name at any directory's sync, as a
    /// journal would (the histories of seeds found before it committed each directory's
    /// entries separately)
    #[arg(long)]
    no_per_dir_commits: bool,
    /// Print the coverage as JSON.
    #[arg(long)]
    json: bool,
}

fn main() {
    let a = Args::parse();
    // A mount mode, or None: the `pmstack run` front end.
    let modes: Vec<Option<Mode>> = match a.mode.as_str() {
        "sync" => vec![Some(Mode::Sync)],
        "strict" => vec![Some(Mode::Strict)],
        "adaptive" => vec![Some(Mode::Adaptive)],
        "run" => vec![None],
        "all" => vec![
            Some(Mode::Sync),
            Some(Mode::Strict),
            Some(Mode::Adaptive),
            None,
        ],
        m => {
            eprintln!("simulate: unknown mode '{m}' (sync, strict, adaptive, run, all)");
            std::process::exit(2);
        }
    };
    let seed0 = a.seed.unwrap_or_else(rand::random);
    let lowers: Vec<bool> = match a.lower.as_str() {
        "local" => vec![false],
        "syncfs-ignored" => vec![true],
        "both" => vec![false, true],
        l => {
            eprintln!("simulate: unknown lower '{l}' (local, syncfs-ignored, both)");
            std::process::exit(2);
        }
    };
    let kinds = Kinds {
        links: !a.no_links,
        fallocate: !a.no_fallocate,
        dirs: !a.no_dirs,
        syncfs_ignored: false,
        threads: !a.no_threads,
        lost_rmdirs: !a.no_lost_rmdirs,
        outside: !a.no_outside,
        kills: !a.no_kills,
        exchanges: !a.no_exchanges,
        write_only: !a.no_write_only,
        appends: !a.no_appends,
        direct: !a.no_direct,
        unsynced_outside: !a.no_unsynced_outside,
        unsynced_renames: !a.no_unsynced_renames,
        unsynced_removals: !a.no_unsynced_removals,
        per_dir_commits: !a.no_per_dir_commits,
        unsynced_names: !a.no_unsynced_names,
    };
    let next = AtomicU64::new(0);
    let total = Mutex::new(Coverage::default());
    let failures = Mutex::new(Vec::<String>::new());
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..a.jobs.max(1) {
            s.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= a.seeds {
                    break;
                }
                let mode = modes[(k % modes.len() as u64) as usize];
                let seed = seed0.wrapping_add(k);
                // Each mode over each lower in turn.
                let kinds = Kinds {
                    syncfs_ignored: lowers
                        [((k / modes.len() as u64) % lowers.len() as u64) as usize],
                    ..kinds
                };
                let r = match mode {
                    Some(m) => run_history(seed, a.ops, m, kinds),
                    None => run_history_preload(seed, a.ops, kinds),
                };
                match r {
                    Ok(c) => total.lock().unwrap().add(&c),
                    Err(e) => {
                        eprintln!("VIOLATION: {e}");
                        failures.lock().unwrap().push(e);
                    }
                }
                if (k + 1) % 1000 == 0 {
                    eprintln!(
                        "simulate: {} histories, {:.0} s",
                        k + 1,
                        t0.elapsed().as_secs_f64()
                    );
                }
            });
        }
    });
    let cov = total.into_inner().unwrap();
    let failures = failures.into_inner().unwrap();
    if a.json {
        println!(
            "{}",
            serde_json::json!({"seed0": seed0, "seconds": t0.elapsed().as_secs(), "violations": failures.len(), "coverage": cov})
        );
    } else {
        println!(
            "simulate: seeds {seed0}..{} ({} per front end of {:?}), {} ops each, {:.0} s",
            seed0.wrapping_add(a.seeds),
            a.seeds / modes.len() as u64,
            modes
                .iter()
                .map(|m| m.map_or("run".to_string(), |m| format!("mount {m:?}").to_lowercase()))
                .collect::<Vec<_>>(),
            a.ops,
            t0.elapsed().as_secs_f64()
        );
        println!(
            "  histories {}, operations {}, crash images recovered {} (from {} fences captured)",
            cov.histories, cov.ops, cov.crash_images, cov.fences_captured
        );
        println!(
            "  kills of the processes (every store and the lower's page cache kept) {}, crashes inside a write-back {}, power cuts that took back namespace operations {} ({} operations; rmdirs {}), recoveries killed and redone {}, replays run twice {}; crashes kept from taking back a directory's removal (a directory renamed over cannot come back with its inode) {}",
            cov.kills, cov.crashes_in_write_back, cov.namespace_rewinds, cov.namespace_ops_lost, cov.rmdirs_taken_back, cov.recoveries_interrupted, cov.double_replays, cov.dir_removals_kept
        );
        println!(
            "  operations: fsync {}, write-back {}, rename {}, exchange {}, unlink {}, link {}, truncate {}, fallocate {}, FORGET+lookup {}, mkdir {}, rmdir {}, rename of a directory {}, exchange of two directories {}; objects re-created by recovery {}",
            cov.fsyncs, cov.write_backs, cov.renames, cov.exchanges, cov.unlinks, cov.links, cov.truncates, cov.fallocates, cov.forgets, cov.mkdirs, cov.rmdirs, cov.dir_renames, cov.dir_exchanges, cov.recreated
        );
        println!(
            "  pmstack run: daemon taken for dead {}, operations run on the lower alone {}, syncs the lower made durable {}, names changed by programs not attached {} (files they made and synced nothing of {}, whose names a power cut took back {}; renamed so {}, back under the name before {}; removed so {}, back {}); histories with a small table (16 slots for 50 operations) {} (slots freed {})",
            cov.daemon_deaths, cov.unserved_ops, cov.real_syncs, cov.outside_changes, cov.outside_unsynced, cov.unsynced_names_lost, cov.outside_unsynced_renames, cov.unsynced_renames_lost, cov.outside_unsynced_removals, cov.unsynced_removals_back, cov.small_tables, cov.slots_freed
        );
        println!(
            "  over a lower that ignores syncfs: histories {}, objects write-backs synced one by one {}, namespace operations refused while the daemon was taken for dead {} (data operations {}), real syncs of new files that synced their path too {}; committing each directory's entries separately {} (power cuts that left names no one prefix of the operations had {}); crash images with live records in more than one append area {}",
            cov.syncfs_ignored, cov.objects_synced, cov.refused_unserved, cov.refused_unserved_data, cov.paths_synced, cov.per_dir_commits, cov.names_apart, cov.multi_area_logs
        );
        println!(
            "  pmstack run: first syncs that logged the file whole {}, syncs logged from copies of the dirty bytes kept at write time {}, fsyncs through a write-only descriptor {}, writes through an O_APPEND descriptor {}, through an O_DIRECT one {}; histories whose whole-file-system write-backs settled directories {} (directories taken for clean so {})",
            cov.baselines_logged, cov.syncs_from_copies, cov.write_only_syncs, cov.appends, cov.direct_writes, cov.settling, cov.dirs_settled
        );
        println!(
            "  pmstack run: histories whose processes that synced nothing ran their namespace operations as the lower's own {} (operations {}; logged operations of such a process after some of them {})",
            cov.unsynced_ns_histories, cov.unsynced_ns_ops, cov.unsynced_ns_then_logged
        );
        println!("  contract violations: {}", failures.len());
    }
    if !failures.is_empty() {
        std::process::exit(1);
    }
}
