//! The command line's arguments that are more than a flag: `mount` (and the mount(8) helper,
//! `mount.fuse.pmstack`), `serve` and `run`, their long help, and the man pages.

use super::mount::mount;
use super::out::init_logging;
use super::Cli;
use anyhow::{anyhow, bail, Result};
use pmstack::config::Settings;
use std::fs;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
#[command(after_long_help = SERVE_HELP)]
pub(super) struct ServeArgs {
    /// The lower directory programs work on.
    pub(super) dir: PathBuf,
    /// PM region (default /dev/shm/pmstack-<id>.pm, emulated: survives a crash of pmstack,
    /// NOT a power loss).
    #[arg(long)]
    pub(super) pm: Option<PathBuf>,
    /// Size of a region created now.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub(super) pm_size: u64,
    /// Write-back period.
    #[arg(long, default_value_t = 5000)]
    pub(super) flush_interval_ms: u64,
    /// Objects the daemon can track at once (files open under the root, files with
    /// entries in the log): a slot of the table in /dev/shm (128 bytes, plus 160 for the
    /// handle) each. Slots of objects nothing needs any more are freed once half are in use;
    /// an object that finds no free slot is not absorbed (its syncs and namespace operations
    /// go to DIR's file system).
    #[arg(long, default_value_t = pmstack::front::table::DEFAULT_SLOTS as u32, value_parser = clap::value_parser!(u32).range(16..=1 << 24))]
    pub(super) table_slots: u32,
    /// Do not watch for writers outside `pmstack run` (fanotify, needs root): you promise
    /// that every process writing DIR runs under `pmstack run`.
    #[arg(long)]
    pub(super) all_writers_attached: bool,
    /// Take a directory with changes the log lacks (a tree made outside `pmstack run`, or
    /// before the daemon started) for clean only by syncing it at its first logged change,
    /// never because a write-back of the whole file system made its changes durable (which
    /// pmstack does over a journaled ext4: see docs/preload.md, "Directories settled").
    #[arg(long)]
    pub(super) no_settle: bool,
    /// Log the namespace operations (create, mkdir, rename, unlink, rmdir, link, symlink) of
    /// programs that have synced nothing under DIR too, so that each is durable when it
    /// returns. By default those of such a program (an untar, a build, `rm -rf`) are the
    /// file system's own until the program syncs anything (see docs/preload.md, "Programs
    /// that sync nothing").
    #[arg(long)]
    pub(super) log_unsynced_names: bool,
    /// Start although another node's pmstack left DIR without a clean shutdown, giving up
    /// what its PM log holds that is not in DIR yet (see docs/distributed.md).
    #[arg(long)]
    pub(super) take_over: bool,
    /// Serve the programs of this user (a name or uid) instead of root's: only their
    /// processes may attach, the region and table become theirs, and recovery replays the
    /// log with their rights. One daemon per user: the log cannot tell whose process wrote
    /// a record.
    #[arg(long, value_name = "USER")]
    pub(super) user: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9465 (default off).
    #[arg(long, value_name = "ADDR")]
    pub(super) metrics_addr: Option<String>,
    #[arg(long, default_value = "info")]
    pub(super) log_level: String,
}

pub(super) const SERVE_HELP: &str = "\
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

pub(super) const RUN_HELP: &str = "\
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
pub(super) struct RunArgs {
    /// The served directory.
    #[arg(long)]
    pub(super) root: PathBuf,
    /// The region the daemon should be serving (checked when given).
    #[arg(long)]
    pub(super) pm: Option<PathBuf>,
    /// Fail instead of running the program natively when no daemon serves ROOT.
    #[arg(long)]
    pub(super) require_daemon: bool,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
    pub(super) cmd: Vec<std::ffi::OsString>,
}

pub(super) const MOUNT_HELP: &str = "\
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
  attr_timeout        attribute and entry (present or absent) cache timeout in seconds, or auto
                      (default: 60 over a local file system, 1 over a network or FUSE one)
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
pub(super) struct MountArgs {
    /// The existing directory to stack over (or `lower` in the config file).
    pub(super) lower: Option<PathBuf>,
    /// Where to mount (or `mountpoint` in the config file).
    pub(super) mountpoint: Option<PathBuf>,
    /// TOML configuration file (keys below); flags and -o options override it.
    #[arg(long, value_name = "PATH")]
    pub(super) config: Option<PathBuf>,
    /// sync (default), strict, adaptive, passthrough.
    #[arg(long, value_name = "MODE")]
    pub(super) mode: Option<String>,
    /// PM region (default: an emulated region in /dev/shm bound to LOWER).
    #[arg(long, value_name = "PATH")]
    pub(super) pm: Option<String>,
    /// Size of a region created on first mount (default 256M).
    #[arg(long, value_name = "SIZE")]
    pub(super) pm_size: Option<String>,
    /// Write-back period in milliseconds (default 5000).
    #[arg(long, value_name = "MS")]
    pub(super) flush_interval_ms: Option<String>,
    /// Start write-back when less than this share of PM is free (default 0.25).
    #[arg(long, value_name = "SHARE")]
    pub(super) low_watermark: Option<String>,
    /// strict: a writer that finds PM full waits until write-back freed this share (0.2).
    #[arg(long, value_name = "SHARE")]
    pub(super) throttle_share: Option<String>,
    /// Active-sync sensitivity, NVLog section 4.4 (default 2).
    #[arg(long, value_name = "N")]
    pub(super) sensitivity: Option<String>,
    /// Attribute and entry cache timeout, in seconds, or auto (default: 60 over a local file
    /// system, 1 over a network or FUSE one); absent names are cached as absent as long.
    #[arg(long, value_name = "SECONDS")]
    pub(super) attr_timeout: Option<String>,
    /// Kernel page cache mode for writes: writethrough (default) or writeback.
    #[arg(long, value_name = "MODE")]
    pub(super) cache: Option<String>,
    /// In passthrough mode, do not use the kernel's FUSE passthrough.
    #[arg(long)]
    pub(super) no_kernel_passthrough: bool,
    /// FUSE worker threads (default 2).
    #[arg(long, value_name = "N")]
    pub(super) threads: Option<String>,
    /// error, warn (default), info, debug, trace, or a tracing filter.
    #[arg(long, value_name = "LEVEL")]
    pub(super) log_level: Option<String>,
    /// stderr (default), journald, syslog.
    #[arg(long, value_name = "TARGET")]
    pub(super) log_target: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9464 (default off).
    #[arg(long, value_name = "ADDR")]
    pub(super) metrics_addr: Option<String>,
    /// Stay in the foreground (for systemd Type=notify units; READY=1 once live).
    #[arg(short, long)]
    pub(super) foreground: bool,
    /// Start although another node's pmstack left LOWER without a clean shutdown, giving up
    /// what its PM log holds that is not in LOWER yet (see docs/distributed.md).
    #[arg(long)]
    pub(super) take_over: bool,
    /// Mount options, comma separated: key=value settings, config=PATH, and flags
    /// (allow_other, ro, noatime, …).
    #[arg(short = 'o', value_name = "OPTIONS")]
    pub(super) options: Option<String>,
}

/// The resolved mount: settings plus the positional paths.
pub(super) struct Mount {
    pub(super) s: Settings,
    pub(super) lower: PathBuf,
    pub(super) mountpoint: PathBuf,
    pub(super) foreground: bool,
    pub(super) take_over: bool,
}

impl MountArgs {
    /// Defaults < config file < -o options < flags; every value validated by one function.
    pub(super) fn resolve(&self) -> Result<Mount> {
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

pub(super) fn parse_size(s: &str) -> Result<u64, String> {
    pmstack::config::parse_size(s)
}

/// `mount.fuse.pmstack SOURCE MOUNTPOINT [-sfnv] [-o OPTIONS] [-t TYPE]`, as mount(8) calls a
/// helper for `-t fuse.pmstack` and for fstab lines of that type.
pub(super) fn mount_helper(args: &[String]) -> Result<()> {
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

/// Write the man pages (pmstack(1), pmstack-SUBCOMMAND(1), mount.fuse.pmstack(8)) into `out`.
pub(super) fn man_pages(out: &Path) -> Result<()> {
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
