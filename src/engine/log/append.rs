//! Appending to one area: entries, out-of-place pages, new log pages, and the commit that
//! makes them durable at once (fences A and B of the module above).

use parking_lot::MutexGuard;

use super::*;

/// Exclusive use of one append area. Entries appended through it become durable, all at
/// once, at `commit`.
pub struct AreaGuard<'a> {
    pub(super) log: &'a Log,
    pub(super) a: MutexGuard<'a, Area>,
}

impl AreaGuard<'_> {
    /// Append a record; `lsn` None takes the next global LSN. Returns the LSN.
    pub fn append(&mut self, rec: &Record, lsn: Option<u64>) -> Result<u64, LogError> {
        self.append_inner(rec, lsn, false)
    }

    pub(super) fn append_reserved(
        &mut self,
        rec: &Record,
        lsn: Option<u64>,
    ) -> Result<u64, LogError> {
        self.append_inner(rec, lsn, true)
    }

    fn append_inner(
        &mut self,
        rec: &Record,
        lsn: Option<u64>,
        reserve_ok: bool,
    ) -> Result<u64, LogError> {
        let mut raw = rec.to_raw();
        let lsn = lsn.unwrap_or_else(|| self.log.next_lsn());
        if raw.payload.len() > MAX_PAYLOAD {
            // Larger than one entry (a PATH_MAX symlink target with a long name): leading
            // pieces as `Part` entries of the same LSN, the record's own entry last. All are
            // committed together by the area's next tail store.
            let payload = std::mem::take(&mut raw.payload);
            let mut chunks = payload.chunks(MAX_PAYLOAD);
            let last = chunks.next_back().unwrap_or(&[]);
            for c in chunks {
                let mut part = RawEntry::new(Kind::Part, raw.fid);
                part.payload = c.to_vec();
                self.put(part, lsn, reserve_ok)?;
            }
            raw.payload = last.to_vec();
        }
        self.put(raw, lsn, reserve_ok)?;
        let st = &self.log.stats;
        st.entries.fetch_add(1, Ordering::Relaxed);
        if let Record::Data { bytes, .. } = rec {
            st.bytes_inplace
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        Ok(lsn)
    }

    /// Write one entry (it fits a page) at the area's end, on a new page if needed.
    fn put(&mut self, mut raw: RawEntry, lsn: u64, reserve_ok: bool) -> Result<(), LogError> {
        let n = raw.nslots() * SLOT;
        if self.a.off + n > PAGE {
            self.new_page(reserve_ok)?;
        }
        raw.lsn = lsn;
        // Paired with the scan's check of every entry it reads back.
        if let Some(why) = raw.broken_invariant() {
            panic!("log entry about to be written is unsound ({why}): {raw:?}");
        }
        let bytes = raw.encode();
        if cfg!(any(test, debug_assertions)) {
            assert_eq!(
                RawEntry::decode(&bytes).as_ref(),
                Ok(&raw),
                "encoding round trip"
            );
        }
        let at = self.a.cur as usize * PAGE + self.a.off;
        assert!(
            self.a.cur != 0 && self.a.off >= SLOT && self.a.off + n <= PAGE,
            "entry placed outside its area's current page"
        );
        self.log.pm.write(at, &bytes);
        self.a.pending.push((at, bytes.len()));
        self.a.off += n;
        let (cur, off) = (self.a.cur, self.a.off);
        self.a.end = encode_tail(cur, off);
        if let Some(p) = self.a.pages.back_mut() {
            p.max_lsn = p.max_lsn.max(lsn);
        }
        Ok(())
    }

    /// Log a whole page of file data out of place: the bytes go to a fresh data page (with
    /// non-temporal stores), the entry records where.
    pub fn append_page(&mut self, fid: u64, off: u64, data: &[u8]) -> Result<u64, LogError> {
        assert_eq!(data.len(), PAGE, "out-of-place entries hold whole pages");
        assert_eq!(
            off % PAGE as u64,
            0,
            "out-of-place entries are page aligned"
        );
        // The data page first, then room for the entry: a log too full for either leaves the
        // area as it was (the page goes back), never on a new log page with nothing on it
        // while its tail is still on the page before (`commit` wants the tail on `cur`).
        let page = self.log.alloc(false).ok_or_else(|| {
            self.log.stats.full.fetch_add(1, Ordering::Relaxed);
            LogError::Full
        })?;
        if self.a.off + SLOT * 2 > PAGE {
            if let Err(e) = self.new_page(false) {
                self.log.release([page]);
                return Err(e);
            }
        }
        let at = page as usize * PAGE;
        self.log.pm.write_nt(at, data);
        if !self.log.pm.nt_durable_after_fence() {
            self.a.pending.push((at, PAGE));
        }
        let crc = crc32c::crc32c(data);
        let lsn = self.append(
            &Record::DataPage {
                fid,
                off,
                page,
                crc,
            },
            None,
        )?;
        self.log
            .oop
            .lock()
            .entry(fid)
            .or_default()
            .push((lsn, page));
        self.log
            .stats
            .bytes_pages
            .fetch_add(PAGE as u64, Ordering::Relaxed);
        Ok(lsn)
    }

    fn new_page(&mut self, reserve_ok: bool) -> Result<(), LogError> {
        let pm = &self.log.pm;
        let page = self.log.alloc(reserve_ok).ok_or_else(|| {
            self.log.stats.full.fetch_add(1, Ordering::Relaxed);
            LogError::Full
        })?;
        // Close the current page with a pad so recovery knows where its entries end.
        if self.a.cur != 0 && self.a.off < PAGE {
            let mut pad = RawEntry::new(Kind::Pad, 0);
            let slots = (PAGE - self.a.off) / SLOT;
            pad.payload = vec![0; slots * SLOT - E_HDR];
            let b = pad.encode();
            let at = self.a.cur as usize * PAGE + self.a.off;
            pm.write(at, &b);
            self.a.pending.push((at, b.len()));
        }
        let seq = self.a.seq + 1;
        let mut hdr = [0u8; SLOT];
        hdr[LP_MAGIC_OFF..4].copy_from_slice(&LP_MAGIC.to_le_bytes());
        hdr[LP_AREA..LP_AREA + 4].copy_from_slice(&self.a.idx.to_le_bytes());
        hdr[LP_SEQ..LP_SEQ + 8].copy_from_slice(&seq.to_le_bytes());
        let crc = crc32c::crc32c(&hdr[..16]);
        hdr[LP_CRC..LP_CRC + 4].copy_from_slice(&crc.to_le_bytes());
        let base = page as usize * PAGE;
        pm.write(base, &hdr);
        pm.persist(base, SLOT);
        if self.a.cur == 0 {
            pm.store_u64(area_word(self.a.idx, AREA_OWNER), std::process::id() as u64);
            store_sealed(&**pm, area_word(self.a.idx, AREA_HEAD), page as u64);
            pm.persist(area_word(self.a.idx, 0), 16);
        } else {
            let link = self.a.cur as usize * PAGE + LP_NEXT;
            pm.store_u64(link, page as u64);
            pm.persist(link, 8);
        }
        self.a.cur = page;
        self.a.off = SLOT;
        self.a.seq = seq;
        self.a.pages.push_back(LivePage { page, max_lsn: 0 });
        Ok(())
    }

    /// Make every entry appended so far durable: the commit protocol.
    pub fn commit(&mut self) {
        if self.a.end == self.a.committed {
            return;
        }
        let pm = &self.log.pm;
        for (at, len) in self.a.pending.drain(..) {
            pm.flush(at, len);
        }
        pm.fence(); // A: entries and data before the tail
                    // Paired with the scan's bounds check of the tail it reads back.
        let (tail_page, tail_off) = crate::engine::scan::decode_tail(self.a.end);
        assert!(
            tail_page == self.a.cur && (SLOT..=PAGE).contains(&tail_off) && tail_off % SLOT == 0,
            "committed tail {tail_page}:{tail_off} is not the end of the area's current page {}",
            self.a.cur
        );
        let tail = area_word(self.a.idx, AREA_TAIL);
        store_sealed(&**pm, tail, self.a.end);
        pm.persist(tail, 8); // B: tail durable before the caller acknowledges
        self.a.committed = self.a.end;
        self.log.stats.commits.fetch_add(1, Ordering::Relaxed);
    }
}
