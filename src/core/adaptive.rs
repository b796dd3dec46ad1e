//! Adaptive eager/lazy logging (`--mode adaptive`): per block (4 KiB page), decide at write
//! time whether to log the bytes now (eager: the block will probably be synced soon, so the
//! sync finds nothing left to do) or leave them in the lower page cache (lazy: collected at the
//! next fsync, or never logged if write-back comes first).
//!
//! After HiNFS's buffer benefit model: each tracked block counts writes and syncs; a block
//! whose syncs keep up with its writes (at least two syncs, and syncs * 2 >= writes: it is
//! synced at least every other write) is eager. A lazy block found dirty at a sync is a misprediction and is
//! re-evaluated at once; at write-back, an eager block not synced for `decay` goes back to lazy
//! (its logging was wasted). A sync costs O(blocks it touched), not O(blocks tracked). Blocks are tracked in a bounded table; evicted blocks leave a ghost record, and
//! a write to a ghost block starts eager (it was recently hot). Combined with NVLog's per-file
//! active sync by the caller.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

/// Tracked blocks per file; the least recently touched are evicted to the ghost list.
const MAX_BLOCKS: usize = 4096;
const MAX_GHOSTS: usize = 1024;

#[derive(Clone, Copy, Debug)]
struct Block {
    writes: u32,
    syncs: u32,
    eager: bool,
    /// Logged eagerly since the last sync (a correct prediction if a sync comes).
    logged: bool,
    last_write: Instant,
    last_sync: Instant,
}

/// What a sync taught the predictor.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub hits: u64,
    pub misses: u64,
    pub wasted: u64,
    pub to_eager: u64,
    pub to_lazy: u64,
}

#[derive(Default, Debug)]
pub struct Predictor {
    blocks: HashMap<u64, Block>,
    /// Ghost records: recently evicted hot blocks (set for lookups, queue for age; the queue
    /// may hold entries already taken back, skipped when they age out).
    ghosts: HashSet<u64>,
    ghost_order: VecDeque<u64>,
    /// Blocks logged eagerly since the last sync (so a sync touches only what it must).
    logged_since_sync: Vec<u64>,
}

impl Predictor {
    /// A write touches `pages`: true if they should be logged now.
    pub fn on_write(&mut self, pages: std::ops::RangeInclusive<u64>, now: Instant) -> bool {
        let mut eager = true;
        for p in pages {
            let ghosts = &mut self.ghosts;
            let b = self.blocks.entry(p).or_insert_with(|| Block {
                writes: 0,
                syncs: 0,
                eager: ghosts.remove(&p),
                logged: false,
                last_write: now,
                last_sync: now,
            });
            b.writes = b.writes.saturating_add(1);
            b.last_write = now;
            eager &= b.eager;
        }
        if self.blocks.len() > MAX_BLOCKS {
            self.evict();
        }
        eager
    }

    /// The write to `pages` was logged eagerly.
    pub fn logged(&mut self, pages: std::ops::RangeInclusive<u64>) {
        for p in pages {
            if let Some(b) = self.blocks.get_mut(&p) {
                if !b.logged {
                    b.logged = true;
                    self.logged_since_sync.push(p);
                }
            }
        }
    }

    /// An fsync: `lazy_pages` were dirty (collected now); every block logged since the last
    /// sync was predicted right.
    pub fn on_sync(
        &mut self,
        lazy_pages: impl IntoIterator<Item = u64>,
        now: Instant,
        decay: Duration,
    ) -> Outcome {
        let mut o = Outcome::default();
        let hot = |b: &Block| b.syncs >= 2 && b.syncs.saturating_mul(2) >= b.writes;
        for p in lazy_pages {
            if let Some(b) = self.blocks.get_mut(&p) {
                b.syncs = b.syncs.saturating_add(1);
                b.last_sync = now;
                o.misses += 1;
                if !b.eager && hot(b) {
                    b.eager = true;
                    o.to_eager += 1;
                }
            }
        }
        for p in std::mem::take(&mut self.logged_since_sync) {
            let Some(b) = self.blocks.get_mut(&p) else {
                continue;
            };
            if b.logged {
                b.logged = false;
                b.syncs = b.syncs.saturating_add(1);
                b.last_sync = now;
                o.hits += 1;
                if !b.eager && hot(b) {
                    b.eager = true;
                    o.to_eager += 1;
                }
            }
        }
        let _ = decay; // eager blocks decay at write-back (`on_write_back`), not on every sync
        o
    }

    /// Write-back made everything durable: eager blocks not synced within `decay` go lazy
    /// (their logging was wasted).
    pub fn on_write_back(&mut self, now: Instant, decay: Duration) -> Outcome {
        let mut o = Outcome::default();
        self.logged_since_sync.clear();
        for b in self.blocks.values_mut() {
            if b.logged {
                b.logged = false;
                o.wasted += 1;
            }
            if b.eager && now.duration_since(b.last_sync) > decay {
                b.eager = false;
                b.writes = 0;
                b.syncs = 0;
                o.to_lazy += 1;
            }
        }
        o
    }

    pub fn eager_blocks(&self) -> (u64, u64) {
        let e = self.blocks.values().filter(|b| b.eager).count() as u64;
        (e, self.blocks.len() as u64 - e)
    }

    fn evict(&mut self) {
        let mut v: Vec<(u64, Instant)> = self
            .blocks
            .iter()
            .map(|(p, b)| (*p, b.last_write))
            .collect();
        v.sort_by_key(|(_, t)| *t);
        for (p, _) in v.into_iter().take(MAX_BLOCKS / 4) {
            let hot = self
                .blocks
                .remove(&p)
                .is_some_and(|b| b.eager || b.syncs > 0);
            if hot && self.ghosts.insert(p) {
                self.ghost_order.push_back(p);
                while self.ghost_order.len() > MAX_GHOSTS {
                    if let Some(old) = self.ghost_order.pop_front() {
                        self.ghosts.remove(&old);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_synced_writes_go_eager_large_rare_syncs_stay_lazy() {
        let t = Instant::now();
        let decay = Duration::from_secs(1);
        let mut hot = Predictor::default();
        // small writes, each followed by a sync
        for i in 0..10 {
            let eager = hot.on_write(3..=3, t);
            if eager {
                hot.logged(3..=3);
                hot.on_sync(std::iter::empty(), t, decay);
            } else {
                hot.on_sync([3], t, decay);
            }
            if i >= 2 {
                assert!(
                    eager,
                    "a block synced after every write must be eager by write {i}"
                );
            }
        }
        let mut cold = Predictor::default();
        // large sequential writes, one sync at the end
        for p in 0..256 {
            assert!(!cold.on_write(p..=p, t));
        }
        let o = cold.on_sync(0..256, t, decay);
        assert_eq!(o.to_eager, 0, "written once, synced once: stays lazy");
        assert_eq!(cold.eager_blocks().0, 0);
    }

    #[test]
    fn eager_blocks_decay_without_syncs() {
        let t = Instant::now();
        let decay = Duration::from_millis(10);
        let mut p = Predictor::default();
        for _ in 0..2 {
            p.on_write(1..=1, t);
            p.on_sync([1], t, decay);
        }
        assert_eq!(p.eager_blocks().0, 1);
        let o = p.on_write_back(t + Duration::from_millis(50), decay);
        assert_eq!(o.to_lazy, 1);
        assert_eq!(p.eager_blocks().0, 0);
    }

    #[test]
    fn an_evicted_hot_block_comes_back_eager_through_its_ghost() {
        let t = Instant::now();
        let decay = Duration::from_secs(1);
        let mut p = Predictor::default();
        for _ in 0..2 {
            p.on_write(0..=0, t);
            p.on_sync([0], t, decay);
        }
        assert!(p.on_write(0..=0, t), "hot block is eager");
        // Many newer blocks push block 0 out of the table.
        let later = t + Duration::from_millis(1);
        for b in 1..=(MAX_BLOCKS as u64 + 10) {
            p.on_write(b..=b, later);
        }
        assert!(!p.blocks.contains_key(&0), "block 0 was evicted");
        assert!(
            p.on_write(0..=0, later),
            "its ghost record brings it back eager"
        );
    }
}
