//! Counters of the fs core, reported by `pmstack stat`.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        /// Monotonic counters (names carry units where they have one).
        #[derive(Default, Debug)]
        pub struct Stats { $(pub $name: AtomicU64,)* }

        impl Stats {
            pub fn to_json(&self) -> serde_json::Map<String, serde_json::Value> {
                let mut m = serde_json::Map::new();
                $(m.insert(stringify!($name).into(), self.$name.load(Ordering::Relaxed).into());)*
                m
            }
        }
    };
}

counters!(
    absorbed_fsync,
    absorbed_dir_fsync,
    absorbed_osync,
    eager_writes,
    ns_ops,
    real_syncs,
    writebacks,
    writeback_errors,
    writeback_us,
    active_sync_switches,
    throttles,
    adaptive_hits,
    adaptive_misses,
    adaptive_wasted,
    adaptive_to_eager,
    adaptive_to_lazy,
    node_fds_evicted,
    readback_bytes,
);

/// Request kinds timed by the FUSE adapter (one latency histogram each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Lookup,
    Getattr,
    Setattr,
    Open,
    Read,
    Write,
    Flush,
    Release,
    Fsync,
    Fsyncdir,
    Create,
    Mkdir,
    Unlink,
    Rmdir,
    Rename,
    Link,
    Symlink,
    Readdir,
    Xattr,
    Other,
}

impl Op {
    pub const ALL: [Op; 20] = [
        Op::Lookup,
        Op::Getattr,
        Op::Setattr,
        Op::Open,
        Op::Read,
        Op::Write,
        Op::Flush,
        Op::Release,
        Op::Fsync,
        Op::Fsyncdir,
        Op::Create,
        Op::Mkdir,
        Op::Unlink,
        Op::Rmdir,
        Op::Rename,
        Op::Link,
        Op::Symlink,
        Op::Readdir,
        Op::Xattr,
        Op::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Lookup => "lookup",
            Op::Getattr => "getattr",
            Op::Setattr => "setattr",
            Op::Open => "open",
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Release => "release",
            Op::Fsync => "fsync",
            Op::Fsyncdir => "fsyncdir",
            Op::Create => "create",
            Op::Mkdir => "mkdir",
            Op::Unlink => "unlink",
            Op::Rmdir => "rmdir",
            Op::Rename => "rename",
            Op::Link => "link",
            Op::Symlink => "symlink",
            Op::Readdir => "readdir",
            Op::Xattr => "xattr",
            Op::Other => "other",
        }
    }
}

/// Upper bounds of the latency buckets, in microseconds (powers of two, 1 µs … ~8.4 s); the
/// last bucket is +Inf.
pub const BUCKETS_US: [u64; 24] = {
    let mut b = [0u64; 24];
    let mut i = 0;
    while i < 24 {
        b[i] = 1 << i;
        i += 1;
    }
    b
};

/// A lock-free latency histogram (per-bucket counts, not cumulative).
#[derive(Default, Debug)]
pub struct Histogram {
    pub buckets: [AtomicU64; 25],
    pub sum_ns: AtomicU64,
    pub count: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: std::time::Duration) {
        let ns = d.as_nanos().min(u64::MAX as u128) as u64;
        let us = ns.div_ceil(1000);
        let idx = BUCKETS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(BUCKETS_US.len());
        self.buckets[idx].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// The bucket bound (µs) at or below which a share `q` of the observations lies; `None`
    /// when empty, `u64::MAX` for the +Inf bucket.
    pub fn quantile_us(&self, q: f64) -> Option<u64> {
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let want = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut acc = 0;
        for (i, c) in counts.iter().enumerate() {
            acc += c;
            if acc >= want {
                return Some(BUCKETS_US.get(i).copied().unwrap_or(u64::MAX));
            }
        }
        Some(u64::MAX)
    }
}

/// One histogram per request kind.
#[derive(Default, Debug)]
pub struct Latency {
    pub per_op: [Histogram; 20],
}

impl Latency {
    pub fn get(&self, op: Op) -> &Histogram {
        &self.per_op[op as usize]
    }

    /// `{op: {count, mean_us, p50_us, p99_us}}` for the kinds seen so far.
    pub fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for op in Op::ALL {
            let h = self.get(op);
            let n = h.count.load(Ordering::Relaxed);
            if n == 0 {
                continue;
            }
            m.insert(
                op.name().into(),
                serde_json::json!({
                    "count": n,
                    "mean_us": h.sum_ns.load(Ordering::Relaxed) as f64 / n as f64 / 1000.0,
                    "p50_us_le": h.quantile_us(0.5),
                    "p99_us_le": h.quantile_us(0.99),
                }),
            );
        }
        serde_json::Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn histogram_buckets_and_quantiles() {
        let h = Histogram::default();
        assert_eq!(h.quantile_us(0.5), None);
        for _ in 0..98 {
            h.observe(Duration::from_micros(3)); // bucket le=4
        }
        h.observe(Duration::from_micros(100)); // le=128
        h.observe(Duration::from_secs(100)); // +Inf
        assert_eq!(h.buckets[2].load(Ordering::Relaxed), 98);
        assert_eq!(h.buckets[7].load(Ordering::Relaxed), 1);
        assert_eq!(h.buckets[24].load(Ordering::Relaxed), 1);
        assert_eq!(h.count.load(Ordering::Relaxed), 100);
        assert_eq!(h.quantile_us(0.5), Some(4));
        assert_eq!(h.quantile_us(0.99), Some(128));
        assert_eq!(h.quantile_us(1.0), Some(u64::MAX));
        // Exactly on a bound goes into that bucket.
        let h = Histogram::default();
        h.observe(Duration::from_micros(1));
        h.observe(Duration::from_nanos(1500));
        assert_eq!(h.buckets[0].load(Ordering::Relaxed), 1);
        assert_eq!(h.buckets[1].load(Ordering::Relaxed), 1);
    }
}
