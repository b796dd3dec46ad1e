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

/// Keys of the stats map that are levels, not monotonic counts.
const GAUGES: &[&str] = &[
    "pm_bytes_used",
    "pm_bytes_free",
    "pm_bytes_total",
    "adaptive_blocks_eager",
    "adaptive_blocks_lazy",
    "adaptive_prediction_hit_rate",
    "open_inodes",
    "areas_leased",
    "attached_processes",
    "lsn",
    "checkpoint_lsn",
];

/// Keys that are identities, not measurements.
const NOT_METRICS: &[&str] = &["pid"];

fn help(key: &str) -> &'static str {
    match key {
        "absorbed_fsync" => "fsync/fdatasync calls answered from the PM log without a disk flush",
        "absorbed_fsyncdir" => "directory fsyncs answered from the PM log",
        "absorbed_osync" => "O_SYNC/O_DSYNC writes made durable in the PM log",
        "eager_writes" => {
            "writes logged at write time (O_SYNC, active sync, live pages, adaptive eager)"
        }
        "ns_ops" => "namespace operations logged (create, unlink, rename, link, ...)",
        "unserved" => {
            "operations of attached processes that found the daemon not serving and ran on the lower file system alone"
        }
        "fallbacks" => "syncs that fell back to the lower file system's fsync (PM full)",
        "writebacks" => "write-back rounds (lower syncfs + checkpoint + GC)",
        "writeback_errors" => "failed write-back rounds (retried)",
        "writeback_us" => "time spent in write-back",
        "readback_bytes" => {
            "dirty bytes an fsync read back from the lower file system to log them (no copy in memory)"
        }
        "active_sync_switches" => "files switched to eager logging by active sync",
        "throttles" => "strict mode: writers that waited for write-back (PM full)",
        "log_commits" => "log commits (one per synchronous operation)",
        "log_entries" => "log entries appended",
        "log_bytes_inplace" => "bytes logged inside log entries",
        "log_bytes_outofplace" => "bytes logged as whole out-of-place pages",
        "gc_runs" => "garbage-collection passes over the log",
        "gc_pages_freed" => "PM pages reclaimed by garbage collection",
        "pm_full_events" => "appends that found PM full",
        "pm_bytes_used" => "PM bytes holding live log data",
        "pm_bytes_free" => "PM bytes free for the log",
        "adaptive_blocks_eager" => "adaptive: blocks currently predicted eager",
        "adaptive_blocks_lazy" => "adaptive: blocks currently predicted lazy",
        "adaptive_prediction_hit_rate" => "adaptive: share of correct eager/lazy predictions",
        _ => "pmstack counter",
    }
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
        if NOT_METRICS.contains(&k.as_str()) {
            continue;
        }
        if GAUGES.contains(&k.as_str()) {
            let _ = writeln!(out, "# HELP pmstack_{k} {}.", help(k));
            let _ = writeln!(out, "# TYPE pmstack_{k} gauge");
            let _ = writeln!(out, "pmstack_{k} {x}");
        } else if let Some(base) = k.strip_suffix("_us") {
            let _ = writeln!(out, "# HELP pmstack_{base}_seconds_total {}.", help(k));
            let _ = writeln!(out, "# TYPE pmstack_{base}_seconds_total counter");
            let _ = writeln!(out, "pmstack_{base}_seconds_total {}", x / 1e6);
        } else {
            let _ = writeln!(out, "# HELP pmstack_{k}_total {}.", help(k));
            let _ = writeln!(out, "# TYPE pmstack_{k}_total counter");
            let _ = writeln!(out, "pmstack_{k}_total {x}");
        }
    }
    // Exported as 0 before any recovery happened, so that dashboards and alerts see them.
    {
        let none = serde_json::Map::new();
        let r = m
            .get("recovery")
            .and_then(|v| v.as_object())
            .unwrap_or(&none);
        let g = |name: &str, help: &str, v: f64, out: &mut String| {
            let _ = writeln!(out, "# HELP pmstack_{name} {help}.");
            let _ = writeln!(out, "# TYPE pmstack_{name} gauge");
            let _ = writeln!(out, "pmstack_{name} {v}");
        };
        let f = |k: &str| r.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
        g(
            "recovery_duration_seconds",
            "Duration of the recovery run at start (0: none was needed)",
            f("duration_ms") / 1e3,
            &mut out,
        );
        g(
            "recovery_file_ops",
            "Data and attribute records replayed at start",
            f("file_ops"),
            &mut out,
        );
        g(
            "recovery_namespace_ops",
            "Namespace records evaluated at start",
            f("namespace_ops"),
            &mut out,
        );
        g(
            "recovery_bytes",
            "Bytes replayed onto the lower file system at start",
            f("bytes_replayed"),
            &mut out,
        );
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
