//! The `pmstack` command line: mount, umount, format, check, recover, stat, serve, run, demo, man.
//!
//! One file per command; `args` holds the arguments that are more than a flag, `out` what
//! the operator sees, `host` the facts of this host the commands share.

mod args;
mod check;
mod demo;
mod format;
mod host;
mod mount;
mod out;
mod recover;
mod run;
mod serve;
mod stat;
mod umount;

use self::args::{man_pages, mount_helper, parse_size, MountArgs, RunArgs, ServeArgs};
use self::check::check;
use self::demo::demo;
use self::format::format_cmd;
use self::mount::mount;
use self::out::init_logging;
use self::recover::recover_cmd;
use self::run::run_cmd;
use self::serve::serve_cmd;
use self::stat::stat;
use self::umount::umount;
use anyhow::Result;
use clap::{Parser, Subcommand};
use pmstack::config::LogTarget;
use std::path::{Path, PathBuf};

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
