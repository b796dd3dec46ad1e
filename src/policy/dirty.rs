//! Dirty bytes: written to the lower file system, not yet logged, to be logged at the next
//! sync. Both front ends keep one per object (the core per inode, `pmstack run` per process
//! and object).
//!
//! A copy of the bytes is kept as they are written, by page, so a sync logs them without
//! reading them back from the lower file system: on a network lower a read costs
//! milliseconds (JuiceFS: 7.5–32 ms), and the bytes were in hand when they were written.
//! The copy is kept only where reading back is expensive (network and FUSE lowers:
//! `Client::copies`, the core's `keep_copies`), and it is bounded, per object and per process; past a bound, or after an
//! operation that changes bytes other than by writing them, it is dropped and `bytes`
//! answers None: the caller reads the dirty ranges back, as it always may.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::engine::format::PAGE;

/// Most pages one object keeps a copy of (8 MiB), and all objects of a process (256 MiB).
const COPY_PAGES_MAX_OBJECT: usize = 2048;
const COPY_PAGES_MAX: usize = 65536;

/// Pages held by every `Dirty` of this process.
static COPY_PAGES: AtomicUsize = AtomicUsize::new(0);

#[derive(Debug)]
pub struct Dirty {
    /// Byte ranges: start -> end, merged, never empty.
    ranges: BTreeMap<u64, u64>,
    /// The bytes last written at each dirty offset, by page; meaningful only inside `ranges`
    /// and only while `partial` is false.
    copy: BTreeMap<u64, Box<[u8]>>,
    /// Some dirty bytes are not in `copy`.
    partial: bool,
    /// Most pages this one keeps a copy of (0: none at all).
    max_pages: usize,
}

impl Default for Dirty {
    /// Without copies.
    fn default() -> Dirty {
        Dirty::new(false)
    }
}

impl Dirty {
    /// One that keeps a copy of what is written (`keep`), or never does.
    pub fn new(keep: bool) -> Dirty {
        Dirty::copying(if keep { COPY_PAGES_MAX_OBJECT } else { 0 })
    }

    /// One that keeps a copy of at most `pages` pages of what is written.
    pub fn copying(pages: usize) -> Dirty {
        Dirty {
            ranges: BTreeMap::new(),
            copy: BTreeMap::new(),
            partial: false,
            max_pages: pages.min(COPY_PAGES_MAX_OBJECT),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The dirty ranges (start, end), in order.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(s, e)| (*s, *e))
    }

    /// `data` was written at `off` and is not logged.
    pub fn add(&mut self, off: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        self.copy_in(off, data);
        add_range(&mut self.ranges, off, off + data.len() as u64);
    }

    /// `data` was written at `off` and logged: where it overwrote dirty bytes, the copy must
    /// hold it, or the next sync would log the older bytes after this write's entry.
    pub fn overwritten(&mut self, off: u64, data: &[u8]) {
        let end = off + data.len() as u64;
        if self.ranges.range(..end).any(|(_, &e)| e > off) {
            self.copy_in(off, data);
        }
    }

    /// The file was truncated to `size`: dirty bytes past it no longer exist.
    pub fn clip(&mut self, size: u64) {
        self.ranges = self
            .ranges
            .iter()
            .filter(|(s, _)| **s < size)
            .map(|(s, e)| (*s, (*e).min(size)))
            .collect();
    }

    /// The bytes changed other than by a write the copy saw (fallocate, a write it could not
    /// see): sync must read them back.
    pub fn forget_copy(&mut self) {
        self.drop_copy(true);
    }

    /// Everything dirty was logged or made durable.
    pub fn clear(&mut self) {
        self.ranges.clear();
        self.drop_copy(false);
    }

    /// The bytes of dirty range `s..e` from the copy; None if the copy does not hold them.
    pub fn bytes(&self, s: u64, e: u64) -> Option<Vec<u8>> {
        if self.partial {
            return None;
        }
        let page = PAGE as u64;
        let mut out = Vec::with_capacity(e.saturating_sub(s) as usize);
        let mut o = s;
        while o < e {
            let in_page = (o % page) as usize;
            let n = (page - in_page as u64).min(e - o) as usize;
            out.extend_from_slice(&self.copy.get(&(o / page))?[in_page..in_page + n]);
            o += n as u64;
        }
        Some(out)
    }

    fn copy_in(&mut self, off: u64, data: &[u8]) {
        if self.partial || data.is_empty() {
            return;
        }
        if self.max_pages == 0 {
            self.drop_copy(true);
            return;
        }
        let page = PAGE as u64;
        let (first, last) = (off / page, (off + data.len() as u64 - 1) / page);
        let new = (first..=last)
            .filter(|p| !self.copy.contains_key(p))
            .count();
        if self.copy.len() + new > self.max_pages
            || COPY_PAGES.fetch_add(new, Ordering::Relaxed) + new > COPY_PAGES_MAX
        {
            if self.copy.len() + new <= self.max_pages {
                COPY_PAGES.fetch_sub(new, Ordering::Relaxed);
            }
            self.drop_copy(true);
            return;
        }
        let mut pos = 0usize;
        while pos < data.len() {
            let o = off + pos as u64;
            let in_page = (o % page) as usize;
            let n = (PAGE - in_page).min(data.len() - pos);
            let bytes = &data[pos..pos + n];
            match self.copy.entry(o / page) {
                // A whole new page: copied as it is, not zeroed first.
                std::collections::btree_map::Entry::Vacant(v) if n == PAGE => {
                    v.insert(bytes.into());
                }
                e => {
                    let buf = e.or_insert_with(|| vec![0u8; PAGE].into_boxed_slice());
                    buf[in_page..in_page + n].copy_from_slice(bytes);
                }
            }
            pos += n;
        }
    }

    fn drop_copy(&mut self, partial: bool) {
        COPY_PAGES.fetch_sub(self.copy.len(), Ordering::Relaxed);
        self.copy.clear();
        self.partial = partial;
    }
}

impl Drop for Dirty {
    fn drop(&mut self) {
        COPY_PAGES.fetch_sub(self.copy.len(), Ordering::Relaxed);
    }
}

/// Add `s..e` to merged ranges.
pub(crate) fn add_range(m: &mut BTreeMap<u64, u64>, mut s: u64, mut e: u64) {
    if s >= e {
        return;
    }
    // Merge with overlapping or adjacent ranges.
    let overl: Vec<(u64, u64)> = m
        .range(..=e)
        .filter(|(_, &ee)| ee >= s)
        .map(|(a, b)| (*a, *b))
        .collect();
    for (a, b) in overl {
        m.remove(&a);
        s = s.min(a);
        e = e.max(b);
    }
    m.insert(s, e);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ranges_merge() {
        let mut m = BTreeMap::new();
        add_range(&mut m, 10, 20);
        add_range(&mut m, 30, 40);
        add_range(&mut m, 20, 30);
        assert_eq!(m.into_iter().collect::<Vec<_>>(), vec![(10, 40)]);
        let mut m = BTreeMap::new();
        add_range(&mut m, 10, 20);
        add_range(&mut m, 0, 5);
        add_range(&mut m, 4, 12);
        assert_eq!(m.into_iter().collect::<Vec<_>>(), vec![(0, 20)]);
    }

    proptest! {
        /// Against a model file: after any writes (dirty or logged), truncates and a dropped
        /// copy, every dirty range's bytes from the copy are the file's bytes there.
        #[test]
        fn the_copy_holds_the_last_bytes_written(ops in proptest::collection::vec(
            (0u8..10, 0u64..20_000, 1usize..9000, any::<u8>()), 1..40)) {
            let mut file: Vec<u8> = Vec::new();
            let mut d = Dirty::new(true);
            let mut forgot = false;
            for (kind, off, len, b) in ops {
                let data = vec![b; len];
                match kind {
                    0..=5 => {
                        let end = off as usize + len;
                        if file.len() < end { file.resize(end, 0); }
                        file[off as usize..end].copy_from_slice(&data);
                        d.add(off, &data);
                    }
                    6 | 7 => {
                        let end = off as usize + len;
                        if file.len() < end { file.resize(end, 0); }
                        file[off as usize..end].copy_from_slice(&data);
                        d.overwritten(off, &data);
                    }
                    8 => {
                        file.truncate(off as usize);
                        d.clip(off);
                    }
                    _ => {
                        if b % 8 == 0 { d.forget_copy(); forgot = true; }
                        else if b % 8 == 1 { d.clear(); forgot = false; }
                    }
                }
            }
            for (s, e) in d.ranges() {
                prop_assert!(e <= file.len() as u64);
                match d.bytes(s, e) {
                    Some(got) => prop_assert_eq!(&got[..], &file[s as usize..e as usize]),
                    None => prop_assert!(forgot),
                }
            }
        }
    }
}
