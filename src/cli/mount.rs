//! `pmstack mount`: checks, opening the region (recovering it), the FUSE session and its
//! daemon threads (write-back, stats, metrics), and the clean unmount.

use super::args::Mount;
use super::host::{
    answer_metrics, check_lower, dead_connection, fs_type_containing, is_dead_pmstack_mount,
    is_mountpoint, open_region, pmstack_mount_containing, raise_fd_limit, state_path,
};
use super::out::warn_user;
use anyhow::{anyhow, bail, Context, Result};
use pmstack::config::{CacheMode, Settings};
use pmstack::core::recover::RecoverySummary;
use pmstack::core::{Core, Mode, Options};
use pmstack::engine::Log;
use pmstack::lower::write_atomic;
use pmstack::lower::RealLower;
use pmstack::pmem::Durability;
use pmstack::region::RUN_DIR;
use pmstack::region::{default_pm, OpenOptions};
use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) fn mount(m: Mount) -> Result<()> {
    let a = &m.s;
    if a.mode == Mode::Strict && a.cache == CacheMode::Writeback {
        // With the writeback cache the kernel acknowledges a write before pmstack sees it,
        // so strict's "durable when the write returns" cannot hold.
        bail!("mode 'strict' cannot be combined with cache 'writeback' (the kernel acknowledges writes before pmstack sees them, so a returned write could be lost); use cache 'writethrough' (the default) with strict, or mode 'sync' with writeback");
    }
    let lower = check_lower(&m.lower)?;
    let mp = match fs::canonicalize(&m.mountpoint) {
        Ok(p) => p,
        // A dead FUSE mount cannot be resolved itself; its parent can.
        Err(e) if dead_connection(&e) => {
            let parent = m.mountpoint.parent().unwrap_or(Path::new("/"));
            let parent = if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            };
            fs::canonicalize(parent)?.join(m.mountpoint.file_name().unwrap_or_default())
        }
        Err(e) => bail!(
            "mountpoint {}: {e} (create it first)",
            m.mountpoint.display()
        ),
    };
    if is_dead_pmstack_mount(&mp) {
        // Its log is recovered below, before the new mount goes live.
        warn_user(&format!(
            "{} holds a dead pmstack mount (its daemon exited without unmounting); detaching it and recovering its log",
            mp.display()
        ));
        let c = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes())?;
        // SAFETY: valid C string; lazy detach of a mount nobody can use.
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
            bail!(
                "detaching the dead mount at {}: {} (try `umount -l {}`)",
                mp.display(),
                std::io::Error::last_os_error(),
                mp.display()
            );
        }
    }
    if !mp.is_dir() {
        bail!("mountpoint {} is not a directory", mp.display());
    }
    if let Some(m) = pmstack_mount_containing(&lower) {
        bail!(
            "lower {} is inside the pmstack mount at {}: stacking pmstack on pmstack is not supported; give that mount's lower directory instead",
            lower.display(),
            m.display()
        );
    }
    if let Some(n) = fs::read_dir(&mp).ok().map(|d| d.count()).filter(|n| *n > 0) {
        warn_user(&format!(
            "mountpoint {} is not empty: its {n} entries are hidden while pmstack is mounted there (mount on an empty directory to keep them in sight)",
            mp.display()
        ));
    }
    if is_mountpoint(&mp) {
        bail!(
            "mountpoint {} is busy (already mounted); unmount it first",
            mp.display()
        );
    }
    if lower.starts_with(&mp) || mp.starts_with(&lower) {
        bail!(
            "lower {} and mountpoint {} must not contain each other",
            lower.display(),
            mp.display()
        );
    }
    if !Path::new("/dev/fuse").exists() {
        bail!("/dev/fuse is missing: load the fuse module or install fuse3");
    }
    // The source shown in /proc/mounts is LOWER as given, like fstab's first field, so that
    // `mount -a` and systemd recognize the mount as already done.
    let mut fuse_opts = vec![
        fuser::MountOption::FSName(m.lower.to_string_lossy().into_owned()),
        // Given to the kernel directly (fuser's Subtype only reaches fusermount), so that
        // /proc/mounts says fuse.pmstack, as fstab and `mount -t` name it.
        fuser::MountOption::CUSTOM("subtype=pmstack".into()),
    ];
    let mut acl = fuser::SessionACL::Owner;
    if a.allow_other {
        acl = fuser::SessionACL::All;
        fuse_opts.push(fuser::MountOption::CUSTOM("allow_other".into()));
        fuse_opts.push(fuser::MountOption::DefaultPermissions);
    } else if a.default_permissions {
        fuse_opts.push(fuser::MountOption::DefaultPermissions);
    }
    for (on, o) in [
        (a.ro, fuser::MountOption::RO),
        (a.noatime, fuser::MountOption::NoAtime),
        (a.nodev, fuser::MountOption::NoDev),
        (a.nosuid, fuser::MountOption::NoSuid),
        (a.noexec, fuser::MountOption::NoExec),
    ] {
        if on {
            fuse_opts.push(o);
        }
    }
    // Bind the metrics endpoint before anything is mounted, so a taken port fails cleanly.
    let metrics = match &a.metrics_addr {
        // A plain listener now (no threads before the fork); the server is built in `serve`.
        Some(addr) => Some(std::net::TcpListener::bind(addr.as_str()).map_err(|e| {
            anyhow!("metrics_addr {addr}: cannot listen ({e}); choose another port or leave metrics off")
        })?),
        None => None,
    };
    raise_fd_limit();
    let real = RealLower::open(&lower)?;
    let (log, lock, summary) = if a.mode == Mode::Passthrough {
        (None, None, None)
    } else {
        if let Err(e) = real.handle(real.root_fd(), 0) {
            bail!("lower {} does not support file handles ({e}); the PM modes need them to find files after a crash: use --mode passthrough", lower.display());
        }
        // What holds on this lower and what falls back, said once at mount.
        let mut notes = Vec::new();
        if !real.syncfs_reliable() {
            notes.push("syncfs is not honoured there, so write-back fsyncs each changed object (slower write-back, same guarantees; `pmstack serve` is not available on it)");
        }
        if !real.handles_persistent() {
            notes.push("its file handles do not survive a remount of its client, so recovery checks each object's inode number and, where a handle is stale, finds objects by scanning LOWER");
        }
        if !notes.is_empty() {
            warn_user(&format!(
                "lower {} is on {}: {}",
                lower.display(),
                fs_type_containing(&lower).unwrap_or_else(|| "an unknown file system".into()),
                notes.join("; ")
            ));
        }
        let pm = a.pm.clone().unwrap_or_else(|| default_pm(&lower));
        let mut region = open_region(
            &pm,
            &lower,
            &real,
            &OpenOptions {
                size: a.pm_size,
                areas: 16,
                take_over: m.take_over,
                acting_for: None,
            },
        )?;
        let log = region.log().clone();
        if log.pm().durability() != Durability::PowerFailSafe {
            warn_user(&format!(
                "PM region {} is emulated (not persistent memory): it survives a pmstack crash but NOT a power loss; use a devdax device or a file on an fsdax mount for power-fail safety",
                pm.display()
            ));
        }
        let sum = region.recovery.take();
        (Some(log), Some(region), sum)
    };
    let opts = Options {
        mode: a.mode,
        flush_interval: a.flush_interval(),
        sensitivity: a.sensitivity,
        low_watermark: a.low_watermark,
        throttle_share: a.throttle_share,
    };
    let mut cfg = fuser::Config::default();
    cfg.mount_options = fuse_opts;
    cfg.acl = acl;
    cfg.n_threads = Some(a.threads.max(1));
    cfg.clone_fd = true;

    // Daemonize before any thread exists; the parent returns once the mount is live.
    let mut ready_pipe: Option<fs::File> = None;
    if !m.foreground {
        let mut fds = [0i32; 2];
        // SAFETY: plain pipe/fork; no threads exist yet.
        unsafe {
            if libc::pipe(fds.as_mut_ptr()) != 0 {
                bail!("pipe: {}", std::io::Error::last_os_error());
            }
            let pid = libc::fork();
            if pid < 0 {
                bail!("fork: {}", std::io::Error::last_os_error());
            }
            if pid > 0 {
                libc::close(fds[1]);
                let mut r = fs::File::from_raw_fd(fds[0]);
                let mut msg = String::new();
                let _ = r.read_to_string(&mut msg);
                if msg.starts_with("ok") {
                    std::process::exit(0);
                }
                bail!(
                    "{}",
                    if msg.is_empty() {
                        "mount failed (daemon exited)".to_string()
                    } else {
                        msg.trim().to_string()
                    }
                );
            }
            libc::close(fds[0]);
            libc::setsid();
            ready_pipe = Some(fs::File::from_raw_fd(fds[1]));
        }
    }
    let result = serve(
        a,
        lower,
        mp,
        real,
        log,
        opts,
        cfg,
        summary,
        metrics,
        &mut ready_pipe,
    );
    if let (Err(e), Some(p)) = (&result, ready_pipe.as_mut()) {
        let _ = write!(p, "{e:#}");
    }
    drop(lock);
    result
}

#[allow(clippy::too_many_arguments)]
pub(super) fn serve(
    a: &Settings,
    lower: PathBuf,
    mp: PathBuf,
    real: RealLower,
    log: Option<Arc<Log>>,
    opts: Options,
    cfg: fuser::Config,
    summary: Option<RecoverySummary>,
    metrics: Option<std::net::TcpListener>,
    ready: &mut Option<fs::File>,
) -> Result<()> {
    let ttl = a.attr_timeout_for(real.syncfs_reliable());
    let core = Core::new(real, opts, log.clone())?;
    let adapter = pmstack::fuse::Adapter::new(
        core.clone(),
        ttl,
        a.cache == CacheMode::Writeback,
        a.mode == Mode::Passthrough && a.kernel_passthrough,
        // Opens without a round trip where the kernel checks rights itself, or where the
        // daemon's own rights cover every file (root), so the daemon's open checked nothing.
        a.allow_other || a.default_permissions || pmstack::lower::creds::euid() == 0,
    );
    let mut session = fuser::Session::new(adapter, &mp, &cfg).map_err(|e| {
        anyhow!(
            "mounting {}: {e} (are you permitted to mount? is fuse3 installed?)",
            mp.display()
        )
    })?;
    let mut unmounter = session.unmount_callable();
    let _ = fs::create_dir_all(RUN_DIR);
    let state = state_path(&mp);
    let info = serde_json::json!({
        "pid": std::process::id(), "lower": lower, "mountpoint": mp, "mode": format!("{:?}", a.mode).to_lowercase(),
        "pm": log.as_ref().map(|_| a.pm.clone().unwrap_or_else(|| default_pm(&lower))),
    });
    write_atomic(&state, &info.to_string())?;
    // Counters exist before the mount is reported live, so `pmstack stat` works at once.
    write_atomic(
        &state.with_extension("stats"),
        &pmstack::metrics::mount_stats(&core, &summary).to_string(),
    )?;
    if let Some(mut p) = ready.take() {
        let _ = p.write_all(b"ok");
        drop(p);
        // Detach from the terminal; logs go to a file beside the state file.
        if let Ok(null) = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
        {
            let logf = fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o640)
                .open(state.with_extension("log"));
            // SAFETY: dup2 onto the standard descriptors.
            unsafe {
                libc::dup2(null.as_raw_fd(), 0);
                libc::dup2(null.as_raw_fd(), 1);
                libc::dup2(logf.as_ref().map_or(null.as_raw_fd(), |f| f.as_raw_fd()), 2);
            }
        }
    }
    let flusher = {
        let c = core.clone();
        std::thread::Builder::new()
            .name("pmstack-flusher".into())
            .spawn(move || c.run_flusher())?
    };
    {
        let mut signals = signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM])?;
        std::thread::Builder::new()
            .name("pmstack-signals".into())
            .spawn(move || {
                if signals.forever().next().is_some() {
                    let _ = unmounter.unmount();
                }
            })?;
    }
    if let Some(listener) = metrics {
        let server = tiny_http::Server::from_listener(listener, None)
            .map_err(|e| anyhow!("metrics endpoint: {e}"))?;
        let c = core.clone();
        let sum = summary.clone();
        std::thread::Builder::new()
            .name("pmstack-metrics".into())
            .spawn(move || {
                for req in server.incoming_requests() {
                    answer_metrics(req, || {
                        pmstack::metrics::render(
                            &pmstack::metrics::mount_stats(&c, &sum),
                            Some(&c.latency),
                        )
                    });
                }
            })?;
    }
    // systemd Type=notify: the mount is live (a no-op outside systemd).
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    {
        let c = core.clone();
        let statf = state.with_extension("stats");
        let sum = summary.clone();
        std::thread::Builder::new()
            .name("pmstack-stats".into())
            .spawn(move || loop {
                let _ = write_atomic(&statf, &pmstack::metrics::mount_stats(&c, &sum).to_string());
                std::thread::sleep(Duration::from_millis(500));
            })?;
    }
    let run = session.run();
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    let drained = core.log.as_ref().map_or(0, |l| l.bytes_used());
    let t0 = Instant::now();
    let r = core.shutdown();
    let mut last = pmstack::metrics::mount_stats(&core, &summary);
    last["drained_bytes"] = drained.into();
    last["drain_ms"] = (t0.elapsed().as_millis() as u64).into();
    let _ = write_atomic(&state.with_extension("stats"), &last.to_string());
    let _ = flusher.join();
    let _ = fs::remove_file(&state);
    r.with_context(|| format!("draining the log into {} at unmount", lower.display()))?;
    tracing::info!(bytes = drained, "unmounted; log drained");
    run.map_err(|e| anyhow!("FUSE session ended with an error: {e}"))
}
