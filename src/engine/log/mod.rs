//! The append path, commit protocol, expiry and GC of the PM log.
//!
//! Ordering points (the only places durability is decided):
//! 1. `commit`: entries and data pages → flush → **fence A** → 8-byte tail store → flush →
//!    **fence B**. Fence A orders the entry bytes before the tail that makes them visible to
//!    recovery; fence B makes the tail durable before the caller acknowledges.
//! 2. `new_page`: page header → flush → fence → link (8-byte `next` or area `head` store) →
//!    flush → fence, so a chain never points to a page with a stale header.
//! 3. `checkpoint`: 8-byte store of the expiry horizon → flush → fence, after the lower file
//!    system made everything below it durable.
//! 4. GC: 8-byte `head` store → flush → fence before the page is reused.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::format::*;
use super::record::Record;
use super::scan::{
    area_word, encode_tail, load_sealed, read_superblock, scan, store_sealed, Problem, Scan,
};
use crate::pmem::Pmem;

mod append;

pub use append::AreaGuard;

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("PM log is full")]
    Full,
    #[error("{0}")]
    Superblock(#[from] SbError),
    #[error("PM region is corrupted: {0}")]
    Corrupt(#[from] Problem),
    #[error("every append area of the PM region is leased (too many processes attached)")]
    NoFreeArea,
}

struct LivePage {
    page: u32,
    max_lsn: u64,
}

pub struct Area {
    idx: u32,
    cur: u32,
    off: usize,
    seq: u64,
    pages: VecDeque<LivePage>,
    /// Byte ranges written since the last commit (flushed at commit).
    pending: Vec<(usize, usize)>,
    /// Tail position of the last appended (not necessarily committed) entry.
    end: u64,
    committed: u64,
}

/// Counters (monotonic) of the log.
#[derive(Default, Debug)]
pub struct LogStats {
    pub commits: AtomicU64,
    pub entries: AtomicU64,
    pub bytes_inplace: AtomicU64,
    pub bytes_pages: AtomicU64,
    pub pages_freed: AtomicU64,
    pub gc_runs: AtomicU64,
    pub full: AtomicU64,
}

pub struct Log {
    pm: Arc<dyn Pmem>,
    sb: Superblock,
    /// The areas this process leased (exclusive open: all of them).
    areas: Vec<Mutex<Area>>,
    /// Owner tag this process writes into the chunk table (1 + its first area).
    chunk_tag: u64,
    /// Chunks not yet claimed by anyone, as last seen (an estimate under sharing).
    unclaimed_pages: AtomicUsize,
    /// A corrupt superblock word was read while running and reported (once).
    corruption_reported: AtomicBool,
    next_chunk: AtomicUsize,
    /// Chunks this process claimed (from its second on, each is set up writable at once).
    chunks_claimed: AtomicUsize,
    next_area: AtomicUsize,
    free: Mutex<Vec<u32>>,
    free_count: AtomicUsize,
    /// Live out-of-place data pages per fid: (lsn, page).
    oop: Mutex<HashMap<u64, Vec<(u64, u32)>>>,
    pub stats: LogStats,
}

/// Pages kept back so that log pages can always be chained (data pages fail first).
const RESERVE_PAGES: usize = 4;

/// Empty areas an exclusive open (the daemon) leases; the others are left to `attach`.
const OPEN_AREAS: usize = 8;

/// The first LSN handed out; everything below is reserved (fid 1 is the root directory).
pub const FIRST_LSN: u64 = 16;

thread_local! {
    static AREA_HINT: Cell<usize> = const { Cell::new(usize::MAX) };
}

impl Log {
    /// Initialize a region: superblock, empty areas, every page free.
    pub fn format(pm: Arc<dyn Pmem>, lower_id: [u8; 16], areas: u32) -> Result<Log, LogError> {
        let pages = (pm.len() / PAGE) as u64;
        if pages < MIN_PAGES {
            return Err(SbError::TooSmall(pm.len() as u64).into());
        }
        let areas = areas.clamp(1, MAX_AREAS);
        let sb = Superblock {
            version: VERSION,
            region_bytes: pages * PAGE as u64,
            uuid: *uuid::Uuid::new_v4().as_bytes(),
            lower_id,
            areas,
        };
        // Invalidate first so a crash mid-format leaves an unrecognizable region, not a
        // half-initialized one that passes the magic check.
        pm.store_u64(SB_MAGIC, 0);
        pm.persist(0, 8);
        let meta = sb.first_alloc_page() as usize * PAGE;
        pm.write(8, &vec![0u8; meta - 8]);
        // LSNs start above ROOT_FID: the fs core also draws file ids from the LSN counter.
        store_sealed(&*pm, SB_CHECKPOINT, FIRST_LSN);
        store_sealed(&*pm, SB_CLEAN, 1);
        pm.store_u64(SB_NEXT_LSN, FIRST_LSN);
        pm.persist(0, meta);
        let enc = sb.encode();
        pm.write(8, &enc[8..]);
        pm.persist(0, 64);
        pm.write(0, &enc[..8]);
        pm.persist(0, 8);
        let (log, _) = Self::open(pm)?;
        Ok(log)
    }

    /// Open a formatted region exclusively (the daemon, holding the region lock; recovery),
    /// rebuilding the volatile state from a scan: every area and chunk becomes this process's.
    /// The log is returned as found (live entries stay live); see `reset` after recovery.
    pub fn open(pm: Arc<dyn Pmem>) -> Result<(Log, Scan), LogError> {
        let s = scan(&*pm)?;
        if let Some(p) = s.problems.first() {
            return Err(LogError::Corrupt(p.clone()));
        }
        let mut areas = Vec::new();
        // Every area holding entries (they must be managed), and empty ones up to
        // OPEN_AREAS; the rest stay free for other processes to lease (`attach`).
        let mut taken = Vec::new();
        for a in &s.areas {
            if a.head == 0 && taken.len() >= OPEN_AREAS {
                continue;
            }
            taken.push(a.idx);
            let last = a.pages.last();
            areas.push(Mutex::new(Area {
                idx: a.idx,
                cur: last.map_or(0, |p| p.page),
                off: if a.tail_page != 0 {
                    a.tail_off
                } else if last.is_some() {
                    SLOT
                } else {
                    PAGE
                },
                seq: last.map_or(0, |p| p.seq),
                pages: a
                    .pages
                    .iter()
                    .map(|p| LivePage {
                        page: p.page,
                        max_lsn: p.max_lsn,
                    })
                    .collect(),
                pending: Vec::new(),
                end: encode_tail(a.tail_page, a.tail_off),
                committed: encode_tail(a.tail_page, a.tail_off),
            }));
        }
        let free = s.free_pages();
        let mut oop: HashMap<u64, Vec<(u64, u32)>> = HashMap::new();
        for e in s.live_entries() {
            if let Record::DataPage { fid, page, .. } = e.rec {
                oop.entry(fid).or_default().push((e.lsn, page));
            }
        }
        let sb = read_superblock(&*pm)?;
        pm.store_u64(SB_NEXT_LSN, s.checkpoint.max(s.max_lsn + 1).max(FIRST_LSN));
        let pid = std::process::id() as u64;
        for a in &s.areas {
            let owner = if taken.contains(&a.idx) { pid } else { 0 };
            pm.store_u64(area_word(a.idx, AREA_OWNER), owner);
        }
        for c in 0..sb.chunks() {
            pm.store_u64(sb.chunk_word(c), 1);
        }
        let log = Log {
            sb,
            areas,
            chunk_tag: 1,
            unclaimed_pages: AtomicUsize::new(0),
            corruption_reported: AtomicBool::new(false),
            next_chunk: AtomicUsize::new(0),
            chunks_claimed: AtomicUsize::new(0),
            next_area: AtomicUsize::new(0),
            free_count: AtomicUsize::new(free.len()),
            free: Mutex::new(free),
            oop: Mutex::new(oop),
            pm,
            stats: LogStats::default(),
        };
        Ok((log, s))
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }
    pub fn pm(&self) -> &Arc<dyn Pmem> {
        &self.pm
    }
    pub fn pages_total(&self) -> usize {
        (self.sb.pages() - self.sb.first_alloc_page()) as usize
    }
    pub fn pages_free(&self) -> usize {
        self.free_count.load(Ordering::Relaxed) + self.unclaimed_pages.load(Ordering::Relaxed)
    }
    /// The next LSN that will be handed out (every LSN below it is assigned).
    pub fn lsn_now(&self) -> u64 {
        self.pm.load_u64(SB_NEXT_LSN)
    }
    /// A new LSN, unique across every process appending to the region.
    pub fn next_lsn(&self) -> u64 {
        self.pm.fetch_add_u64(SB_NEXT_LSN, 1)
    }

    /// Attach to a region another process (the daemon) has open: lease `n` free areas
    /// (compare-and-swap of their owner words) and claim page chunks on demand, so nothing
    /// this process appends depends on any other process's private state. The region must be
    /// in use (not being recovered).
    pub fn attach(pm: Arc<dyn Pmem>, n: usize) -> Result<Log, LogError> {
        let sb = read_superblock(&*pm)?;
        let pid = std::process::id() as u64;
        let mut areas = Vec::new();
        for idx in 0..sb.areas {
            if areas.len() == n {
                break;
            }
            let head = load_sealed(&*pm, area_word(idx, AREA_HEAD), "area head")
                .map_err(LogError::Corrupt)?;
            if head == 0
                && pm
                    .compare_exchange_u64(area_word(idx, AREA_OWNER), 0, pid)
                    .is_ok()
            {
                areas.push(Mutex::new(Area {
                    idx,
                    cur: 0,
                    off: PAGE,
                    seq: 0,
                    pages: VecDeque::new(),
                    pending: Vec::new(),
                    end: 0,
                    committed: 0,
                }));
            }
        }
        if areas.is_empty() {
            return Err(LogError::NoFreeArea);
        }
        let chunk_tag = 1 + areas[0].lock().idx as u64;
        // Pages, not chunks: the last chunk may be partial.
        let unclaimed = (0..sb.chunks())
            .filter(|&c| pm.load_u64(sb.chunk_word(c)) == 0)
            .map(|c| sb.chunk_pages(c).len())
            .sum();
        Ok(Log {
            sb,
            areas,
            chunk_tag,
            unclaimed_pages: AtomicUsize::new(unclaimed),
            corruption_reported: AtomicBool::new(false),
            next_chunk: AtomicUsize::new(0),
            chunks_claimed: AtomicUsize::new(0),
            next_area: AtomicUsize::new(0),
            free_count: AtomicUsize::new(0),
            free: Mutex::new(Vec::new()),
            oop: Mutex::new(HashMap::new()),
            pm,
            stats: LogStats::default(),
        })
    }

    /// Claim a free chunk (compare-and-swap in the chunk table) into `pool`.
    fn claim_chunk(&self, pool: &mut Vec<u32>) -> bool {
        let n = self.sb.chunks() as usize;
        let start = self.next_chunk.load(Ordering::Relaxed);
        for k in 0..n {
            let c = ((start + k) % n) as u32;
            let w = self.sb.chunk_word(c);
            if self.pm.load_u64(w) == 0
                && self.pm.compare_exchange_u64(w, 0, self.chunk_tag).is_ok()
            {
                self.next_chunk
                    .store((c as usize + 1) % n, Ordering::Relaxed);
                let got = self.sb.chunk_pages(c).len();
                let _ =
                    self.unclaimed_pages
                        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                            Some(u.saturating_sub(got))
                        });
                let pages = self.sb.chunk_pages(c);
                // A process that claims a second chunk logs much (a stream of synced
                // writes): its pages are set up in its mapping in one call, not one fault
                // per first store (64K O_SYNC writes spent 8% of their time in such faults).
                // Not its first: a process that logs a creation or two would set up 64 pages
                // to write one.
                if self.chunks_claimed.fetch_add(1, Ordering::Relaxed) > 0 {
                    self.pm
                        .will_write(pages.start as usize * PAGE, pages.len() * PAGE);
                }
                pool.extend(pages.rev());
                return true;
            }
        }
        self.unclaimed_pages.store(0, Ordering::Relaxed);
        false
    }
    /// The LSN below which every entry has expired (0, keeping every entry live, if the
    /// word is corrupt: the next write-back writes it anew).
    pub fn checkpoint_lsn(&self) -> u64 {
        self.running_word(SB_CHECKPOINT, "checkpoint", 0)
    }

    /// Whether the region was shut down cleanly (not, if the word is corrupt: the next start
    /// recovers).
    pub fn is_clean(&self) -> bool {
        self.running_word(SB_CLEAN, "clean", 0) == 1
    }

    /// A sealed superblock word read while running. A corrupt one (a stray store, a media
    /// error) reads as `keeps_most`, the value that gives up nothing, and is reported once:
    /// scan and recovery refuse or repair it at the next start, but a running daemon must
    /// neither stop nor go on silently.
    fn running_word(&self, off: usize, what: &'static str, keeps_most: u64) -> u64 {
        load_sealed(&*self.pm, off, what).unwrap_or_else(|e| {
            if !self.corruption_reported.swap(true, Ordering::Relaxed) {
                tracing::error!("PM region: {e}; every log entry stays live until it is written anew; stop pmstack and run `pmstack check` on the region");
            }
            keeps_most
        })
    }

    /// Mark the region in use (a crash from now on is an unclean shutdown).
    pub fn set_clean(&self, clean: bool) {
        store_sealed(&*self.pm, SB_CLEAN, clean as u64);
        self.pm.persist(SB_CLEAN, 8);
        if clean {
            self.pm.sync_backing();
        }
    }

    /// Lock this thread's append area.
    pub fn area(&self) -> AreaGuard<'_> {
        let n = self.areas.len();
        let hint = AREA_HINT.with(|h| {
            if h.get() == usize::MAX {
                h.set(self.next_area.fetch_add(1, Ordering::Relaxed));
            }
            h.get()
        });
        // Prefer an uncontended area, so unrelated writers never wait on one lock.
        for k in 0..n.min(4) {
            if let Some(g) = self.areas[(hint + k) % n].try_lock() {
                if k != 0 {
                    AREA_HINT.with(|h| h.set(hint + k));
                }
                return AreaGuard { log: self, a: g };
            }
        }
        AreaGuard {
            log: self,
            a: self.areas[hint % n].lock(),
        }
    }

    fn alloc(&self, reserve_ok: bool) -> Option<u32> {
        let mut f = self.free.lock();
        if f.len() <= RESERVE_PAGES {
            self.claim_chunk(&mut f);
        }
        if !reserve_ok && f.len() <= RESERVE_PAGES {
            return None;
        }
        let p = f.pop()?;
        self.free_count.store(f.len(), Ordering::Relaxed);
        Some(p)
    }

    fn release(&self, pages: impl IntoIterator<Item = u32>) {
        let mut f = self.free.lock();
        let before = f.len();
        f.extend(pages);
        self.stats
            .pages_freed
            .fetch_add((f.len() - before) as u64, Ordering::Relaxed);
        self.free_count.store(f.len(), Ordering::Relaxed);
    }

    /// Expire every entry with an LSN below `upto` (the caller made the lower file system
    /// durable up to there), then reclaim what that freed.
    pub fn checkpoint(&self, upto: u64) {
        let cur = self.checkpoint_lsn();
        if upto > cur {
            store_sealed(&*self.pm, SB_CHECKPOINT, upto);
            self.pm.persist(SB_CHECKPOINT, 8);
        }
        self.gc();
    }

    /// Expire `fid`'s entries below `upto` with a write-back record, then free its
    /// out-of-place data pages at once.
    pub fn write_back(&self, fid: u64, upto: u64) -> Result<(), LogError> {
        {
            let mut a = self.area();
            a.append_reserved(&Record::WriteBack { fid, upto }, None)?;
            a.commit();
        }
        let freed: Vec<u32> = {
            let mut oop = self.oop.lock();
            let Some(v) = oop.get_mut(&fid) else {
                return Ok(());
            };
            let (dead, live): (Vec<_>, Vec<_>) = v.drain(..).partition(|(l, _)| *l < upto);
            *v = live;
            dead.into_iter().map(|(_, p)| p).collect()
        };
        self.release(freed);
        Ok(())
    }

    /// Free data pages of expired entries and log pages (from each area's head) whose
    /// entries are all expired. Never the newest page of an area. Holds each area's lock only
    /// for its own pages.
    pub fn gc(&self) {
        self.stats.gc_runs.fetch_add(1, Ordering::Relaxed);
        let cp = self.checkpoint_lsn();
        let freed: Vec<u32> = {
            let mut oop = self.oop.lock();
            let mut freed = Vec::new();
            oop.retain(|_, v| {
                v.retain(|&(l, p)| {
                    if l < cp {
                        freed.push(p);
                        false
                    } else {
                        true
                    }
                });
                !v.is_empty()
            });
            freed
        };
        self.release(freed);
        for am in &self.areas {
            let mut a = am.lock();
            let mut dead = Vec::new();
            let tail_page = super::scan::decode_tail(a.committed).0;
            // Never the newest page, nor the page holding the committed tail.
            while a.pages.len() > 1 && a.pages[0].max_lsn < cp && a.pages[0].page != tail_page {
                let p = a.pages.pop_front().expect("len > 1").page;
                let new_head = a.pages[0].page;
                store_sealed(&*self.pm, area_word(a.idx, AREA_HEAD), new_head as u64);
                self.pm.persist(area_word(a.idx, AREA_HEAD), 8);
                dead.push(p);
            }
            drop(a);
            self.release(dead);
        }
    }

    /// After recovery replayed everything onto the lower file system and made it durable:
    /// expire every entry and empty every area. Crash-safe: the single checkpoint store
    /// expires everything at once, the area resets after it only reclaim space.
    pub fn reset(&self) {
        let upto = self.lsn_now();
        store_sealed(&*self.pm, SB_CHECKPOINT, upto.max(self.checkpoint_lsn()));
        self.pm.persist(SB_CHECKPOINT, 8);
        for am in &self.areas {
            let mut a = am.lock();
            for w in [AREA_HEAD, AREA_TAIL] {
                self.pm.store_u64(area_word(a.idx, w), 0);
            }
            self.pm.persist(area_word(a.idx, 0), AREA_SLOT);
            a.pages.clear();
            a.cur = 0;
            a.off = PAGE;
            a.seq = 0;
            a.pending.clear();
            a.end = 0;
            a.committed = 0;
        }
        self.oop.lock().clear();
        // Every chunk back to the shared pool; this process claims again on demand.
        for c in 0..self.sb.chunks() {
            self.pm.store_u64(self.sb.chunk_word(c), 0);
        }
        self.unclaimed_pages
            .store(self.pages_total(), Ordering::Relaxed);
        let mut f = self.free.lock();
        f.clear();
        self.free_count.store(0, Ordering::Relaxed);
    }

    /// Every area's owner word: (area index, owner pid; 0 for a free area).
    pub fn leases(&self) -> Vec<(u32, u64)> {
        (0..self.sb.areas)
            .map(|i| (i, self.pm.load_u64(area_word(i, AREA_OWNER))))
            .collect()
    }

    /// Whether process `pid` ever committed a record in the areas it leases (an area's head
    /// and tail words stay zero until its first append; a word that is not zero, readable or
    /// not, counts). A dead process that did not holds nothing live: its lease may be given
    /// back at once (`release_lease`), without waiting for a write-back.
    pub fn appended_by(&self, pid: u64) -> bool {
        self.leases().into_iter().any(|(i, o)| {
            o == pid
                && (self.pm.load_u64(area_word(i, AREA_HEAD)) != 0
                    || self.pm.load_u64(area_word(i, AREA_TAIL)) != 0)
        })
    }

    /// Give back the areas and page chunks of process `pid`, which died. Only once the
    /// checkpoint expired everything it appended (the caller noted the LSN counter after the
    /// death and waited for a write-back past it): its log pages and data pages then hold
    /// nothing live. Chunks first, then the area words, then the lease, so a process leasing
    /// the area (and reusing its chunk tag) never meets a chunk of the dead one.
    pub fn release_lease(&self, pid: u64) -> usize {
        if pid == std::process::id() as u64 || pid == 0 {
            return 0;
        }
        let mine: Vec<u32> = self
            .leases()
            .into_iter()
            .filter(|&(_, o)| o == pid)
            .map(|(i, _)| i)
            .collect();
        let Some(&first) = mine.iter().min() else {
            return 0;
        };
        let tag = 1 + first as u64;
        let (mut chunks, mut pages) = (0, 0);
        for c in 0..self.sb.chunks() {
            let w = self.sb.chunk_word(c);
            if self.pm.load_u64(w) == tag && self.pm.compare_exchange_u64(w, tag, 0).is_ok() {
                chunks += 1;
                pages += self.sb.chunk_pages(c).len();
            }
        }
        for &i in &mine {
            // As `reset` does: an empty area has zero head and tail words.
            self.pm.store_u64(area_word(i, AREA_HEAD), 0);
            self.pm.store_u64(area_word(i, AREA_TAIL), 0);
            self.pm.persist(area_word(i, 0), AREA_SLOT);
            let _ = self
                .pm
                .compare_exchange_u64(area_word(i, AREA_OWNER), pid, 0);
        }
        self.unclaimed_pages.fetch_add(pages, Ordering::Relaxed);
        chunks
    }

    /// Bytes of PM in use by the log (log and live data pages).
    pub fn bytes_used(&self) -> u64 {
        (self.pages_total().saturating_sub(self.pages_free()) * PAGE) as u64
    }
}

#[cfg(test)]
mod tests;
