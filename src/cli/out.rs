//! What the operator sees: warnings (the terminal, and the log when it is elsewhere), logging,
//! the progress of long steps, and human units for `stat`.

use anyhow::{anyhow, Result};
use pmstack::config::LogTarget;
use pmstack::region::Observer;
use std::time::{Duration, Instant};

/// Where warnings go besides the terminal (set once logging is configured).
pub(super) static LOG_TARGET: std::sync::OnceLock<LogTarget> = std::sync::OnceLock::new();

/// A line for the operator on stderr. Never `eprintln!` in a daemon: it panics when stderr
/// is gone (the terminal closed, the pipe's reader exited), and a daemon must outlive its
/// terminal; the line is then lost, nothing else.
pub(super) fn say(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "pmstack: {msg}");
}

/// A warning the operator must see: on the terminal, and in the log when that is elsewhere.
pub(super) fn warn_user(msg: &str) {
    say(&format!("warning: {msg}"));
    if LOG_TARGET.get().is_some_and(|t| *t != LogTarget::Stderr) {
        tracing::warn!("{msg}");
    }
}

/// Structured logs to stderr, journald or syslog. `PMSTACK_LOG` (a tracing filter) overrides
/// the level, for debugging.
pub(super) fn init_logging(level: &str, target: LogTarget) -> Result<()> {
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

/// The operator's view of a region being opened: lines on stderr, warnings in the log too,
/// and the progress of a recovery.
pub(super) struct Operator {
    pub(super) shown: Progress,
}

impl Observer for Operator {
    fn say(&self, msg: &str) {
        say(msg);
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

/// Progress of a long step (recovery, the unmount's drain), shown once it has taken more than
/// a second: a line rewritten in place on a terminal, a line every few seconds otherwise (a
/// log file or the journal).
pub(super) struct Progress {
    pub(super) what: &'static str,
    pub(super) start: Instant,
    pub(super) last: std::sync::Mutex<Option<Instant>>,
    pub(super) terminal: bool,
}

impl Progress {
    pub(super) fn new(what: &'static str) -> Self {
        use std::io::IsTerminal;
        Progress {
            what,
            start: Instant::now(),
            last: std::sync::Mutex::new(None),
            terminal: std::io::stderr().is_terminal(),
        }
    }

    pub(super) fn tick(&self, text: impl FnOnce() -> String) {
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
            use std::io::Write;
            let _ = write!(
                std::io::stderr(),
                "\rpmstack: {}: {}\x1b[K",
                self.what,
                text()
            );
        } else {
            say(&format!("{}: {}", self.what, text()));
        }
    }

    /// Ends the line rewritten in place, if one was shown.
    pub(super) fn done(&self) {
        if self.terminal && self.last.lock().is_ok_and(|l| l.is_some()) {
            use std::io::Write;
            let _ = writeln!(std::io::stderr());
        }
    }
}

/// `pmstack stat` for people: one counter per line, bytes and durations in units, nested
/// groups indented, one line per attached process.
pub(super) fn human_stats(v: &serde_json::Value, indent: usize) -> String {
    human_stats_in(v, indent, None)
}

/// `human_stats` of a map nested under the top-level key `group` (its numbers are defined
/// as `group.key`).
fn human_stats_in(v: &serde_json::Value, indent: usize, group: Option<&str>) -> String {
    use serde_json::Value;
    let scalar = |k: &str, v: &Value| -> String {
        use pmstack::metrics::{lookup_in, Unit};
        let unit = lookup_in(group, k).map(|m| m.unit);
        match (v, v.as_u64()) {
            (_, Some(n)) if unit == Some(Unit::Bytes) => human_bytes(n),
            (_, Some(n)) if unit == Some(Unit::Micros) => human_us(n),
            (_, Some(n)) if unit == Some(Unit::Millis) => human_us(n.saturating_mul(1000)),
            (Value::String(s), _) => s.clone(),
            (Value::Null, _) => "-".into(),
            _ => v.to_string(),
        }
    };
    let mut out = String::new();
    let pad = " ".repeat(indent);
    let Some(m) = v.as_object() else {
        return format!("{pad}{v}\n");
    };
    for (k, v) in m {
        match v {
            Value::Object(_) => {
                out += &format!("{pad}{k}:\n");
                out += &human_stats_in(v, indent + 2, Some(group.unwrap_or(k)));
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

pub(super) fn human_bytes(n: u64) -> String {
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

pub(super) fn human_us(us: u64) -> String {
    match us {
        0..=999 => format!("{us} µs"),
        1000..=999_999 => format!("{:.1} ms", us as f64 / 1e3),
        _ => format!("{:.2} s", us as f64 / 1e6),
    }
}
