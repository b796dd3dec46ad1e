//! `pmstack serve`: the daemon behind `pmstack run`. It owns the PM region (recovery before it
//! serves, write-back, reclaiming what dead processes leased), creates the shared table, and
//! hands attaching processes the region and table through a Unix socket.
//!
//! Write-back needs no lock against the attached processes: every entry is appended after its
//! data reached the lower file's page cache (see `client`), so "take the LSN counter, syncfs,
//! checkpoint" expires only what syncfs made durable.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::client::Hello;
use super::table::*;
use crate::engine::Log;
use crate::lower::RealLower;

pub struct ServeOpts {
    pub root: PathBuf,
    pub region: PathBuf,
    pub flush_interval: Duration,
    /// Write back early once this many bytes were logged since the last write-back.
    pub early_bytes: u64,
}

#[derive(Default)]
pub struct ServeStats {
    pub writebacks: AtomicU64,
    pub writeback_errors: AtomicU64,
    pub writeback_us: AtomicU64,
    pub leases_reclaimed: AtomicU64,
    pub attaches: AtomicU64,
}

/// Refuse to start while an earlier daemon or processes attached to it are alive: they map
/// the region this start would recover and reset.
pub fn check_previous(table: &Path) -> Result<()> {
    let Ok(t) = Table::open(table) else {
        return Ok(());
    };
    let d = t.w(H_DAEMON_PID).load(Ordering::Relaxed);
    if t.w(H_RUNNING).load(Ordering::Relaxed) == 1 && d != my_pid() && alive(d) {
        bail!("this directory is already served by pmstack process {d} (stop it first)");
    }
    let live: Vec<String> = t.procs().iter().map(|(p, _)| p.to_string()).collect();
    if !live.is_empty() {
        bail!(
            "processes attached to the previous daemon are still running (pids {}); they fall back to the lower file system's fsync until they exit; stop them, then start `pmstack serve` again",
            live.join(", ")
        );
    }
    Ok(())
}

pub struct Daemon {
    pub log: Arc<Log>,
    pub lower: RealLower,
    pub table: Arc<Table>,
    pub opts: ServeOpts,
    pub stats: Arc<ServeStats>,
}

impl Daemon {
    pub fn new(
        log: Arc<Log>,
        lower: RealLower,
        table_path: &Path,
        opts: ServeOpts,
    ) -> Result<Daemon> {
        let table = Arc::new(
            Table::create(table_path, DEFAULT_SLOTS)
                .with_context(|| format!("creating {}", table_path.display()))?,
        );
        Ok(Daemon {
            log,
            lower,
            table,
            opts,
            stats: Default::default(),
        })
    }

    /// Serve attach requests on `sock` (a thread per attached process; its end of the
    /// connection closing is its detach).
    pub fn listen(&self, sock: &Path, table_path: &Path) -> Result<()> {
        if let Some(d) = sock.parent() {
            std::fs::create_dir_all(d)?;
        }
        let _ = std::fs::remove_file(sock);
        let l = UnixListener::bind(sock).with_context(|| format!("binding {}", sock.display()))?;
        let hello = serde_json::to_string(&Hello {
            root: self.opts.root.clone(),
            region: self.opts.region.clone(),
            table: table_path.to_owned(),
            epoch: self.table.epoch(),
        })?;
        let stats = self.stats.clone();
        std::thread::Builder::new()
            .name("pmstack-attach".into())
            .spawn(move || {
                for c in l.incoming().flatten() {
                    let hello = hello.clone();
                    let stats = stats.clone();
                    let _ = std::thread::Builder::new()
                        .name("pmstack-client".into())
                        .spawn(move || {
                            let mut r = BufReader::new(match c.try_clone() {
                                Ok(r) => r,
                                Err(_) => return,
                            });
                            let mut line = String::new();
                            if r.read_line(&mut line).is_err() || !line.starts_with("attach ") {
                                return;
                            }
                            let pid = line[7..].trim().to_string();
                            let mut w = &c;
                            if writeln!(w, "{hello}").is_err() {
                                return;
                            }
                            stats.attaches.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(pid, "process attached");
                            let mut sink = Vec::new();
                            let _ = std::io::Read::read_to_end(&mut r, &mut sink);
                            tracing::info!(pid, "process detached");
                        });
                }
            })?;
        Ok(())
    }

    /// Make everything logged so far durable in the lower file system and expire it.
    pub fn write_back(&self) -> Result<u64> {
        let t0 = Instant::now();
        // Bump the counter so every write noted before this point has a mark below `upto`.
        self.log.next_lsn();
        let upto = self.log.lsn_now();
        if let Err(e) = self.lower.syncfs() {
            self.stats.writeback_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("write-back to the lower file system failed ({e}); entries stay live in PM and write-back retries; check the lower file system (free space, I/O errors in dmesg)");
            return Err(e.into());
        }
        self.log.checkpoint(upto);
        self.stats.writebacks.fetch_add(1, Ordering::Relaxed);
        self.stats
            .writeback_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        Ok(upto)
    }

    fn logged_bytes(&self) -> u64 {
        (0..MAX_PROCS)
            .map(|i| {
                self.table
                    .proc_word(i, P_BYTES_LOGGED)
                    .load(Ordering::Relaxed)
            })
            .sum()
    }

    /// The daemon's loop until `stop`: heartbeat, periodic and early write-back, reclaiming
    /// the leases of processes that died once a write-back passed their last append.
    pub fn run(&self, stop: &AtomicBool, stats_path: &Path) {
        let mut last_wb = Instant::now();
        let mut logged_at_wb = self.logged_bytes();
        let mut dead: HashMap<u64, u64> = HashMap::new(); // pid -> LSN counter when seen dead
        let mut last_stats = Instant::now() - Duration::from_secs(10);
        let me = my_pid();
        while !stop.load(Ordering::Relaxed) {
            self.table.w(H_HEARTBEAT).store(now_ns(), Ordering::Relaxed);
            for (_, owner) in self.log.leases() {
                if owner != 0 && owner != me && !dead.contains_key(&owner) && !alive(owner) {
                    dead.insert(owner, self.log.lsn_now());
                }
            }
            let logged = self.logged_bytes();
            let wake = self.table.w(H_WAKE).swap(0, Ordering::Relaxed) != 0;
            if wake
                || last_wb.elapsed() >= self.opts.flush_interval
                || logged.saturating_sub(logged_at_wb) >= self.opts.early_bytes
                || !dead.is_empty() && last_wb.elapsed() >= Duration::from_millis(200)
            {
                if let Ok(upto) = self.write_back() {
                    logged_at_wb = logged;
                    dead.retain(|&pid, &mut seen| {
                        if seen < upto {
                            self.log.release_lease(pid);
                            self.stats.leases_reclaimed.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(
                                pid,
                                "reclaimed the PM area of a process that exited or died"
                            );
                            false
                        } else {
                            true
                        }
                    });
                }
                last_wb = Instant::now();
            }
            if last_stats.elapsed() >= Duration::from_millis(500) {
                let _ = crate::lower::write_atomic(stats_path, &self.stats_json().to_string());
                last_stats = Instant::now();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stop serving: attached processes fall back to the lower file system's fsync, the log
    /// is written back. Returns whether the region could be left clean (no process attached).
    pub fn shutdown(&self) -> Result<bool> {
        self.table.w(H_RUNNING).store(0, Ordering::Release);
        // Let in-flight operations (holding slot locks) finish before the last write-back.
        std::thread::sleep(Duration::from_millis(20));
        self.write_back()?;
        let me = my_pid();
        let attached = self
            .log
            .leases()
            .iter()
            .any(|&(_, o)| o != 0 && o != me && alive(o));
        if !attached {
            self.log.reset();
            self.log.set_clean(true);
        }
        Ok(!attached)
    }

    pub fn stats_json(&self) -> serde_json::Value {
        let s = &self.stats;
        let procs: Vec<serde_json::Value> = self
            .table
            .procs()
            .into_iter()
            .map(|(pid, c)| {
                serde_json::json!({
                    "pid": pid,
                    "absorbed_fsync": c[P_ABSORBED_FSYNC],
                    "absorbed_osync": c[P_ABSORBED_OSYNC],
                    "eager_writes": c[P_EAGER_WRITES],
                    "bytes_logged": c[P_BYTES_LOGGED],
                    "real_syncs": c[P_FALLBACKS],
                })
            })
            .collect();
        let claimed = self.log.leases().iter().filter(|&&(_, o)| o != 0).count();
        serde_json::json!({
            "pid": my_pid(),
            "root": self.opts.root,
            "pm": self.opts.region,
            "attached": procs,
            "attaches": s.attaches.load(Ordering::Relaxed),
            "writebacks": s.writebacks.load(Ordering::Relaxed),
            "writeback_errors": s.writeback_errors.load(Ordering::Relaxed),
            "writeback_us": s.writeback_us.load(Ordering::Relaxed),
            "leases_reclaimed": s.leases_reclaimed.load(Ordering::Relaxed),
            "areas_leased": claimed,
            "checkpoint_lsn": self.log.checkpoint_lsn(),
            "lsn": self.log.lsn_now(),
        })
    }
}
