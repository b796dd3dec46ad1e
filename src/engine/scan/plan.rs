//! The replay plan built from a scan: the namespace operations that took effect, and per
//! file its data and attribute operations, with out-of-place pages checked against their
//! checksums.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::*;

/// One file-level operation to replay, in LSN order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileOp {
    /// Bytes logged in the entry itself (small writes).
    Write {
        off: u64,
        bytes: Vec<u8>,
    },
    /// A page logged out of place, its checksum verified when the plan was made. Replay
    /// writes it from PM: the plan holds no copy of the log (a GiB of live log made recovery
    /// spend half its time allocating and copying).
    Page {
        off: u64,
        page: u64,
    },
    Attr(AttrOp),
}

impl FileOp {
    /// Where a data operation writes and its bytes: from the plan, from the region's memory,
    /// or copied into `buf` where the region does not lend it (the simulated PM).
    pub fn data<'a>(&'a self, pm: &'a dyn Pmem, buf: &'a mut Vec<u8>) -> Option<(u64, &'a [u8])> {
        match self {
            FileOp::Write { off, bytes } => Some((*off, bytes)),
            FileOp::Page { off, page } => Some((*off, page_bytes(pm, *page, buf))),
            FileOp::Attr(_) => None,
        }
    }
}

/// The first (lowest LSN) of `checks` (lsn, page, crc) whose page does not have its checksum,
/// verified on every CPU at once (a GiB of live pages is a quarter of a million checksums).
fn bad_pages(pm: &dyn Pmem, checks: &[(u64, u32, u32)]) -> Option<(u64, u32)> {
    let verify = |part: &[(u64, u32, u32)]| {
        // The part's pages in runs of consecutive pages, each set up at once.
        let mut run: Option<(u32, u32)> = None;
        for &(_, page, _) in part {
            match run {
                Some((s, e)) if page == e => run = Some((s, e + 1)),
                _ => {
                    if let Some((s, e)) = run {
                        pm.will_read(s as usize * PAGE, (e - s) as usize * PAGE);
                    }
                    run = Some((page, page + 1));
                }
            }
        }
        if let Some((s, e)) = run {
            pm.will_read(s as usize * PAGE, (e - s) as usize * PAGE);
        }
        let mut buf = Vec::new();
        part.iter()
            .filter(|(_, page, crc)| crc32c::crc32c(page_bytes(pm, *page as u64, &mut buf)) != *crc)
            .map(|&(lsn, page, _)| (lsn, page))
            .min()
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 || checks.len() < 4096 {
        return verify(checks);
    }
    let chunk = checks.len().div_ceil(cpus);
    std::thread::scope(|s| {
        let parts: Vec<_> = checks
            .chunks(chunk)
            .map(|part| s.spawn(move || verify(part)))
            .collect();
        parts
            .into_iter()
            .filter_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .min()
    })
}

/// The bytes of log page `page`.
fn page_bytes<'a>(pm: &'a dyn Pmem, page: u64, buf: &'a mut Vec<u8>) -> &'a [u8] {
    let at = page as usize * PAGE;
    // SAFETY: a page that holds a live entry's data is not stored to until the entry
    // expires, and expiry needs the region lock held by whoever holds its plan (recovery,
    // or `check`, which reads the bytes of no page); the slice lives no longer than that.
    if let Some(s) = unsafe { pm.mapped(at, PAGE) } {
        return s;
    }
    buf.resize(PAGE, 0);
    pm.read(at, buf);
    buf
}

#[derive(Debug, Default)]
pub struct ReplayPlan {
    /// Unexpired namespace operations that took effect, in LSN order: those logged after the
    /// lower did them, and intents with a Done that says the lower did them.
    pub namespace: Vec<(u64, NsOp)>,
    /// Unexpired intents without a Done: in flight at the crash. Recovery asks the lower
    /// whether each happened (`core::recover`), in LSN order.
    pub pending: Vec<(u64, NsOp)>,
    /// Some unexpired rename, link or removal was logged after the lower did it (a log of
    /// format version 3 or older): the lower may hold one such operation more than the log,
    /// and recovery must tell that from operations the lower lost.
    pub logged_after: bool,
    /// Latest known lower handle of every fid.
    pub binds: HashMap<u64, Vec<u8>>,
    /// Per file: unexpired data and attribute operations in LSN order.
    pub files: BTreeMap<u64, Vec<(u64, FileOp)>>,
    /// Fids named by live records that have no binding to a lower object (and were not
    /// created by a live record): their records cannot be placed. Recovery reports them and
    /// applies everything else.
    pub unbound: Vec<u64>,
    /// Fids whose live creation record is older than a write-back of the object itself (a
    /// real fsync of the file, then a write-back record expiring its data). The lower made
    /// the object durable after creating it, and with it (its journal commits in order: the
    /// fault model) its creation. If the object is missing, a later operation removed it,
    /// and recovery must not create it again from the log: its durable data is in the lower
    /// only, and the log no longer holds it.
    pub durable_creations: BTreeSet<u64>,
}

impl ReplayPlan {
    pub fn is_empty(&self) -> bool {
        self.namespace.is_empty() && self.pending.is_empty() && self.files.is_empty()
    }
    pub fn live_bytes(&self) -> u64 {
        self.files
            .values()
            .flatten()
            .map(|(_, op)| match op {
                FileOp::Write { bytes, .. } => bytes.len() as u64,
                FileOp::Page { .. } => PAGE as u64,
                FileOp::Attr(_) => 0,
            })
            .sum()
    }
}

impl Scan {
    /// Build the replay plan. Out-of-place data is read from PM and its crc verified; a
    /// mismatch is a problem (returned as Err), never silently replayed.
    pub fn plan(&self, pm: &dyn Pmem) -> Result<ReplayPlan, Problem> {
        if let Some(p) = self.problems.first() {
            return Err(p.clone());
        }
        let mut plan = ReplayPlan::default();
        // Data pages whose checksums are verified below: (lsn, page, crc).
        let mut checks = Vec::new();
        for e in &self.entries {
            if let Record::Bind { fid, handle } = &e.rec {
                plan.binds.insert(*fid, handle.clone());
            }
        }
        // What became of each intent.
        let mut done: HashMap<u64, bool> = HashMap::new();
        for e in self.live_entries() {
            if let Record::NsDone { lsn, applied } = e.rec {
                done.insert(lsn, applied);
            }
        }
        for e in self.live_entries() {
            match &e.rec {
                Record::Ns(op) => {
                    plan.logged_after |= !matches!(op, NsOp::Create { .. });
                    plan.namespace.push((e.lsn, op.clone()))
                }
                Record::NsIntent(op) => match done.get(&e.lsn) {
                    Some(true) => plan.namespace.push((e.lsn, op.clone())),
                    Some(false) => {}
                    None => plan.pending.push((e.lsn, op.clone())),
                },
                Record::NsDone { .. } => {}
                Record::Data { fid, off, bytes } => plan.files.entry(*fid).or_default().push((
                    e.lsn,
                    FileOp::Write {
                        off: *off,
                        bytes: bytes.clone(),
                    },
                )),
                Record::DataPage {
                    fid,
                    off,
                    page,
                    crc,
                } => {
                    if *page < self.sb.first_alloc_page() || *page >= self.sb.pages() {
                        return Err(Problem::DataPageOutOfRange {
                            lsn: e.lsn,
                            page: *page,
                        });
                    }
                    checks.push((e.lsn, *page, *crc));
                    plan.files.entry(*fid).or_default().push((
                        e.lsn,
                        FileOp::Page {
                            off: *off,
                            page: *page as u64,
                        },
                    ));
                }
                Record::Attr { fid, op } => plan
                    .files
                    .entry(*fid)
                    .or_default()
                    .push((e.lsn, FileOp::Attr(op.clone()))),
                Record::Bind { .. } | Record::WriteBack { .. } => {}
            }
        }
        if let Some((lsn, page)) = bad_pages(pm, &checks) {
            return Err(Problem::DataPageChecksum { lsn, page });
        }
        let wb = self.wb_horizons();
        plan.durable_creations = plan
            .namespace
            .iter()
            .filter_map(|(lsn, op)| match op {
                NsOp::Create { child, .. } if wb.get(child).is_some_and(|&u| *lsn < u) => {
                    Some(*child)
                }
                _ => None,
            })
            .collect();
        let mut unbound = BTreeSet::new();
        let created: BTreeSet<u64> = plan
            .namespace
            .iter()
            .filter_map(|(_, op)| match op {
                NsOp::Create { child, .. } => Some(*child),
                _ => None,
            })
            .collect();
        for fid in plan
            .files
            .keys()
            .copied()
            .chain(plan.namespace.iter().flat_map(|(_, op)| op.named_fids()))
            .collect::<Vec<_>>()
        {
            if fid != crate::engine::record::ROOT_FID
                && fid != NAMESPACE_FID
                && fid != 0
                && !created.contains(&fid)
                && !plan.binds.contains_key(&fid)
            {
                unbound.insert(fid);
            }
        }
        plan.unbound = unbound.into_iter().collect();
        Ok(plan)
    }
}
