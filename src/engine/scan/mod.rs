//! The recovery scanner: validates a region, walks every area to its committed tail, checks
//! every entry, and yields the live records and a replay plan. It never touches a lower file
//! system.

use std::collections::{BTreeSet, HashMap};

use super::format::*;
use super::record::{AttrOp, NsOp, Record, NAMESPACE_FID};
use crate::pmem::{le_u32, le_u64, Pmem};

mod plan;

pub use plan::{FileOp, ReplayPlan};

#[derive(Clone, Debug, serde::Serialize)]
pub struct PageInfo {
    pub page: u32,
    pub seq: u64,
    /// Largest LSN of a record in the page (0 if none).
    pub max_lsn: u64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct AreaScan {
    pub idx: u32,
    pub owner: u64,
    pub head: u32,
    pub tail_page: u32,
    pub tail_off: usize,
    pub pages: Vec<PageInfo>,
}

#[derive(Clone, Debug)]
pub struct ScannedEntry {
    pub lsn: u64,
    pub area: u32,
    pub page: u32,
    pub off: usize,
    pub rec: Record,
}

#[derive(Debug)]
pub struct Scan {
    pub sb: Superblock,
    pub clean: bool,
    pub checkpoint: u64,
    pub areas: Vec<AreaScan>,
    /// Every committed, checksum-valid record (expired ones included), in LSN order.
    pub entries: Vec<ScannedEntry>,
    pub max_lsn: u64,
    /// Problems that make replay unsafe (a committed entry unreadable).
    pub problems: Vec<Problem>,
}

pub fn read_superblock(pm: &dyn Pmem) -> Result<Superblock, SbError> {
    let mut b = [0u8; 64];
    if pm.len() < 64 {
        return Err(SbError::TooSmall(pm.len() as u64));
    }
    pm.read(0, &mut b);
    Superblock::decode(&b, pm.len() as u64)
}

pub fn area_word(idx: u32, field: usize) -> usize {
    AREA_TABLE_PAGE as usize * PAGE + idx as usize * AREA_SLOT + field
}

/// The mutable 8-byte words (area head and tail, checkpoint, clean flag) carry a 16-bit
/// check in their top bits, so a flipped bit is detected instead of silently moving a tail or
/// the expiry horizon. Values use at most 48 bits; the all-zero word is a valid 0.
pub fn seal(v: u64) -> u64 {
    assert!(v < 1 << 48, "sealed word value out of range");
    if v == 0 {
        return 0;
    }
    v | ((crc32c::crc32c(&v.to_le_bytes()) as u64 & 0xffff) << 48)
}

pub fn unseal(w: u64) -> Option<u64> {
    let v = w & ((1 << 48) - 1);
    (seal(v) == w).then_some(v)
}

/// What makes a log unsafe to replay as it stands, with where the damage is. Scan collects
/// them (`Scan::problems`); `Scan::plan` refuses a log that has any, and the two data-page
/// problems it finds itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error("{what} word at offset {off} is corrupted ({word:#x})")]
    CorruptWord {
        what: &'static str,
        off: usize,
        word: u64,
    },
    #[error("area {area}: head page {head} or tail {tail_page}:{tail_off} out of range")]
    AreaBounds {
        area: u32,
        head: u64,
        tail_page: u32,
        tail_off: usize,
    },
    #[error("area {area}: log page chain loops")]
    ChainLoops { area: u32 },
    #[error("page {page} is in the logs of areas {first} and {second}")]
    PageShared { page: u32, first: u32, second: u32 },
    #[error("area {area}: log page {page} has a bad header")]
    BadPageHeader { area: u32, page: u32 },
    #[error("area {area}: page {page} offset {off}: malformed record payload")]
    MalformedRecord { area: u32, page: u32, off: usize },
    #[error("area {area}: page {page} offset {off}: committed entry breaks an invariant ({why})")]
    BrokenEntry {
        area: u32,
        page: u32,
        off: usize,
        why: &'static str,
    },
    #[error("area {area}: page {page} offset {off}: committed entry unreadable ({reason})")]
    UnreadableEntry {
        area: u32,
        page: u32,
        off: usize,
        reason: String,
    },
    #[error("area {area}: log chain ends at page {page} before the committed tail {tail_page}")]
    ChainEnds {
        area: u32,
        page: u32,
        tail_page: u32,
    },
    #[error("LSN {lsn} appears twice")]
    DuplicateLsn { lsn: u64 },
    #[error("LSN {lsn}: data page {page} out of range")]
    DataPageOutOfRange { lsn: u64, page: u32 },
    #[error("LSN {lsn}: data page {page} fails its checksum (corrupted PM)")]
    DataPageChecksum { lsn: u64, page: u32 },
}

/// Load a sealed word, or name the corruption.
pub fn load_sealed(pm: &dyn Pmem, off: usize, what: &'static str) -> Result<u64, Problem> {
    let word = pm.load_u64(off);
    unseal(word).ok_or(Problem::CorruptWord { what, off, word })
}

pub fn store_sealed(pm: &dyn Pmem, off: usize, v: u64) {
    pm.store_u64(off, seal(v));
}

pub fn decode_tail(t: u64) -> (u32, usize) {
    ((t >> 16) as u32, (t & 0xffff) as usize)
}

pub fn encode_tail(page: u32, off: usize) -> u64 {
    (page as u64) << 16 | off as u64
}

pub fn scan(pm: &dyn Pmem) -> Result<Scan, SbError> {
    let sb = read_superblock(pm)?;
    let npages = sb.pages();
    let mut problems = Vec::new();
    let mut sealed = |off: usize, what: &'static str| {
        load_sealed(pm, off, what).unwrap_or_else(|e| {
            problems.push(e);
            0
        })
    };
    let clean = sealed(SB_CLEAN, "clean-unmount") == 1;
    let checkpoint = sealed(SB_CHECKPOINT, "checkpoint");
    let mut s = Scan {
        sb: sb.clone(),
        clean,
        checkpoint,
        areas: Vec::new(),
        entries: Vec::new(),
        max_lsn: 0,
        problems: Vec::new(),
    };
    let mut page_buf = vec![0u8; PAGE];
    let mut owner_of: HashMap<u32, u32> = HashMap::new();
    for idx in 0..sb.areas {
        let owner = pm.load_u64(area_word(idx, AREA_OWNER));
        let head = sealed(area_word(idx, AREA_HEAD), "area head");
        let (tail_page, tail_off) = decode_tail(sealed(area_word(idx, AREA_TAIL), "area tail"));
        let mut a = AreaScan {
            idx,
            owner,
            head: 0,
            tail_page,
            tail_off,
            pages: Vec::new(),
        };
        if head == 0 {
            s.areas.push(a);
            continue;
        }
        let first = sb.first_alloc_page() as u64;
        let bad_page = |p: u64| p < first || p >= npages as u64;
        if bad_page(head) || (tail_page != 0 && bad_page(tail_page as u64)) || tail_off > PAGE {
            s.problems.push(Problem::AreaBounds {
                area: idx,
                head,
                tail_page,
                tail_off,
            });
            s.areas.push(a);
            continue;
        }
        a.head = head as u32;
        let mut p = head as u32;
        let mut expect_seq: Option<u64> = None;
        let mut steps = 0u32;
        // Leading pieces of a record larger than one entry (`Kind::Part`): (LSN, bytes).
        let mut parts: Option<(u64, Vec<u8>)> = None;
        loop {
            steps += 1;
            if steps > npages {
                s.problems.push(Problem::ChainLoops { area: idx });
                break;
            }
            if let Some(o) = owner_of.insert(p, idx) {
                s.problems.push(Problem::PageShared {
                    page: p,
                    first: o,
                    second: idx,
                });
                break;
            }
            pm.read(p as usize * PAGE, &mut page_buf);
            let seq = le_u64(&page_buf, LP_SEQ);
            let hdr_ok = le_u32(&page_buf, LP_MAGIC_OFF) == LP_MAGIC
                && le_u32(&page_buf, LP_AREA) == idx
                && le_u32(&page_buf, LP_CRC) == crc32c::crc32c(&page_buf[..16])
                && expect_seq.is_none_or(|e| e == seq);
            if !hdr_ok {
                s.problems
                    .push(Problem::BadPageHeader { area: idx, page: p });
                break;
            }
            let is_tail = tail_page == p;
            // tail_page 0: a first page was chained but nothing committed yet.
            let end = if is_tail {
                tail_off
            } else if tail_page == 0 {
                SLOT
            } else {
                PAGE
            };
            let mut info = PageInfo {
                page: p,
                seq,
                max_lsn: 0,
            };
            let mut off = SLOT;
            while off < end {
                match RawEntry::decode(&page_buf[off..]) {
                    Ok(mut e) => {
                        let n = e.nslots() * SLOT;
                        if let Some(why) = e.broken_invariant() {
                            // Paired with the log's assertion before it writes an entry.
                            s.problems.push(Problem::BrokenEntry {
                                area: idx,
                                page: p,
                                off,
                                why,
                            });
                            off += n;
                            continue;
                        }
                        if e.kind == Kind::Pad {
                            off += n;
                            continue; // closes a page: pieces of a record may continue after it
                        }
                        if e.kind == Kind::Part {
                            info.max_lsn = info.max_lsn.max(e.lsn);
                            s.max_lsn = s.max_lsn.max(e.lsn);
                            match &mut parts {
                                Some((l, b)) if *l == e.lsn => b.extend_from_slice(&e.payload),
                                // A different LSN: the earlier pieces' append failed.
                                _ => parts = Some((e.lsn, e.payload)),
                            }
                            off += n;
                            continue;
                        }
                        if let Some((l, mut b)) = parts.take() {
                            if l == e.lsn {
                                b.extend_from_slice(&e.payload);
                                e.payload = b;
                            }
                        }
                        if e.kind != Kind::Pad {
                            match Record::from_raw(&e) {
                                Some(rec) => {
                                    info.max_lsn = info.max_lsn.max(e.lsn);
                                    s.max_lsn = s.max_lsn.max(e.lsn);
                                    s.entries.push(ScannedEntry {
                                        lsn: e.lsn,
                                        area: idx,
                                        page: p,
                                        off,
                                        rec,
                                    });
                                }
                                None => s.problems.push(Problem::MalformedRecord {
                                    area: idx,
                                    page: p,
                                    off,
                                }),
                            }
                        }
                        off += n;
                    }
                    Err(err) => {
                        s.problems.push(Problem::UnreadableEntry {
                            area: idx,
                            page: p,
                            off,
                            reason: err.to_string(),
                        });
                        break;
                    }
                }
            }
            a.pages.push(info);
            if is_tail || tail_page == 0 {
                break;
            }
            let next = le_u64(&page_buf, LP_NEXT);
            if bad_page(next) {
                s.problems.push(Problem::ChainEnds {
                    area: idx,
                    page: p,
                    tail_page,
                });
                break;
            }
            expect_seq = Some(seq + 1);
            p = next as u32;
        }
        s.areas.push(a);
    }
    s.problems.splice(0..0, problems);
    s.entries.sort_by_key(|e| e.lsn);
    for w in s.entries.windows(2) {
        if w[0].lsn == w[1].lsn {
            s.problems.push(Problem::DuplicateLsn { lsn: w[0].lsn });
        }
    }
    Ok(s)
}

impl Scan {
    /// Per-fid write-back horizons (WriteBack records), the namespace under NAMESPACE_FID.
    fn wb_horizons(&self) -> HashMap<u64, u64> {
        let mut h: HashMap<u64, u64> = HashMap::new();
        for e in &self.entries {
            if let Record::WriteBack { fid, upto } = e.rec {
                let v = h.entry(fid).or_default();
                *v = (*v).max(upto);
            }
        }
        h
    }

    /// Is this record expired (its effect is durable in the lower file system)?
    pub fn expired(&self, e: &ScannedEntry, wb: &HashMap<u64, u64>) -> bool {
        e.lsn < self.checkpoint || wb.get(&e.rec.fid()).is_some_and(|&u| e.lsn < u)
    }

    /// Unexpired entries (binds and write-back records are bookkeeping, not counted).
    pub fn live_entries(&self) -> impl Iterator<Item = &ScannedEntry> {
        let wb = self.wb_horizons();
        self.entries.iter().filter(move |e| {
            !matches!(e.rec, Record::Bind { .. } | Record::WriteBack { .. })
                && !self.expired(e, &wb)
        })
    }

    /// Pages in use: log pages of every area, and data pages of unexpired out-of-place entries.
    pub fn used_pages(&self) -> BTreeSet<u32> {
        let mut used: BTreeSet<u32> = self
            .areas
            .iter()
            .flat_map(|a| a.pages.iter().map(|p| p.page))
            .collect();
        for e in self.live_entries() {
            if let Record::DataPage { page, .. } = e.rec {
                used.insert(page);
            }
        }
        used
    }

    /// The free-page pool rebuilt from the scan.
    pub fn free_pages(&self) -> Vec<u32> {
        let used = self.used_pages();
        (self.sb.first_alloc_page()..self.sb.pages())
            .filter(|p| !used.contains(p))
            .collect()
    }
}
