//! Prometheus text exposition (format 0.0.4) of the counters `pmstack stat` shows, plus the
//! request latency histograms.
//!
//! Rendered here rather than through a metrics crate: the counters already live in the core's
//! atomics and in the stats map `pmstack stat` prints, and the exposition format is a handful
//! of line rules; one renderer over that map keeps the endpoint and `stat` identical. The test
//! parses the output with an independent parser (`prometheus-parse`).

use std::fmt::Write;
use std::sync::atomic::Ordering;

use crate::core::stats::{Latency, Op, BUCKETS_US};

/// Whether a number only grows (a count since start) or is a level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

/// What a number counts: `stat` prints bytes and durations in units, the Prometheus endpoint
/// turns microseconds into seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Count,
    Bytes,
    Micros,
    Millis,
    Ratio,
    Lsn,
}

/// Which front end reports a number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Mount,
    Serve,
    Both,
}

/// One number pmstack reports: its key in `pmstack stat --json`, kind, unit, who reports it
/// and what it means. `METRICS` is the one definition from which `stat`, `--json`, the
/// Prometheus endpoint and `docs/metrics.md` are made.
#[derive(Debug)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    pub unit: Unit,
    pub source: Source,
    pub help: &'static str,
}

const fn m(
    name: &'static str,
    kind: Kind,
    unit: Unit,
    source: Source,
    help: &'static str,
) -> Metric {
    Metric {
        name,
        kind,
        unit,
        source,
        help,
    }
}

use Kind::{Counter, Gauge};
use Source::{Both, Mount, Serve};
use Unit::{Bytes, Count, Lsn, Micros, Millis, Ratio};

/// Every number in the stats map of a mount (`pmstack stat MOUNTPOINT`) and of a served
/// directory (`pmstack stat DIR`; per attached process and in `totals`).
pub const METRICS: &[Metric] = &[
    m("absorbed_fsync", Counter, Count, Both, "fsync/fdatasync calls answered from the PM log without a disk flush"),
    m("absorbed_dir_fsync", Counter, Count, Both, "directory fsyncs answered from the PM log"),
    m("absorbed_osync", Counter, Count, Both, "O_SYNC/O_DSYNC writes made durable in the PM log"),
    m("eager_writes", Counter, Count, Both, "writes logged at write time (O_SYNC, active sync, live pages, adaptive eager)"),
    m("ns_ops", Counter, Count, Both, "namespace operations logged (create, unlink, rename, link, ...)"),
    m("real_syncs", Counter, Count, Both, "syncs made by the lower file system's own fsync instead of the log (PM full; under pmstack run also writes the library cannot see)"),
    m("writebacks", Counter, Count, Both, "write-back rounds (lower syncfs + checkpoint + GC)"),
    m("writeback_errors", Counter, Count, Both, "failed write-back rounds (retried)"),
    m("writeback_us", Counter, Micros, Both, "time spent in write-back"),
    m("objects_synced", Counter, Count, Serve, "objects the write-back fsynced one by one (a lower that ignores syncfs)"),
    m("active_sync_switches", Counter, Count, Mount, "files switched to eager logging by active sync"),
    m("throttles", Counter, Count, Mount, "strict mode: writers that waited for write-back (PM full)"),
    m("adaptive_hits", Counter, Count, Mount, "adaptive: eager/lazy predictions that proved right"),
    m("adaptive_misses", Counter, Count, Mount, "adaptive: blocks predicted lazy that were synced"),
    m("adaptive_wasted", Counter, Count, Mount, "adaptive: blocks logged eagerly that no sync needed"),
    m("adaptive_to_eager", Counter, Count, Mount, "adaptive: blocks switched to eager"),
    m("adaptive_to_lazy", Counter, Count, Mount, "adaptive: blocks switched to lazy"),
    m("adaptive_blocks_eager", Gauge, Count, Mount, "adaptive: blocks currently predicted eager"),
    m("adaptive_blocks_lazy", Gauge, Count, Mount, "adaptive: blocks currently predicted lazy"),
    m("adaptive_prediction_hit_rate", Gauge, Ratio, Mount, "adaptive: share of correct eager/lazy predictions"),
    m("node_fds_evicted", Counter, Count, Mount, "inode descriptors closed to stay under the limit (reopened by handle)"),
    m("node_fds_open", Gauge, Count, Mount, "inode descriptors open now"),
    m("node_fds_max", Gauge, Count, Mount, "the limit on open inode descriptors"),
    m("readback_bytes", Counter, Bytes, Mount, "dirty bytes an fsync read back from the lower file system to log them (no copy in memory)"),
    m("log_commits", Counter, Count, Mount, "log commits (one per synchronous operation)"),
    m("log_entries", Counter, Count, Mount, "log entries appended"),
    m("log_bytes_inplace", Counter, Bytes, Mount, "bytes logged inside log entries"),
    m("log_bytes_outofplace", Counter, Bytes, Mount, "bytes logged as whole out-of-place pages"),
    m("gc_runs", Counter, Count, Mount, "garbage-collection passes over the log"),
    m("gc_pages_freed", Counter, Count, Mount, "PM pages reclaimed by garbage collection"),
    m("pm_full_events", Counter, Count, Mount, "appends that found PM full"),
    m("pm_bytes_used", Gauge, Bytes, Mount, "PM bytes holding live log data"),
    m("pm_bytes_free", Gauge, Bytes, Mount, "PM bytes free for the log"),
    m("drained_bytes", Gauge, Bytes, Mount, "at unmount: live log bytes written back to the lower file system"),
    m("drain_ms", Gauge, Millis, Mount, "at unmount: time the final write-back took"),
    m("bytes_logged", Counter, Bytes, Serve, "bytes of data logged"),
    m("ns_write_backs", Counter, Count, Serve, "directory syncs made by writing the namespace back (a change the log did not see)"),
    m("ns_dir_write_backs", Counter, Count, Serve, "namespace write-backs that synced only the directories concerned (no live namespace record named them), not the whole file system"),
    m("name_syncs", Counter, Count, Serve, "real syncs of new files that also fsynced directories of their path whose names may not have been durable (a lower that ignores syncfs, whose fsync of a file may leave its name behind)"),
    m("unlogged_ns_ops", Counter, Count, Serve, "namespace operations not logged (a rename or link across the served directory's boundary, a path with a trailing slash, a descriptor linked, a flag not modelled) made durable by fsyncing their directories under it"),
    m("unserved", Counter, Count, Serve, "operations of attached processes that found the daemon not serving and ran on the lower file system alone"),
    m("attaches", Counter, Count, Serve, "processes that attached"),
    m("attaches_refused", Counter, Count, Serve, "attach requests refused (another user, no free append area)"),
    m("attached_processes", Gauge, Count, Serve, "processes attached now"),
    m("leases_reclaimed", Counter, Count, Serve, "append areas taken back from processes that died"),
    m("watched_opens", Counter, Count, Serve, "opens for writing by processes outside pmstack run, seen by the watch"),
    m("watch_event_errors", Counter, Count, Serve, "open events of watched objects the kernel could not open a descriptor of for the daemon (ESTALE on a network lower: a file removed under the open); the kernel failed those opens with EPERM, and the watch went on"),
    m("foreign_writers", Counter, Count, Serve, "objects written by a process outside pmstack run (their syncs stay real)"),
    m("objects_vetted", Counter, Count, Serve, "objects checked for writers outside pmstack run before their syncs were absorbed"),
    m("marks", Counter, Count, Serve, "objects the watch started to follow"),
    m("unmarks", Counter, Count, Serve, "objects the watch stopped following"),
    m("marks_vetted", Counter, Count, Serve, "watched objects checked for writers from before they were watched"),
    m("slots", Gauge, Count, Serve, "slots of the shared table: objects that can be tracked at once (`serve --table-slots`)"),
    m("slots_used", Gauge, Count, Serve, "slots of the shared table holding an object now; past half of them, the daemon frees those of objects nothing needs tracked (closed, nothing live in the log)"),
    m("slots_freed", Counter, Count, Serve, "slots of the shared table freed (the object is tracked anew, in a new slot, if it is used again)"),
    m("slot_claims_refused", Counter, Count, Serve, "times an attached process found no free slot for an object (raise --table-slots): the object ran on the lower alone, untracked, and the daemon's vetting counts such processes as writers it cannot see"),
    m("baselines_logged", Counter, Count, Serve, "first syncs of an object since it was vetted absorbed by logging the whole file (at most 256 KiB) instead of the lower file system's own fsync"),
    m("vetted_at_open", Counter, Count, Serve, "objects vetted by the process that opened them, at the open (a lease test: no other open file writes or reads the object), without the daemon's scan of /proc"),
    m("baselines_from_snapshots", Counter, Count, Serve, "of baselines_logged, those built from the file as read when it was vetted at its open, with the process's unsynced bytes over it, instead of reading it back at the sync (a FUSE or network lower, whose reads after writes are slow)"),
    m("baseline_name_write_backs", Counter, Count, Serve, "of the first syncs about to be logged whole, those whose directory had a change that was not logged (a file made outside pmstack run or before the daemon started): the namespace was written back first so that the file's name is durable; also absorbed syncs after a namespace operation run as the lower's own, whose file's directory was so"),
    m("unsynced_ns_ops", Counter, Count, Serve, "namespace operations of attached processes that had synced nothing under the root, run as the lower's own instead of logged (an untar, a build, `rm -rf`; made durable before the process's first logged one; `serve --log-unsynced-names` turns it off)"),
    m("dirs_settled", Counter, Count, Serve, "times a directory with changes the log lacks (made outside pmstack run, or before the daemon started) was taken for clean because a write-back of the whole file system after those changes made them durable (a journaled ext4; `serve --no-settle` turns it off): a namespace write-back or a real directory fsync it saved"),
    m("syncs_from_copies", Counter, Count, Serve, "absorbed syncs whose unsynced bytes all came from copies kept when they were written, none read back from the lower (a FUSE or network lower, whose reads after writes are slow)"),
    m("areas_leased", Gauge, Count, Serve, "append areas of the PM log leased to processes now"),
    m("lsn", Gauge, Lsn, Both, "the log's next sequence number"),
    m("recovery.namespace_ops", Gauge, Count, Both, "recovery at start: namespace records evaluated"),
    m("recovery.recreated", Gauge, Count, Both, "recovery at start: objects created again (the lower had lost them)"),
    m("recovery.namespace_skipped", Gauge, Count, Both, "recovery at start: namespace records the lower already held"),
    m("recovery.file_ops", Gauge, Count, Both, "recovery at start: data and attribute records replayed"),
    m("recovery.bytes_replayed", Gauge, Bytes, Both, "recovery at start: bytes replayed onto the lower file system"),
    m("recovery.bytes_direct", Gauge, Bytes, Both, "recovery at start: of the bytes replayed, those written with O_DIRECT (long runs of whole pages on a local lower)"),
    m("recovery.files", Gauge, Count, Both, "recovery at start: files replayed into"),
    m("recovery.unresolved_files", Gauge, Count, Both, "recovery at start: files deleted after their records (nothing to replay into)"),
    m("recovery.duration_ms", Gauge, Millis, Both, "recovery at start: how long it took (0: none was needed)"),
    m("latency_us.count", Counter, Count, Mount, "FUSE requests of a kind served"),
    m("latency_us.mean_us", Gauge, Micros, Mount, "mean time to serve a FUSE request of a kind"),
    m("latency_us.p50_us_le", Gauge, Micros, Mount, "median time to serve a FUSE request of a kind (bucket bound)"),
    m("latency_us.p99_us_le", Gauge, Micros, Mount, "99th percentile time to serve a FUSE request of a kind (bucket bound)"),
    m("checkpoint_lsn", Gauge, Lsn, Both, "entries below this sequence number are written back (equal to `lsn`: nothing live)"),
];

/// The definition of the number reported as `name`.
pub fn lookup(name: &str) -> Option<&'static Metric> {
    METRICS.iter().find(|m| m.name == name)
}

/// The definition of `key` in a map nested under the top-level key `group` (defined as
/// `group.key`: `recovery.duration_ms`), or as a top-level `key` (the per-process counters
/// of a served directory under `totals` and `attached`).
pub fn lookup_in(group: Option<&str>, key: &str) -> Option<&'static Metric> {
    match group {
        Some(g) => METRICS
            .iter()
            .find(|m| m.name.strip_prefix(g).and_then(|r| r.strip_prefix('.')) == Some(key))
            .or_else(|| lookup(key)),
        None => lookup(key),
    }
}

/// Keys of the stats maps that are not measurements (identities, modes, nested groups).
pub const NOT_METRICS: &[&str] = &[
    "pid",
    "mode",
    "pm",
    "pm_kind",
    "flush",
    "root",
    "user",
    "watching",
    "syncfs_trusted",
    "recovery",
    "latency_us",
    "totals",
    "attached",
];

/// The numbers in a stats map (top level, nested groups, arrays of records) that `METRICS`
/// does not define, by path: empty when every one is.
pub fn undefined_numbers(stats: &serde_json::Value) -> Vec<String> {
    /// `group`: the top-level key a nested map or record list stands under (as `lookup_in`).
    fn walk(v: &serde_json::Value, group: Option<&str>, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    if !x.is_number() {
                        walk(x, Some(group.unwrap_or(k)), out);
                    } else if lookup_in(group, k).is_none() && !NOT_METRICS.contains(&k.as_str()) {
                        out.push(group.map_or_else(|| k.clone(), |g| format!("{g}.{k}")));
                    }
                }
            }
            serde_json::Value::Array(a) => {
                for x in a {
                    walk(x, group, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(stats, None, &mut out);
    out
}

/// The table of `docs/metrics.md`, made from `METRICS`.
pub fn doc_table() -> String {
    let mut out =
        String::from("| key | kind | unit | reported by | meaning |\n|---|---|---|---|---|\n");
    for m in METRICS {
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} | {} |",
            m.name,
            match m.kind {
                Counter => "counter",
                Gauge => "gauge",
            },
            match m.unit {
                Count => "count",
                Bytes => "bytes",
                Micros => "microseconds",
                Millis => "milliseconds",
                Ratio => "ratio",
                Lsn => "sequence number",
            },
            match m.source {
                Mount => "mount",
                Serve => "serve",
                Both => "mount, serve",
            },
            m.help
        );
    }
    out
}

/// The stats map of a mount, as `pmstack stat MOUNTPOINT --json` prints it (the unmount adds
/// `drained_bytes` and `drain_ms`).
pub fn mount_stats(
    core: &crate::core::Core,
    rec: &Option<crate::core::recover::RecoverySummary>,
) -> serde_json::Value {
    let mut m = core.stats.to_json();
    m.insert("latency_us".into(), core.latency.to_json());
    // Inode descriptors are a bounded cache (reopened by file handle when evicted).
    m.insert("node_fds_max".into(), core.node_fds_max.into());
    m.insert(
        "node_fds_open".into(),
        crate::core::node::NODE_FDS_OPEN
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
        m.insert("lsn".into(), l.lsn_now().into());
        m.insert("checkpoint_lsn".into(), l.checkpoint_lsn().into());
        m.insert(
            "pm_bytes_free".into(),
            ((l.pages_free() * crate::engine::format::PAGE) as u64).into(),
        );
        m.insert("pm_full_events".into(), s.full.load(Relaxed).into());
        m.insert("pm_kind".into(), l.pm().kind().name().into());
        m.insert("flush".into(), l.pm().flush_name().into());
    }
    if core.opts.mode == crate::core::Mode::Adaptive {
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

/// One sample `pmstack_{name}` with its HELP and TYPE lines.
fn series(out: &mut String, name: &str, kind: Kind, help: &str, value: f64) {
    let kind = match kind {
        Counter => "counter",
        Gauge => "gauge",
    };
    let _ = writeln!(out, "# HELP pmstack_{name} {help}.");
    let _ = writeln!(out, "# TYPE pmstack_{name} {kind}");
    let _ = writeln!(out, "pmstack_{name} {value}");
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Render the stats map (as `pmstack stat --json` prints it) and the FUSE request latency
/// histograms (a mount's; `pmstack serve` has no requests of its own to time).
pub fn render(stats: &serde_json::Value, latency: Option<&Latency>) -> String {
    let mut out = String::new();
    let empty = serde_json::Map::new();
    let m = stats.as_object().unwrap_or(&empty);
    let mode = m.get("mode").and_then(|v| v.as_str()).unwrap_or("unknown");
    let _ = writeln!(
        out,
        "# HELP pmstack_info The mounted pmstack's mode and version."
    );
    let _ = writeln!(out, "# TYPE pmstack_info gauge");
    let _ = writeln!(
        out,
        "pmstack_info{{mode=\"{}\",version=\"{}\"}} 1",
        escape(mode),
        env!("CARGO_PKG_VERSION")
    );
    for (k, v) in m {
        let Some(x) = v.as_f64() else { continue };
        // Every number the stats maps hold is defined (a test checks both front ends).
        let Some(def) = lookup(k) else { continue };
        let (name, value) = match (def.kind, def.unit) {
            (Gauge, Millis) => (
                format!("{}_seconds", k.strip_suffix("_ms").unwrap_or(k)),
                x / 1e3,
            ),
            (Gauge, _) => (k.clone(), x),
            (Counter, Micros) => (
                format!("{}_seconds_total", k.strip_suffix("_us").unwrap_or(k)),
                x / 1e6,
            ),
            (Counter, _) => (format!("{k}_total"), x),
        };
        series(&mut out, &name, def.kind, def.help, value);
    }
    // Exported as 0 before any recovery happened, so that dashboards and alerts see them.
    {
        let none = serde_json::Map::new();
        let r = m
            .get("recovery")
            .and_then(|v| v.as_object())
            .unwrap_or(&none);
        let f = |k: &str| r.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
        for (name, key, scale) in [
            ("recovery_duration_seconds", "duration_ms", 1e-3),
            ("recovery_file_ops", "file_ops", 1.0),
            ("recovery_namespace_ops", "namespace_ops", 1.0),
            ("recovery_bytes", "bytes_replayed", 1.0),
        ] {
            let help = lookup_in(Some("recovery"), key).map_or("", |m| m.help);
            series(&mut out, name, Gauge, help, f(key) * scale);
        }
    }
    let Some(latency) = latency else {
        return out;
    };
    let name = "pmstack_request_duration_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} Time the daemon spent serving a FUSE request, per kind."
    );
    let _ = writeln!(out, "# TYPE {name} histogram");
    for op in Op::ALL {
        let h = latency.get(op);
        let mut acc = 0u64;
        for (i, b) in h.buckets.iter().enumerate() {
            acc += b.load(Ordering::Relaxed);
            let le = match BUCKETS_US.get(i) {
                Some(us) => format!("{}", *us as f64 / 1e6),
                None => "+Inf".into(),
            };
            let _ = writeln!(
                out,
                "{name}_bucket{{op=\"{}\",le=\"{le}\"}} {acc}",
                op.name()
            );
        }
        let _ = writeln!(
            out,
            "{name}_sum{{op=\"{}\"}} {}",
            op.name(),
            h.sum_ns.load(Ordering::Relaxed) as f64 / 1e9
        );
        // The count equals the +Inf bucket (read once, so the two always agree).
        let _ = writeln!(out, "{name}_count{{op=\"{}\"}} {acc}", op.name());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn every_number_a_mount_reports_is_defined_and_every_mount_metric_is_reported() {
        for mode in [crate::core::Mode::Adaptive, crate::core::Mode::Strict] {
            let dir = tempfile::tempdir_in("/var/tmp").unwrap();
            let (_sim, core) = crate::sim::core_on_sim_pm(dir.path(), 64, 2, mode);
            core.latency
                .get(Op::Fsync)
                .observe(Duration::from_micros(30));
            let rec = Some(crate::core::recover::RecoverySummary::default());
            let stats = mount_stats(&core, &rec);
            assert_eq!(undefined_numbers(&stats), Vec::<String>::new(), "{stats}");
            if mode == crate::core::Mode::Adaptive {
                let reported = |name: &str| match name.split_once('.') {
                    Some(("latency_us", k)) => stats["latency_us"]["fsync"].get(k).is_some(),
                    Some((g, k)) => stats[g].get(k).is_some(),
                    None => stats.get(name).is_some(),
                };
                for m in METRICS.iter().filter(|m| m.source != Source::Serve) {
                    // The unmount adds these to the last stats it leaves.
                    if !["drained_bytes", "drain_ms"].contains(&m.name) {
                        assert!(reported(m.name), "{} is defined but not reported", m.name);
                    }
                }
            }
        }
    }

    #[test]
    fn docs_list_every_metric() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/metrics.md");
        let doc = std::fs::read_to_string(&path).unwrap_or_default();
        let (begin, end) = (
            "<!-- metrics table: made from src/metrics.rs -->\n",
            "<!-- end -->",
        );
        let table = doc
            .split_once(begin)
            .and_then(|(_, r)| r.split_once(end))
            .map(|(t, _)| t);
        if table != Some(doc_table().as_str()) {
            if std::env::var_os("PMSTACK_BLESS").is_some() {
                let (head, tail) = match (doc.split_once(begin), doc.split_once(end)) {
                    (Some((h, _)), Some((_, t))) => (h.to_string(), t.to_string()),
                    _ => (doc.clone(), "\n".to_string()),
                };
                std::fs::write(&path, format!("{head}{begin}{}{end}{tail}", doc_table())).unwrap();
            } else {
                panic!(
                    "docs/metrics.md does not list the metrics src/metrics.rs defines; rerun this test with PMSTACK_BLESS=1 to rewrite its table"
                );
            }
        }
    }

    #[test]
    fn renders_parsable_text() {
        let lat = Latency::default();
        lat.get(Op::Fsync).observe(Duration::from_micros(30));
        lat.get(Op::Fsync).observe(Duration::from_micros(300));
        lat.get(Op::Write).observe(Duration::from_micros(5));
        let stats = serde_json::json!({
            "mode": "sync", "absorbed_fsync": 7, "writeback_us": 2500000,
            "pm_bytes_used": 8192, "adaptive_prediction_hit_rate": 0.75,
            "recovery": {"duration_ms": 12, "file_ops": 3, "namespace_ops": 2, "bytes_replayed": 4096, "namespace_skipped": 0},
        });
        let text = render(&stats, Some(&lat));
        let lines = text.lines().map(|l| Ok(l.to_string()));
        let scrape = prometheus_parse::Scrape::parse(lines).expect("parsable");
        let get = |n: &str| {
            scrape
                .samples
                .iter()
                .find(|s| s.metric == n)
                .unwrap_or_else(|| panic!("{n} missing in\n{text}"))
        };
        let val = |n: &str| match get(n).value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            ref o => panic!("{n}: {o:?}"),
        };
        assert_eq!(val("pmstack_absorbed_fsync_total"), 7.0);
        assert_eq!(val("pmstack_writeback_seconds_total"), 2.5);
        assert_eq!(val("pmstack_pm_bytes_used"), 8192.0);
        assert_eq!(val("pmstack_recovery_duration_seconds"), 0.012);
        assert_eq!(get("pmstack_info").labels.get("mode"), Some("sync"));
        let fsync = scrape
            .samples
            .iter()
            .find(|s| {
                s.metric == "pmstack_request_duration_seconds"
                    && s.labels.get("op") == Some("fsync")
            })
            .expect("fsync histogram");
        match &fsync.value {
            prometheus_parse::Value::Histogram(b) => {
                let at = |le: f64| {
                    b.iter()
                        .find(|c| c.less_than == le || (c.less_than - le).abs() < 1e-12)
                        .unwrap()
                        .count
                };
                assert_eq!(at(16e-6), 0.0);
                assert_eq!(at(32e-6), 1.0);
                assert_eq!(at(512e-6), 2.0);
                assert_eq!(at(f64::INFINITY), 2.0);
            }
            o => panic!("not a histogram: {o:?}"),
        }
    }

    #[test]
    fn recovery_metrics_are_zero_before_any_recovery_and_serve_renders_without_histograms() {
        let stats = serde_json::json!({"pid": 42, "writebacks": 3, "lsn": 9});
        let text = render(&stats, None);
        let lines = text.lines().map(|l| Ok(l.to_string()));
        let scrape = prometheus_parse::Scrape::parse(lines).expect("parsable");
        let has = |n: &str| scrape.samples.iter().any(|s| s.metric == n);
        assert!(has("pmstack_recovery_duration_seconds"), "{text}");
        assert!(has("pmstack_recovery_bytes"), "{text}");
        assert!(
            has("pmstack_writebacks_total") && has("pmstack_lsn"),
            "{text}"
        );
        assert!(!has("pmstack_pid_total") && !has("pmstack_request_duration_seconds"));
    }
}
