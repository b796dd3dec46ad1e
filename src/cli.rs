//! Subcommands: mount, umount, format, check, recover, stat, demo.

use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand};

use pmstack::config::{CacheMode, LogTarget, Settings};
use pmstack::core::recover::RecoverySummary;
use pmstack::core::{Core, Mode, Options};
use pmstack::engine::format::PAGE;
use pmstack::engine::{scan, Log};
use pmstack::lower::creds;
use pmstack::lower::RealLower;
use pmstack::pmem::mapped::MappedRegion;
use pmstack::pmem::{Durability, Pmem};
use pmstack::region::{default_pm, Observer, OpenOptions, Region};

const RUN_DIR: &str = "/run/pmstack";

#[derive(Parser)]
#[command(
    name = "pmstack",
    version,
    about = "A persistent-memory write-ahead tier over an existing file system"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Stack pmstack over LOWER at MOUNTPOINT. Recovers a crashed log first.
    Mount(Box<MountArgs>),
    /// Unmount, wait until the log is drained into LOWER, report.
    Umount {
        /// A pmstack mount point (other file systems are refused).
        mountpoint: PathBuf,
    },
    /// Create a PM region bound to a lower directory.
    Format {
        /// The region: a devdax device, a file on an fsdax mount, or any file (emulated PM).
        /// An existing file that is not a region is refused without --force.
        #[arg(long)]
        pm: PathBuf,
        /// Region size, e.g. 256M, 1G (a device's size is its own). The space is reserved.
        #[arg(long, default_value = "256M", value_parser = parse_size)]
        size: u64,
        /// The lower directory the region is bound to (a `.pmstack-id` marker is written).
        #[arg(long)]
        lower: PathBuf,
        /// Overwrite a region that still holds live entries (their data is lost).
        #[arg(long)]
        force: bool,
    },
    /// Validate a region and summarize it. Writes nothing.
    Check {
        /// The region to check.
        #[arg(long)]
        pm: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Also list every live entry.
        #[arg(long)]
        entries: bool,
    },
    /// Replay a region's live entries onto LOWER offline, then empty the log.
    Recover {
        /// The region whose log is replayed.
        #[arg(long)]
        pm: PathBuf,
        /// The lower directory the region is bound to (a copy of it is refused).
        lower: PathBuf,
    },
    /// Counters of a mounted pmstack.
    Stat {
        /// A pmstack mount point, or a directory served by `pmstack serve`.
        mountpoint: PathBuf,
        /// Print the counters as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Mount over a temporary directory, run a sync-heavy workload on the lower FS alone and
    /// through pmstack (interleaved, repeated), print the ratio, unmount and verify.
    Demo {
        /// Parent of the temporary lower directory (on the disk, not tmpfs).
        #[arg(long, default_value = "/var/tmp")]
        dir: PathBuf,
        /// Synchronous writes per run.
        #[arg(long, default_value_t = 400)]
        ops: usize,
        /// Interleaved repetitions (the median is reported).
        #[arg(long, default_value_t = 3)]
        reps: usize,
    },
    /// Serve DIR to programs started with `pmstack run`: own the PM region (recovery first,
    /// then write-back), let them attach. Runs until SIGTERM/SIGINT.
    Serve(ServeArgs),
    /// Run a program with syncs under ROOT absorbed by the PM log (LD_PRELOAD; no mount).
    /// A `pmstack serve ROOT` must be running; without it the program runs natively.
    Run(RunArgs),
    /// Write the man pages into a directory (packaging).
    #[command(hide = true)]
    Man {
        #[arg(long, default_value = "docs/man")]
        out: PathBuf,
    },
}

#[derive(clap::Args)]
#[command(after_long_help = SERVE_HELP)]
struct ServeArgs {
    /// The lower directory programs work on.
    dir: PathBuf,
    /// PM region (default /dev/shm/pmstack-<id>.pm, emulated: survives a crash of pmstack,
    /// NOT a power loss).
    #[arg(long)]
    pm: Option<PathBuf>,
    /// Size of a region created now.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pm_size: u64,
    /// Write-back period.
    #[arg(long, default_value_t = 5000)]
    flush_interval_ms: u64,
    /// Do not watch for writers outside `pmstack run` (fanotify, needs root): you promise
    /// that every process writing DIR runs under `pmstack run`.
    #[arg(long)]
    all_writers_attached: bool,
    /// Start although another node's pmstack left DIR without a clean shutdown, giving up
    /// what its PM log holds that is not in DIR yet (see docs/distributed.md).
    #[arg(long)]
    take_over: bool,
    /// Serve the programs of this user (a name or uid) instead of root's: only their
    /// processes may attach, the region and table become theirs, and recovery replays the
    /// log with their rights. One daemon per user: the log cannot tell whose process wrote
    /// a record.
    #[arg(long, value_name = "USER")]
    user: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9465 (default off).
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<String>,
    #[arg(long, default_value = "info")]
    log_level: String,
}

const SERVE_HELP: &str = "\
Programs started with `pmstack run --root DIR -- CMD` attach through a Unix socket in
/run/pmstack and share a table in /dev/shm with the daemon. Absorbed: fsync/fdatasync and
O_SYNC/O_DSYNC writes of regular files under DIR by dynamically linked programs, and fsync
of a directory whose every change was logged. Namespace operations (create, mkdir, symlink,
link, unlink, rmdir, rename) are logged: durable and ordered on return. Real (the lower file
system's fsync): the first sync of a file that existed before (after the daemon looked for
writers outside `pmstack run` holding it), files with a shared writable mapping, stdio
streams, copy_file_range/sendfile/splice targets, io_uring users, syncs while another
process has unsynced writes to the file, and everything once the daemon is gone. A change of
a directory outside the log makes its next sync, or next logged change, write everything
back once. Writers outside `pmstack run` are watched with fanotify (needs root): every open
of a tracked file, or of an entry of a directory with logged changes, is checked, and a file
such a process writes is synced for real until it is done with it (--all-writers-attached
turns the watch off). A second daemon for DIR, or a new one while programs attached to an
old one still run, is refused.";

const RUN_HELP: &str = "\
Sets LD_PRELOAD (libpmstack_preload.so, found beside pmstack, in ../lib/pmstack, or at
$PMSTACK_PRELOAD) and execs the program; children and exec'd programs inherit it.

Absorbed (dynamically linked programs calling the C library): fsync/fdatasync of regular
files under ROOT become an append to the PM log; O_SYNC/O_DSYNC writes are logged as they
happen; namespace operations are logged (durable and ordered on return) and a directory
fsync is absorbed while every change of the directory was logged. Not absorbed, and made
durable by the lower file system's own fsync instead: static binaries and Go programs (they
bypass the C library: nothing is intercepted at all), the first sync of a file that existed
before, files written through a shared writable mmap, a stdio stream,
copy_file_range/sendfile/splice or io_uring, a sync while another process has unsynced
writes to the file, and every sync once the daemon is gone. A file that a process outside
`pmstack run` opens for writing is seen by the daemon's watch, and is synced for real until
that process is done with it.

Example:
  pmstack serve /srv/db &
  pmstack run --root /srv/db -- sqlite3 /srv/db/app.db 'insert into t values (1)'";

#[derive(clap::Args)]
#[command(after_long_help = RUN_HELP)]
struct RunArgs {
    /// The served directory.
    #[arg(long)]
    root: PathBuf,
    /// The region the daemon should be serving (checked when given).
    #[arg(long)]
    pm: Option<PathBuf>,
    /// Fail instead of running the program natively when no daemon serves ROOT.
    #[arg(long)]
    require_daemon: bool,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
    cmd: Vec<std::ffi::OsString>,
}

const MOUNT_HELP: &str = "\
Settings (flag, -o key=value, or key in the --config TOML file; flags win over -o, -o over the file):
  mode                sync (default), strict, adaptive, passthrough
  pm                  PM region: /dev/daxX.Y, a file on an fsdax mount (MAP_SYNC), or any
                      file (emulated: survives a pmstack crash, NOT a power loss).
                      Default: /dev/shm/pmstack-<id>.pm, bound to LOWER
  pm_size             size of a region created on first mount (default 256M)
  flush_interval_ms   write-back period (default 5000; ms for SSD, ~1000 for HDD/network)
  low_watermark       start write-back below this free share of PM (default 0.25)
  throttle_share      strict: share write-back must free before a throttled writer goes on (0.2)
  sensitivity         active-sync sensitivity, NVLog section 4.4 (default 2)
  attr_timeout        attribute and entry cache timeout in seconds (default 1)
  cache               writethrough (default) or writeback kernel page cache
  kernel_passthrough  passthrough mode: use the kernel's FUSE passthrough (default true)
  threads             FUSE worker threads (default 2)
  log_level           error, warn (default), info, debug, trace, or a filter (pmstack=debug)
  log_target          stderr (default; a daemon writes /run/pmstack/<id>.log), journald, syslog
  metrics_addr        serve Prometheus text at http://ADDR/metrics (default off)
  allow_other, default_permissions, ro, noatime, nodev, nosuid, noexec
                      FUSE/VFS mount flags (as -o words, or key = true in the file)
  lower, mountpoint   (config file only) used when not given on the command line

-o also takes config=PATH, and ignores what mount(8) and fstab pass to every helper
(rw, defaults, auto, noauto, nofail, _netdev, user, x-*, comment=*).

Mounting the Linux way (the package links /usr/sbin/mount.fuse.pmstack to pmstack):
  mount -t fuse.pmstack /srv/data /mnt/data -o pm=/dev/dax0.0,mode=sync
  /etc/fstab:  /srv/data  /mnt/data  fuse.pmstack  pm=/dev/dax0.0,mode=sync,nofail  0 0

A crashed log is checked and replayed onto LOWER before the mount goes live. The command
returns once the mount is live (unless -f); SIGTERM/SIGINT or `pmstack umount` unmounts and
drains the log into LOWER. Exit status: 0 mounted, 1 error (one line on stderr).";

#[derive(clap::Args, Clone, Default)]
#[command(after_long_help = MOUNT_HELP)]
struct MountArgs {
    /// The existing directory to stack over (or `lower` in the config file).
    lower: Option<PathBuf>,
    /// Where to mount (or `mountpoint` in the config file).
    mountpoint: Option<PathBuf>,
    /// TOML configuration file (keys below); flags and -o options override it.
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// sync (default), strict, adaptive, passthrough.
    #[arg(long, value_name = "MODE")]
    mode: Option<String>,
    /// PM region (default: an emulated region in /dev/shm bound to LOWER).
    #[arg(long, value_name = "PATH")]
    pm: Option<String>,
    /// Size of a region created on first mount (default 256M).
    #[arg(long, value_name = "SIZE")]
    pm_size: Option<String>,
    /// Write-back period in milliseconds (default 5000).
    #[arg(long, value_name = "MS")]
    flush_interval_ms: Option<String>,
    /// Start write-back when less than this share of PM is free (default 0.25).
    #[arg(long, value_name = "SHARE")]
    low_watermark: Option<String>,
    /// strict: a writer that finds PM full waits until write-back freed this share (0.2).
    #[arg(long, value_name = "SHARE")]
    throttle_share: Option<String>,
    /// Active-sync sensitivity, NVLog section 4.4 (default 2).
    #[arg(long, value_name = "N")]
    sensitivity: Option<String>,
    /// Attribute and entry cache timeout, in seconds (default 1).
    #[arg(long, value_name = "SECONDS")]
    attr_timeout: Option<String>,
    /// Kernel page cache mode for writes: writethrough (default) or writeback.
    #[arg(long, value_name = "MODE")]
    cache: Option<String>,
    /// In passthrough mode, do not use the kernel's FUSE passthrough.
    #[arg(long)]
    no_kernel_passthrough: bool,
    /// FUSE worker threads (default 2).
    #[arg(long, value_name = "N")]
    threads: Option<String>,
    /// error, warn (default), info, debug, trace, or a tracing filter.
    #[arg(long, value_name = "LEVEL")]
    log_level: Option<String>,
    /// stderr (default), journald, syslog.
    #[arg(long, value_name = "TARGET")]
    log_target: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9464 (default off).
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<String>,
    /// Stay in the foreground (for systemd Type=notify units; READY=1 once live).
    #[arg(short, long)]
    foreground: bool,
    /// Start although another node's pmstack left LOWER without a clean shutdown, giving up
    /// what its PM log holds that is not in LOWER yet (see docs/distributed.md).
    #[arg(long)]
    take_over: bool,
    /// Mount options, comma separated: key=value settings, config=PATH, and flags
    /// (allow_other, ro, noatime, …).
    #[arg(short = 'o', value_name = "OPTIONS")]
    options: Option<String>,
}

/// The resolved mount: settings plus the positional paths.
struct Mount {
    s: Settings,
    lower: PathBuf,
    mountpoint: PathBuf,
    foreground: bool,
    take_over: bool,
}

impl MountArgs {
    /// Defaults < config file < -o options < flags; every value validated by one function.
    fn resolve(&self) -> Result<Mount> {
        let mut s = Settings::default();
        if let Some(c) = &self.config {
            s.apply_file(c)?;
        }
        if let Some(o) = &self.options {
            s.apply_options(o)?;
        }
        let flags: [(&str, &Option<String>); 13] = [
            ("mode", &self.mode),
            ("pm", &self.pm),
            ("pm_size", &self.pm_size),
            ("flush_interval_ms", &self.flush_interval_ms),
            ("low_watermark", &self.low_watermark),
            ("throttle_share", &self.throttle_share),
            ("sensitivity", &self.sensitivity),
            ("attr_timeout", &self.attr_timeout),
            ("cache", &self.cache),
            ("threads", &self.threads),
            ("log_level", &self.log_level),
            ("log_target", &self.log_target),
            ("metrics_addr", &self.metrics_addr),
        ];
        for (k, v) in flags {
            if let Some(v) = v {
                s.set(k, v)
                    .map_err(|e| anyhow!("--{}: {e}", k.replace('_', "-")))?;
            }
        }
        if self.no_kernel_passthrough {
            s.kernel_passthrough = false;
        }
        let lower = self.lower.clone().or(s.lower.clone()).ok_or_else(|| {
            anyhow!(
                "no lower directory: give LOWER MOUNTPOINT, or lower = \"...\" in the config file"
            )
        })?;
        let mountpoint = self.mountpoint.clone().or(s.mountpoint.clone()).ok_or_else(|| {
            anyhow!("no mountpoint: give LOWER MOUNTPOINT, or mountpoint = \"...\" in the config file")
        })?;
        Ok(Mount {
            s,
            lower,
            mountpoint,
            foreground: self.foreground,
            take_over: self.take_over,
        })
    }
}

fn parse_size(s: &str) -> Result<u64, String> {
    pmstack::config::parse_size(s)
}

/// Where warnings go besides the terminal (set once logging is configured).
static LOG_TARGET: std::sync::OnceLock<LogTarget> = std::sync::OnceLock::new();

/// A warning the operator must see: on the terminal, and in the log when that is elsewhere.
fn warn_user(msg: &str) {
    eprintln!("pmstack: warning: {msg}");
    if LOG_TARGET.get().is_some_and(|t| *t != LogTarget::Stderr) {
        tracing::warn!("{msg}");
    }
}

/// Structured logs to stderr, journald or syslog. `PMSTACK_LOG` (a tracing filter) overrides
/// the level, for debugging.
fn init_logging(level: &str, target: LogTarget) -> Result<()> {
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::try_from_env("PMSTACK_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("{level},fuser=error")));
    let _ = LOG_TARGET.set(target);
    match target {
        LogTarget::Stderr => tracing_subscriber::registry()
            .with(filter)
            .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
            .init(),
        LogTarget::Journald => {
            let layer = tracing_journald::layer().map_err(|e| {
                anyhow!("log_target journald: cannot reach the journal ({e}); is systemd-journald running? use stderr or syslog")
            })?;
            tracing_subscriber::registry()
                .with(filter)
                .with(layer.with_syslog_identifier("pmstack".into()))
                .init()
        }
        LogTarget::Syslog => {
            let sl = syslog_tracing::Syslog::new(
                c"pmstack",
                syslog_tracing::Options::LOG_PID,
                syslog_tracing::Facility::Daemon,
            )
            .ok_or_else(|| {
                anyhow!("log_target syslog: syslog is already in use by this process")
            })?;
            tracing_subscriber::registry()
                .with(filter)
                .with(
                    tracing_subscriber::fmt::layer()
                        .with_writer(sl)
                        .with_ansi(false)
                        .without_time(),
                )
                .init()
        }
    }
    Ok(())
}

/// `mount.fuse.pmstack SOURCE MOUNTPOINT [-sfnv] [-o OPTIONS] [-t TYPE]`, as mount(8) calls a
/// helper for `-t fuse.pmstack` and for fstab lines of that type.
fn mount_helper(args: &[String]) -> Result<()> {
    let mut pos = Vec::new();
    let mut opts: Vec<String> = Vec::new();
    let mut fake = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-h" | "--help" => {
                println!("usage: mount.fuse.pmstack LOWER MOUNTPOINT [-sfnv] [-o OPTIONS]\n\nCalled by mount(8) for `mount -t fuse.pmstack` and fstab lines of type fuse.pmstack.\nOPTIONS are pmstack's settings as key=value (pm=/dev/dax0.0,mode=sync,...: see `pmstack mount --help`);\nmount(8)'s generic options (rw, defaults, nofail, _netdev, x-*) are accepted and ignored.\n-f: check the arguments, mount nothing. -s -n -v: accepted, ignored.");
                return Ok(());
            }
            "--" => {}
            "-o" => opts.push(
                it.next()
                    .ok_or_else(|| anyhow!("-o needs an option string"))?
                    .clone(),
            ),
            "-t" | "-N" => {
                let v = it.next();
                if a == "-N" {
                    bail!("mount.fuse.pmstack: -N {} (mount namespaces) is not supported; mount from inside the namespace", v.map_or("", |s| s.as_str()));
                }
            }
            s if s.starts_with("-o") => opts.push(s[2..].to_string()),
            s if s.starts_with('-') && s.len() > 1 => {
                for c in s[1..].chars() {
                    match c {
                        's' | 'n' | 'v' => {}
                        'f' => fake = true,
                        _ => bail!("mount.fuse.pmstack: unknown flag -{c} (usage: mount.fuse.pmstack LOWER MOUNTPOINT [-sfnv] [-o OPTIONS])"),
                    }
                }
            }
            _ => pos.push(a.clone()),
        }
    }
    if pos.len() != 2 {
        bail!(
            "usage: mount.fuse.pmstack LOWER MOUNTPOINT [-o OPTIONS] (got {} paths)",
            pos.len()
        );
    }
    let a = MountArgs {
        lower: Some(PathBuf::from(&pos[0])),
        mountpoint: Some(PathBuf::from(&pos[1])),
        options: Some(opts.join(",")),
        ..Default::default()
    };
    let m = a.resolve()?;
    if fake {
        return Ok(());
    }
    init_logging(&m.s.log_level, m.s.log_target)?;
    mount(m)
}

pub fn main() -> Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    let prog = argv
        .first()
        .map(|a| {
            Path::new(a)
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string()
        })
        .unwrap_or_default();
    if prog == "mount.fuse.pmstack" || prog == "mount.pmstack" {
        return mount_helper(&argv[1..]);
    }
    let cmd = Cli::parse().cmd;
    if let Cmd::Mount(a) = &cmd {
        let m = a.resolve()?;
        init_logging(&m.s.log_level, m.s.log_target)?;
        return mount(m);
    }
    if let Cmd::Serve(a) = &cmd {
        init_logging(&a.log_level, LogTarget::Stderr)?;
    } else {
        init_logging("warn", LogTarget::Stderr)?;
    }
    if matches!(cmd, Cmd::Check { .. } | Cmd::Stat { .. } | Cmd::Man { .. }) {
        // Reports piped into `head` end quietly when the reader goes away, as other tools'
        // do (the Rust runtime ignores SIGPIPE, which turns the write into a panic). Never
        // for the daemons: a client that hangs up must not kill them.
        // SAFETY: restoring a signal's default action.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    match cmd {
        Cmd::Mount(_) => unreachable!("handled above"),
        Cmd::Umount { mountpoint } => umount(&mountpoint),
        Cmd::Format {
            pm,
            size,
            lower,
            force,
        } => format_cmd(&pm, size, &lower, force),
        Cmd::Check { pm, json, entries } => check(&pm, json, entries),
        Cmd::Recover { pm, lower } => recover_cmd(&pm, &lower),
        Cmd::Stat { mountpoint, json } => stat(&mountpoint, json),
        Cmd::Demo { dir, ops, reps } => demo(&dir, ops, reps),
        Cmd::Man { out } => man_pages(&out),
        Cmd::Serve(a) => serve_cmd(a),
        Cmd::Run(a) => run_cmd(a),
    }
}

/// Write the man pages (pmstack(1), pmstack-SUBCOMMAND(1), mount.fuse.pmstack(8)) into `out`.
fn man_pages(out: &Path) -> Result<()> {
    use clap::CommandFactory;
    fs::create_dir_all(out)?;
    let cmd = Cli::command();
    let mut buf = Vec::new();
    clap_mangen::Man::new(cmd.clone()).render(&mut buf)?;
    fs::write(out.join("pmstack.1"), &buf)?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("pmstack-{}", sub.get_name());
        let sub = sub.clone().name(name.clone());
        let mut buf = Vec::new();
        clap_mangen::Man::new(sub).render(&mut buf)?;
        fs::write(out.join(format!("{name}.1")), &buf)?;
    }
    let helper = clap::Command::new("mount.fuse.pmstack")
        .about("mount(8) helper for file systems of type fuse.pmstack")
        .long_about("mount(8) runs this helper for `mount -t fuse.pmstack LOWER MOUNTPOINT -o OPTIONS` and for /etc/fstab lines of type fuse.pmstack. It is pmstack itself (a link) and behaves as `pmstack mount LOWER MOUNTPOINT -o OPTIONS`.")
        .version(env!("CARGO_PKG_VERSION"))
        .arg(clap::Arg::new("lower").value_name("LOWER").required(true).help("The existing directory to stack over"))
        .arg(clap::Arg::new("mountpoint").value_name("MOUNTPOINT").required(true).help("Where to mount"))
        .arg(clap::Arg::new("options").short('o').value_name("OPTIONS").help("Settings as key=value (see pmstack-mount(1)), config=PATH, FUSE flags; mount(8)'s generic options are ignored"))
        .arg(clap::Arg::new("fake").short('f').action(clap::ArgAction::SetTrue).help("Check the options, do not mount"))
        .arg(clap::Arg::new("sloppy").short('s').action(clap::ArgAction::SetTrue).help("Accepted, ignored"))
        .arg(clap::Arg::new("nomtab").short('n').action(clap::ArgAction::SetTrue).help("Accepted, ignored"))
        .arg(clap::Arg::new("verbose").short('v').action(clap::ArgAction::SetTrue).help("Accepted, ignored"))
        .after_long_help(MOUNT_HELP);
    let mut buf = Vec::new();
    clap_mangen::Man::new(helper)
        .section("8")
        .render(&mut buf)?;
    fs::write(out.join("mount.fuse.pmstack.8"), &buf)?;
    Ok(())
}

use pmstack::lower::{id_of, write_atomic};

fn state_path(mountpoint: &Path) -> PathBuf {
    Path::new(RUN_DIR).join(format!("{}.json", id_of(mountpoint)))
}

fn check_lower(lower: &Path) -> Result<PathBuf> {
    let md = fs::metadata(lower).map_err(|e| {
        anyhow!(
            "lower directory {}: {e} (give an existing directory)",
            lower.display()
        )
    })?;
    if !md.is_dir() {
        bail!(
            "lower {} is not a directory (give an existing directory)",
            lower.display()
        );
    }
    Ok(fs::canonicalize(lower)?)
}

/// The file system type mounted at `p` (last mount wins), if any.
/// The mounts of this process's namespace, in /proc/self/mountinfo order (later mounts
/// over earlier ones): mount point and file system type (`ext4`, `fuse.pmstack`, …).
fn mounts() -> Vec<(PathBuf, String)> {
    let Ok(s) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    s.lines()
        .filter_map(|l| {
            let m = PathBuf::from(l.split(' ').nth(4)?.replace("\\040", " "));
            let t = l.split(" - ").nth(1)?.split(' ').next()?.to_string();
            Some((m, t))
        })
        .collect()
}

/// The type of the file system mounted at `p` (the topmost mount there), if any.
fn mount_type(p: &Path) -> Option<String> {
    mounts()
        .into_iter()
        .rev()
        .find(|(m, _)| m == p)
        .map(|(_, t)| t)
}

/// The innermost (and topmost) mount containing `p` whose type `want` accepts.
fn mount_containing(p: &Path, want: impl Fn(&str) -> bool) -> Option<(PathBuf, String)> {
    mounts()
        .into_iter()
        .filter(|(m, t)| p.starts_with(m) && want(t))
        .max_by_key(|(m, _)| m.as_os_str().len())
}

/// The type of the file system `p` is on (`ext4`, `fuse.glusterfs`, …).
fn fs_type_containing(p: &Path) -> Option<String> {
    mount_containing(p, |_| true).map(|(_, t)| t)
}

/// The pmstack mount that `p` is in (stacking pmstack on itself is refused).
fn pmstack_mount_containing(p: &Path) -> Option<PathBuf> {
    mount_containing(p, |t| t == "fuse.pmstack").map(|(m, _)| m)
}

fn dead_connection(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOTCONN | libc::ECONNABORTED))
}

/// A pmstack mount whose daemon died (kill -9, OOM): the kernel answers ENOTCONN or
/// ECONNABORTED.
fn is_dead_pmstack_mount(p: &Path) -> bool {
    mount_type(p).as_deref() == Some("fuse.pmstack")
        && fs::metadata(p).is_err_and(|e| dead_connection(&e))
}

fn is_mountpoint(p: &Path) -> bool {
    mount_type(p).is_some()
}

/// The operator's view of a region being opened: lines on stderr, warnings in the log too,
/// and the progress of a recovery.
struct Operator {
    shown: Progress,
}

impl Observer for Operator {
    fn say(&self, msg: &str) {
        eprintln!("pmstack: {msg}");
    }
    fn warn(&self, msg: &str) {
        warn_user(msg);
    }
    fn progress(&self, done: u64, total: u64) {
        self.shown.tick(|| {
            format!(
                "{done}/{total} operations ({}%)",
                (done * 100).checked_div(total).unwrap_or(100)
            )
        })
    }
    fn progress_done(&self) {
        self.shown.done();
    }
}

/// Open (or create and format) the region bound to `lower`, recovering a crashed log.
fn open_region(
    pm: &Path,
    lower: &Path,
    real: &RealLower,
    opts: &OpenOptions<'_>,
) -> Result<Region> {
    let obs = Operator {
        shown: Progress::new("recovery"),
    };
    Ok(Region::open(
        pm,
        lower,
        real,
        opts,
        &obs,
        Box::new(|m: &str| warn_user(m)),
    )?)
}

/// A stacking file system holds a descriptor per cached inode: use the hard limit.
fn raise_fd_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return;
    }
    // Root may raise the hard limit up to fs.nr_open.
    let nr_open = fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let want = libc::rlimit {
        rlim_cur: nr_open.max(r.rlim_max),
        rlim_max: nr_open.max(r.rlim_max),
    };
    // SAFETY: valid pointers.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } != 0 {
        r.rlim_cur = r.rlim_max;
        // SAFETY: valid pointer.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) };
    }
}

fn mount(m: Mount) -> Result<()> {
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
fn serve(
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
    let core = Core::new(real, opts, log.clone())?;
    let adapter = pmstack::fuse::Adapter::new(
        core.clone(),
        Duration::from_secs_f64(a.attr_timeout),
        a.cache == CacheMode::Writeback,
        a.mode == Mode::Passthrough && a.kernel_passthrough,
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
        &stats_json(&core, &summary).to_string(),
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
                        pmstack::metrics::render(&stats_json(&c, &sum), Some(&c.latency))
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
                let _ = write_atomic(&statf, &stats_json(&c, &sum).to_string());
                std::thread::sleep(Duration::from_millis(500));
            })?;
    }
    let run = session.run();
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    let drained = core.log.as_ref().map_or(0, |l| l.bytes_used());
    let t0 = Instant::now();
    let r = core.shutdown();
    let mut last = stats_json(&core, &summary);
    last["drained_bytes"] = drained.into();
    last["drain_ms"] = (t0.elapsed().as_millis() as u64).into();
    let _ = write_atomic(&state.with_extension("stats"), &last.to_string());
    let _ = flusher.join();
    let _ = fs::remove_file(&state);
    r.with_context(|| format!("draining the log into {} at unmount", lower.display()))?;
    tracing::info!(bytes = drained, "unmounted; log drained");
    run.map_err(|e| anyhow!("FUSE session ended with an error: {e}"))
}

fn stats_json(core: &Core, rec: &Option<RecoverySummary>) -> serde_json::Value {
    let mut m = core.stats.to_json();
    m.insert("latency_us".into(), core.latency.to_json());
    // Inode descriptors are a bounded cache (reopened by file handle when evicted).
    m.insert("node_fds_max".into(), core.node_fds_max.into());
    m.insert(
        "node_fds_open".into(),
        pmstack::core::node::NODE_FDS_OPEN
            .load(std::sync::atomic::Ordering::Relaxed)
            .into(),
    );
    if let Some(l) = &core.log {
        let s = &l.stats;
        use std::sync::atomic::Ordering::Relaxed;
        m.insert("log_commits".into(), s.commits.load(Relaxed).into());
        m.insert("log_entries".into(), s.entries.load(Relaxed).into());
        m.insert(
            "log_bytes_inplace".into(),
            s.bytes_inplace.load(Relaxed).into(),
        );
        m.insert(
            "log_bytes_outofplace".into(),
            s.bytes_pages.load(Relaxed).into(),
        );
        m.insert("gc_runs".into(), s.gc_runs.load(Relaxed).into());
        m.insert("gc_pages_freed".into(), s.pages_freed.load(Relaxed).into());
        m.insert("pm_bytes_used".into(), l.bytes_used().into());
        m.insert(
            "pm_bytes_free".into(),
            ((l.pages_free() * PAGE) as u64).into(),
        );
        m.insert("pm_full_events".into(), s.full.load(Relaxed).into());
        m.insert("pm_kind".into(), l.pm().kind().name().into());
        m.insert(
            "flush".into(),
            pmstack::pmem::flush::flush_kind().name().into(),
        );
    }
    if core.opts.mode == Mode::Adaptive {
        let (e, l) = core.adaptive_blocks();
        m.insert("adaptive_blocks_eager".into(), e.into());
        m.insert("adaptive_blocks_lazy".into(), l.into());
        let s = &core.stats;
        use std::sync::atomic::Ordering::Relaxed;
        let h = s.adaptive_hits.load(Relaxed);
        let all = h + s.adaptive_misses.load(Relaxed) + s.adaptive_wasted.load(Relaxed);
        let rate = if all == 0 { 0.0 } else { h as f64 / all as f64 };
        m.insert("adaptive_prediction_hit_rate".into(), rate.into());
    }
    m.insert(
        "mode".into(),
        format!("{:?}", core.opts.mode).to_lowercase().into(),
    );
    m.insert(
        "recovery".into(),
        serde_json::to_value(rec).unwrap_or_default(),
    );
    serde_json::Value::Object(m)
}

fn umount(mp: &Path) -> Result<()> {
    let mp = fs::canonicalize(mp).map_err(|e| anyhow!("mountpoint {}: {e}", mp.display()))?;
    let state = state_path(&mp);
    let pid = fs::read_to_string(&state)
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|v| v["pid"].as_u64());
    match mount_type(&mp).as_deref() {
        Some("fuse.pmstack") => {}
        Some(other) => bail!(
            "{} is a {other} mount, not a pmstack mount; nothing was unmounted (use umount(8) for other file systems)",
            mp.display()
        ),
        None => bail!("{} is not a mount point; nothing was unmounted", mp.display()),
    }
    // What the drain has to write, from the daemon's last stats (shown if it takes a while).
    let live_mib = fs::read_to_string(state.with_extension("stats"))
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|v| v["pm_bytes_used"].as_u64())
        .map(|b| b >> 20);
    let c = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes())?;
    // SAFETY: valid C string.
    if unsafe { libc::umount2(c.as_ptr(), 0) } != 0 {
        let e = std::io::Error::last_os_error();
        let st = std::process::Command::new("fusermount3")
            .arg("-u")
            .arg(&mp)
            .status();
        if !st.is_ok_and(|s| s.success()) {
            bail!(
                "unmounting {}: {e} (is it busy? close files and retry)",
                mp.display()
            );
        }
    }
    if let Some(pid) = pid {
        let t0 = Instant::now();
        let shown = Progress::new("unmount");
        let live = live_mib.map_or(String::new(), |m| format!("{m} MiB of live log, "));
        // Until it exits (a zombie has: its parent may be slow to reap it).
        while pmstack::front::table::alive(pid) {
            if t0.elapsed() > Duration::from_secs(600) {
                bail!("pmstack daemon {pid} is still draining the log after 10 minutes");
            }
            shown.tick(|| {
                format!(
                    "writing the log back into the lower directory ({live}{} s)",
                    t0.elapsed().as_secs()
                )
            });
            std::thread::sleep(Duration::from_millis(20));
        }
        shown.done();
        let stats = fs::read_to_string(state.with_extension("stats")).unwrap_or_default();
        let _ = fs::remove_file(state.with_extension("stats"));
        // The daemon's log file, unless it has something to say.
        let log = state.with_extension("log");
        if fs::metadata(&log).is_ok_and(|m| m.len() == 0) {
            let _ = fs::remove_file(&log);
        }
        let v: serde_json::Value = serde_json::from_str(&stats).unwrap_or_default();
        eprintln!(
            "pmstack: unmounted {}; log drained: {} bytes of live log written back to the lower file system in {} ms ({} write-backs while mounted, {} syncs absorbed)",
            mp.display(),
            v["drained_bytes"].as_u64().unwrap_or(0),
            v["drain_ms"].as_u64().unwrap_or(0),
            v["writebacks"].as_u64().unwrap_or(0),
            v["absorbed_fsync"].as_u64().unwrap_or(0)
                + v["absorbed_fsyncdir"].as_u64().unwrap_or(0)
                + v["absorbed_osync"].as_u64().unwrap_or(0)
        );
    }
    Ok(())
}

fn format_cmd(pm: &Path, size: u64, lower: &Path, force: bool) -> Result<()> {
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

fn check(pm: &Path, json: bool, entries: bool) -> Result<()> {
    let r = MappedRegion::open(pm, 0)?;
    let s = scan(&r).map_err(|e| anyhow!("PM region {}: {e}", pm.display()))?;
    let plan = s.plan(&r);
    let live: Vec<_> = s.live_entries().collect();
    let mut per_file: std::collections::BTreeMap<u64, usize> = Default::default();
    for e in &live {
        *per_file.entry(e.rec.fid()).or_default() += 1;
    }
    let used = s.used_pages().len();
    let mut problems = s.problems.clone();
    if let Err(p) = &plan {
        if !problems.contains(p) {
            problems.push(p.clone());
        }
    }
    let out = serde_json::json!({
        "version": s.sb.version,
        "region_bytes": s.sb.region_bytes,
        "uuid": uuid::Uuid::from_bytes(s.sb.uuid).to_string(),
        "lower_id": uuid::Uuid::from_bytes(s.sb.lower_id).to_string(),
        "pm_kind": r.kind().name(),
        "flush": pmstack::pmem::flush::flush_kind().name(),
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

fn recover_cmd(pm: &Path, lower: &Path) -> Result<()> {
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

fn stat(mp: &Path, json: bool) -> Result<()> {
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

/// `pmstack stat` for people: one counter per line, bytes and durations in units, nested
/// groups indented, one line per attached process.
fn human_stats(v: &serde_json::Value, indent: usize) -> String {
    use serde_json::Value;
    fn scalar(k: &str, v: &Value) -> String {
        match (v, v.as_u64()) {
            (_, Some(n)) if k.contains("bytes") => human_bytes(n),
            (_, Some(n)) if k.ends_with("_us") => human_us(n),
            (_, Some(n)) if k.ends_with("_ms") => human_us(n.saturating_mul(1000)),
            (Value::String(s), _) => s.clone(),
            (Value::Null, _) => "-".into(),
            _ => v.to_string(),
        }
    }
    let mut out = String::new();
    let pad = " ".repeat(indent);
    let Some(m) = v.as_object() else {
        return format!("{pad}{v}\n");
    };
    for (k, v) in m {
        match v {
            Value::Object(_) => {
                out += &format!("{pad}{k}:\n");
                out += &human_stats(v, indent + 2);
            }
            Value::Array(a) if a.iter().all(|e| e.is_object()) => {
                out += &format!("{pad}{k}: {}\n", a.len());
                for e in a {
                    let line: Vec<String> = e
                        .as_object()
                        .into_iter()
                        .flatten()
                        .map(|(k, v)| format!("{k} {}", scalar(k, v)))
                        .collect();
                    out += &format!("{pad}  - {}\n", line.join(", "));
                }
            }
            _ => {
                out += &format!(
                    "{pad}{:width$} {}\n",
                    k,
                    scalar(k, v),
                    width = 28usize.saturating_sub(indent)
                )
            }
        }
    }
    out
}

/// Progress of a long step (recovery, the unmount's drain), shown once it has taken more than
/// a second: a line rewritten in place on a terminal, a line every few seconds otherwise (a
/// log file or the journal).
struct Progress {
    what: &'static str,
    start: Instant,
    last: std::sync::Mutex<Option<Instant>>,
    terminal: bool,
}

impl Progress {
    fn new(what: &'static str) -> Self {
        use std::io::IsTerminal;
        Progress {
            what,
            start: Instant::now(),
            last: std::sync::Mutex::new(None),
            terminal: std::io::stderr().is_terminal(),
        }
    }

    fn tick(&self, text: impl FnOnce() -> String) {
        if self.start.elapsed() < Duration::from_secs(1) {
            return;
        }
        let every = if self.terminal {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(5)
        };
        let Ok(mut last) = self.last.lock() else {
            return;
        };
        if last.is_some_and(|l| l.elapsed() < every) {
            return;
        }
        *last = Some(Instant::now());
        if self.terminal {
            eprint!("\rpmstack: {}: {}\x1b[K", self.what, text());
        } else {
            eprintln!("pmstack: {}: {}", self.what, text());
        }
    }

    /// Ends the line rewritten in place, if one was shown.
    fn done(&self) {
        if self.terminal && self.last.lock().is_ok_and(|l| l.is_some()) {
            eprintln!();
        }
    }
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{x:.1} {}", UNITS[u])
    }
}

fn human_us(us: u64) -> String {
    match us {
        0..=999 => format!("{us} µs"),
        1000..=999_999 => format!("{:.1} ms", us as f64 / 1e3),
        _ => format!("{:.2} s", us as f64 / 1e6),
    }
}

// ---------------- demo ----------------

fn self_exe() -> PathBuf {
    std::env::current_exe().expect("current exe")
}

/// One run of the sync-heavy workload in `dir`: `ops` times (4 KiB write at a random offset
/// of a 4 MiB file + fdatasync), then creates with file+dir fsync. Returns ops per second.
fn workload(dir: &Path, ops: usize, seed: u64) -> Result<f64> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(dir.join("data.bin"))?;
    f.set_len(4 << 20)?;
    let buf = vec![seed as u8; 4096];
    let t0 = Instant::now();
    use std::os::unix::fs::FileExt;
    for _ in 0..ops {
        let off = rng.gen_range(0..1024u64) * 4096;
        f.write_all_at(&buf, off)?;
        f.sync_data()?;
    }
    let d = fs::File::open(dir)?;
    for k in 0..ops / 8 {
        let p = dir.join(format!("m{seed}-{k}"));
        let mut g = fs::File::create(&p)?;
        g.write_all(b"mail")?;
        g.sync_all()?;
        d.sync_all()?;
        fs::remove_file(&p)?;
    }
    Ok((ops + ops / 8) as f64 / t0.elapsed().as_secs_f64())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

fn demo(dir: &Path, ops: usize, reps: usize) -> Result<()> {
    let base = tempfile_dir(dir)?;
    let lower = base.join("lower");
    let mnt = base.join("mnt");
    let plain = base.join("plain");
    for d in [&lower, &mnt, &plain] {
        fs::create_dir_all(d)?;
    }
    let pm = base.join("region.pm");
    let pm = if Path::new("/dev/shm").is_dir() {
        PathBuf::from(format!("/dev/shm/pmstack-demo-{}.pm", std::process::id()))
    } else {
        pm
    };
    println!(
        "pmstack demo: lower {} (on {}), PM {} (emulated)",
        lower.display(),
        dir.display(),
        pm.display()
    );
    let st = std::process::Command::new(self_exe())
        .args(["mount", "--pm"])
        .arg(&pm)
        .arg(&lower)
        .arg(&mnt)
        .status()?;
    if !st.success() {
        let _ = fs::remove_dir_all(&base);
        bail!("mount failed");
    }
    let res = (|| -> Result<(f64, f64)> {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for r in 0..reps {
            // Interleaved: lower alone, then through pmstack, same workload and seed.
            a.push(workload(&plain, ops, r as u64)?);
            b.push(workload(&mnt, ops, r as u64)?);
            println!(
                "  round {}: lower alone {:.0} ops/s, through pmstack {:.0} ops/s",
                r + 1,
                a[r],
                b[r]
            );
        }
        Ok((median(&mut a), median(&mut b)))
    })();
    let expect = fs::read(mnt.join("data.bin")).ok();
    let st = std::process::Command::new(self_exe())
        .arg("umount")
        .arg(&mnt)
        .status()?;
    let (a, b) = res?;
    if !st.success() {
        bail!("umount failed");
    }
    let got = fs::read(lower.join("data.bin"))?;
    let ok = expect.as_deref() == Some(got.as_slice());
    let _ = fs::remove_file(&pm);
    let _ = fs::remove_dir_all(&base);
    println!("sync-heavy workload (4 KiB write + fdatasync, create + fsync(file) + fsync(dir)); median of {reps}:");
    println!("  lower alone:      {a:>10.0} ops/s");
    println!("  through pmstack:  {b:>10.0} ops/s");
    println!("  ratio pmstack / lower: {:.2}x", b / a);
    println!(
        "  after unmount, lower holds exactly what was written: {}",
        if ok { "yes" } else { "NO" }
    );
    if !ok {
        bail!("lower content differs from what was written through the mount");
    }
    Ok(())
}

fn tempfile_dir(parent: &Path) -> Result<PathBuf> {
    let p = parent.join(format!(
        "pmstack-demo-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    ));
    fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
    Ok(p)
}

// ---------------- serve / run ----------------

/// Answer one request to a metrics endpoint (`mount` and `serve --metrics-addr`): GET
/// /metrics gets the Prometheus text `body` makes, anything else a 404 that says where it is.
fn answer_metrics(req: tiny_http::Request, body: impl FnOnce() -> String) {
    let path = req.url().split('?').next().unwrap_or("");
    let resp = if path == "/metrics" && *req.method() == tiny_http::Method::Get {
        tiny_http::Response::from_string(body()).with_header(
            tiny_http::Header::from_bytes(
                &b"Content-Type"[..],
                &b"text/plain; version=0.0.4; charset=utf-8"[..],
            )
            .expect("static header"),
        )
    } else {
        tiny_http::Response::from_string("pmstack: metrics are at /metrics\n").with_status_code(404)
    };
    let _ = req.respond(resp);
}

fn serve_cmd(a: ServeArgs) -> Result<()> {
    use pmstack::front::serve::{check_previous, Daemon, ServeOpts};
    // Signals first: a SIGTERM at any point from here on is a clean stop, not a kill.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [libc::SIGINT, libc::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
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
        // The daemon's write-back is one syncfs; over a lower that ignores it (a FUSE or
        // network file system) that would expire entries the lower never made durable.
        bail!("{} is on a file system that does not honour syncfs (a FUSE or network file system); `pmstack serve` cannot write back safely there: use `pmstack mount`, which fsyncs each changed object", root.display());
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
        let r = serve_loop(&d, &root, &pm, &sock, &table, &stats, &stop);
        watch_stop.store(true, std::sync::atomic::Ordering::Relaxed);
        r
    })
}

fn serve_loop(
    d: &pmstack::front::serve::Daemon,
    root: &Path,
    pm: &Path,
    sock: &Path,
    table: &Path,
    stats: &Path,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<()> {
    d.listen(sock, table)?;
    eprintln!(
        "pmstack: serving {} (region {}); run programs with `pmstack run --root {} -- CMD`",
        root.display(),
        pm.display(),
        root.display()
    );
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    d.run(stop, stats);
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    let _ = fs::remove_file(sock);
    let clean = d.shutdown().context("final write-back")?;
    let _ = write_atomic(stats, &d.stats_json().to_string());
    if clean {
        // Nobody maps the table any more (processes still attached would keep it).
        let _ = fs::remove_file(table);
        eprintln!("pmstack: stopped; {} is complete", root.display());
    } else {
        eprintln!("pmstack: stopped; processes are still attached (they now use the lower file system's fsync); the region is left for recovery at the next start");
    }
    Ok(())
}

/// The preload library: $PMSTACK_PRELOAD, beside the binary, or in ../lib/pmstack.
fn preload_lib() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PMSTACK_PRELOAD").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!(
                "PMSTACK_PRELOAD={}: no such library (unset it to use the one beside pmstack)",
                p.display()
            );
        }
        return Ok(p);
    }
    let exe = self_exe();
    let dir = exe.parent().unwrap_or(Path::new("/"));
    for c in [
        dir.join("libpmstack_preload.so"),
        dir.join("../lib/pmstack/libpmstack_preload.so"),
    ] {
        if c.exists() {
            return Ok(fs::canonicalize(c)?);
        }
    }
    bail!(
        "libpmstack_preload.so not found beside {} (build it with `cargo build --release --workspace`, or set PMSTACK_PRELOAD)",
        exe.display()
    )
}

fn run_cmd(a: RunArgs) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let root = fs::canonicalize(&a.root).with_context(|| format!("--root {}", a.root.display()))?;
    let lib = preload_lib()?;
    let (sock, _, stats) = pmstack::front::paths(&root);
    // Ask the daemon whether this user may attach (it answers `ok` or `refused WHY`).
    let conn = std::os::unix::net::UnixStream::connect(&sock).and_then(|mut c| {
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        c.write_all(b"probe\n")?;
        let mut answer = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(c), &mut answer)?;
        match answer.strip_prefix("refused ") {
            Some(why) => Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                why.trim().to_string(),
            )),
            None if answer.trim() == "ok" => Ok(()),
            None => Err(std::io::Error::other("the daemon did not answer")),
        }
    });
    let served = conn.is_ok();
    // Why there is no daemon to attach to, as precisely as the error tells.
    let why = match &conn {
        Err(e)
            if e.kind() == std::io::ErrorKind::PermissionDenied && e.raw_os_error().is_none() =>
        {
            e.to_string()
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            let me = creds::user_with_id(creds::euid())
                .map(|u| u.name)
                .unwrap_or_default();
            format!(
                "the pmstack daemon of {} does not serve user {me} (permission denied on {}): its PM log holds file data, so a daemon serves one user's programs; if {me}'s programs own that directory, serve it with `pmstack serve {} --user {me}` instead",
                root.display(),
                sock.display(),
                root.display()
            )
        }
        _ => format!(
            "no pmstack daemon serves {} (start `pmstack serve {}`)",
            root.display(),
            root.display()
        ),
    };
    if !served && a.require_daemon {
        bail!("{why}");
    }
    if !served {
        warn_user(&format!("{why}; the program runs natively"));
    } else if let Some(pm) = &a.pm {
        let want = fs::canonicalize(pm)?;
        let info: serde_json::Value = fs::read_to_string(&stats)
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or_default();
        if info["pm"].as_str().is_some_and(|p| Path::new(p) != want) {
            bail!(
                "{} is served with region {}, not {}",
                root.display(),
                info["pm"].as_str().unwrap_or("?"),
                want.display()
            );
        }
    }
    let mut pre = lib.into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD") {
        pre.push(":");
        pre.push(old);
    }
    let err = std::process::Command::new(&a.cmd[0])
        .args(&a.cmd[1..])
        .env("LD_PRELOAD", pre)
        .env("PMSTACK_ROOT", &root)
        .env("PMSTACK_SOCKET", &sock)
        .exec();
    bail!("cannot run {}: {err}", a.cmd[0].to_string_lossy())
}
