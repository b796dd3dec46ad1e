//! `pmstack serve`: the daemon behind `pmstack run` for one lower directory.

use super::args::ServeArgs;
use super::host::{
    answer_metrics, check_lower, open_region, pmstack_mount_containing, raise_fd_limit,
};
use super::out::{say, warn_user};
use anyhow::{anyhow, bail, Context, Result};
use pmstack::lower::creds;
use pmstack::lower::write_atomic;
use pmstack::lower::RealLower;
use pmstack::pmem::Durability;
use pmstack::region::{default_pm, OpenOptions};
use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub(super) fn serve_cmd(a: ServeArgs) -> Result<()> {
    use pmstack::front::serve::{check_previous, Daemon, ServeOpts};
    // Signals first: a SIGTERM at any point from here on is a clean stop, not a kill.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [libc::SIGINT, libc::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    // A descriptor per open event being answered, per live attached process, per object
    // written back: as the mount, the hard limit (else a busy daemon runs out, and the
    // kernel fails its programs' opens with EPERM).
    raise_fd_limit();
    let root = check_lower(&a.dir)?;
    if let Some(m) = pmstack_mount_containing(&root) {
        bail!(
            "{} is inside the pmstack mount at {}: serve that mount's lower directory instead",
            root.display(),
            m.display()
        );
    }
    let (sock, table, stats) = pmstack::front::paths(&root);
    check_previous(&table)?;
    let user = match &a.user {
        Some(u) => Some(creds::user_named(u).map_err(|e| anyhow!("--user {u}: {e}"))?),
        None => None,
    };
    // Bound before anything else happens, so that a taken port fails cleanly.
    let metrics = match &a.metrics_addr {
        Some(addr) => Some(
            tiny_http::Server::http(addr.as_str())
                .map_err(|e| anyhow!("--metrics-addr {addr}: cannot listen ({e}); choose another port or leave metrics off"))?,
        ),
        None => None,
    };
    let pm = a.pm.clone().unwrap_or_else(|| default_pm(&root));
    let real = RealLower::open(&root)?;
    if !real.syncfs_reliable() {
        // syncfs does not reach this lower (a FUSE or network file system): write-back fsyncs
        // each object the log names instead, opening it by its handle, which needs
        // CAP_DAC_READ_SEARCH.
        let ino = pmstack::lower::real::fstat(real.root_fd())?.st_ino;
        let h = real.handle(real.root_fd(), ino)?;
        if let Err(e) = real.open_handle(&h) {
            bail!("{} is on a file system that does not honour syncfs (a FUSE or network file system); `pmstack serve` writes back there by opening each changed file by its handle, which failed ({e}): run it as root, or use `pmstack mount`", root.display());
        }
        tracing::info!(
            "{} does not honour syncfs: write-back fsyncs each changed object",
            root.display()
        );
    }
    let mut region = open_region(
        &pm,
        &root,
        &real,
        &OpenOptions {
            size: a.pm_size,
            areas: pmstack::engine::format::MAX_AREAS,
            take_over: a.take_over,
            acting_for: user.as_ref(),
        },
    )?;
    let log = region.log().clone();
    let sum = region.recovery.take();
    if log.pm().durability() != Durability::PowerFailSafe {
        warn_user(&format!(
            "PM region {} is emulated (not on a DAX device): it survives a crash of pmstack or of the programs, NOT a power loss",
            pm.display()
        ));
    }
    if let Some(s) = &sum {
        tracing::info!(
            file_ops = s.file_ops,
            bytes = s.bytes_replayed,
            ms = s.duration_ms,
            "recovered the previous log"
        );
    }
    let region_bytes = log.superblock().region_bytes;
    let d = Daemon::new(
        log,
        real,
        &table,
        ServeOpts {
            root: root.clone(),
            watch: !a.all_writers_attached,
            sock: sock.clone(),
            region: fs::canonicalize(&pm)?,
            flush_interval: Duration::from_millis(a.flush_interval_ms.max(1)),
            early_bytes: region_bytes / 4,
            slots: a.table_slots as usize,
            settle: !a.no_settle,
            unsynced_names: !a.log_unsynced_names,
            user: match user {
                Some(u) => u,
                None => creds::user_with_id(creds::euid())?,
            },
            recovery: serde_json::to_value(&sum).unwrap_or_default(),
        },
    )?;
    let watch_stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| -> Result<()> {
        // Answers opens of watched files until after the last write-back.
        sc.spawn(|| d.watch_opens(&watch_stop));
        sc.spawn(|| d.beat(&watch_stop));
        if let Some(server) = &metrics {
            sc.spawn(|| {
                while !watch_stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(Some(req)) = server.recv_timeout(Duration::from_millis(200)) {
                        answer_metrics(req, || d.metrics());
                    }
                }
            });
        }
        // The helper threads stop when this closure ends, also by a panic: the scope waits
        // for them, and a daemon that panicked must exit, not hang holding its region.
        let _stop_helpers = SetOnDrop(&watch_stop);
        serve_loop(&d, &root, &pm, &sock, &table, &stats, &stop)
    })
}

pub(super) fn serve_loop(
    d: &pmstack::front::serve::Daemon,
    root: &Path,
    pm: &Path,
    sock: &Path,
    table: &Path,
    stats: &Path,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<()> {
    d.listen(sock, table)?;
    say(&format!(
        "serving {} (region {}); run programs with `pmstack run --root {} -- CMD`",
        root.display(),
        pm.display(),
        root.display()
    ));
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    d.run(stop, stats);
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    let _ = fs::remove_file(sock);
    let clean = d.shutdown().context("final write-back")?;
    let _ = write_atomic(stats, &d.stats_json().to_string());
    if clean {
        // Nobody maps the table any more (processes still attached would keep it).
        let _ = fs::remove_file(table);
        say(&format!("stopped; {} is complete", root.display()));
    } else {
        say("stopped; processes are still attached (they now use the lower file system's fsync); the region is left for recovery at the next start");
    }
    Ok(())
}

/// Sets its flag when dropped (at the end of a scope, also when unwinding from a panic).
struct SetOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
