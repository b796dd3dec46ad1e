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
    absorbed_fsyncdir,
    absorbed_osync,
    eager_writes,
    ns_ops,
    fallbacks,
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
);
