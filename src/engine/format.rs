//! On-media format of the PM log (version `VERSION`). The prose spec is `docs/format.md`; every
//! offset here is named there. A change to any layout bumps `VERSION`.

use crate::pmem::{le_u32, le_u64};

pub const MAGIC: u64 = u64::from_le_bytes(*b"PMSTACK\x01");
pub const VERSION: u32 = 4;
/// Oldest format this version reads: version 2 lacks `Part` entries, version 3 namespace
/// intents (`NsIntent`, `NsDone`).
pub const VERSION_MIN_READ: u32 = 2;
pub const PAGE: usize = 4096;
pub const SLOT: usize = 64;
pub const SLOTS_PER_PAGE: usize = PAGE / SLOT;
/// Page 0: superblock. Page 1: area table. Pages 2..: chunk table. Log and data pages follow.
pub const AREA_TABLE_PAGE: u32 = 1;
pub const CHUNK_TABLE_PAGE: u32 = 2;
/// Pages are handed to processes in chunks of this many, claimed in the chunk table.
pub const CHUNK_PAGES: u32 = 64;
pub const MAX_AREAS: u32 = 64;
pub const AREA_SLOT: usize = 64;
pub const MIN_PAGES: u64 = 64;

// Superblock fields (immutable part, covered by the crc at SB_CRC).
pub const SB_MAGIC: usize = 0;
pub const SB_VERSION: usize = 8;
pub const SB_PAGE_SIZE: usize = 12;
pub const SB_REGION_BYTES: usize = 16;
pub const SB_UUID: usize = 24;
pub const SB_LOWER_ID: usize = 40;
pub const SB_AREAS: usize = 56;
pub const SB_CRC: usize = 60;
// Mutable 8-byte words, each in its own cache line, not covered by the crc.
/// 1 after a clean unmount (log empty, lower complete), 0 while mounted.
pub const SB_CLEAN: usize = 128;
/// Every entry with an LSN below this is expired (written back), in every area.
pub const SB_CHECKPOINT: usize = 192;
/// The next LSN, shared by every process appending to the region (fetch-and-add; volatile:
/// recovery re-derives it from the log).
pub const SB_NEXT_LSN: usize = 256;

// Area table slot fields (8-byte words).
pub const AREA_OWNER: usize = 0;
pub const AREA_HEAD: usize = 8;
pub const AREA_TAIL: usize = 16;

// Log page header.
pub const LP_MAGIC: u32 = u32::from_le_bytes(*b"LOGP");
pub const LP_MAGIC_OFF: usize = 0;
pub const LP_AREA: usize = 4;
pub const LP_SEQ: usize = 8;
pub const LP_NEXT: usize = 16;
pub const LP_CRC: usize = 24;

// Entry header.
pub const E_CRC: usize = 0;
pub const E_KIND: usize = 4;
pub const E_SUB: usize = 5;
pub const E_NSLOTS: usize = 6;
pub const E_LSN: usize = 8;
pub const E_FID: usize = 16;
pub const E_A: usize = 24;
pub const E_B: usize = 32;
pub const E_C: usize = 40;
pub const E_D: usize = 48;
pub const E_PLEN: usize = 56;
pub const E_E: usize = 60;
pub const E_HDR: usize = 64;
/// Largest payload of one entry: a full page of slots minus the page header and entry header.
pub const MAX_PAYLOAD: usize = PAGE - SLOT - E_HDR;

/// Entry kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[repr(u8)]
pub enum Kind {
    Pad = 1,
    DataInPlace = 2,
    DataPage = 3,
    Bind = 4,
    Namespace = 5,
    Attr = 6,
    WriteBack = 7,
    /// A leading piece of a record whose payload is larger than one entry can hold
    /// (`MAX_PAYLOAD`): its payload is prepended to the next entry of the same area with the
    /// same LSN. Pieces whose final entry never followed (the append failed: PM full) are
    /// not a record and are ignored.
    Part = 8,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Pad,
            2 => Kind::DataInPlace,
            3 => Kind::DataPage,
            4 => Kind::Bind,
            5 => Kind::Namespace,
            6 => Kind::Attr,
            7 => Kind::WriteBack,
            8 => Kind::Part,
            _ => return None,
        })
    }
}

/// A log entry as stored: a 64-byte header with generic fields and a payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawEntry {
    pub kind: Kind,
    pub sub: u8,
    pub lsn: u64,
    pub fid: u64,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub d: u64,
    pub e: u32,
    pub payload: Vec<u8>,
}

impl RawEntry {
    pub fn new(kind: Kind, fid: u64) -> Self {
        RawEntry {
            kind,
            sub: 0,
            lsn: 0,
            fid,
            a: 0,
            b: 0,
            c: 0,
            d: 0,
            e: 0,
            payload: Vec::new(),
        }
    }

    pub fn nslots(&self) -> usize {
        (E_HDR + self.payload.len()).div_ceil(SLOT)
    }

    /// What an entry must satisfy on both sides of the persistence boundary: the log asserts
    /// it right before an entry is written (a violation is a bug in pmstack) and the scan
    /// checks it right after an entry is read back (a violation is damage, reported as a
    /// problem and never replayed). None: the entry is sound.
    pub fn broken_invariant(&self) -> Option<&'static str> {
        if self.payload.len() > MAX_PAYLOAD {
            return Some("payload larger than one entry");
        }
        if self.kind != Kind::Pad && self.lsn == 0 {
            return Some("a record without a sequence number");
        }
        if self.kind == Kind::Part && self.payload.len() != MAX_PAYLOAD {
            return Some("a leading piece of a record that does not fill its entry");
        }
        if self.kind == Kind::Pad && self.lsn != 0 {
            return Some("a pad with a sequence number");
        }
        None
    }

    /// Serialize, including the crc over everything after the crc field.
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.payload.len() <= MAX_PAYLOAD, "entry payload too large");
        let n = self.nslots();
        let mut b = vec![0u8; n * SLOT];
        b[E_KIND] = self.kind as u8;
        b[E_SUB] = self.sub;
        b[E_NSLOTS..E_NSLOTS + 2].copy_from_slice(&(n as u16).to_le_bytes());
        for (off, v) in [
            (E_LSN, self.lsn),
            (E_FID, self.fid),
            (E_A, self.a),
            (E_B, self.b),
            (E_C, self.c),
            (E_D, self.d),
        ] {
            b[off..off + 8].copy_from_slice(&v.to_le_bytes());
        }
        b[E_PLEN..E_PLEN + 4].copy_from_slice(&(self.payload.len() as u32).to_le_bytes());
        b[E_E..E_E + 4].copy_from_slice(&self.e.to_le_bytes());
        b[E_HDR..E_HDR + self.payload.len()].copy_from_slice(&self.payload);
        let crc = crc32c::crc32c(&b[4..E_HDR + self.payload.len()]);
        b[E_CRC..E_CRC + 4].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parse an entry at the start of `b` (which extends to the end of its page).
    pub fn decode(b: &[u8]) -> Result<RawEntry, EntryError> {
        if b.len() < E_HDR {
            return Err(EntryError::Truncated);
        }
        let nslots = u16::from_le_bytes([b[E_NSLOTS], b[E_NSLOTS + 1]]) as usize;
        let plen = le_u32(b, E_PLEN) as usize;
        if nslots == 0 || nslots * SLOT > b.len() || E_HDR + plen > nslots * SLOT {
            return Err(EntryError::BadLength);
        }
        let crc = le_u32(b, E_CRC);
        if crc32c::crc32c(&b[4..E_HDR + plen]) != crc {
            return Err(EntryError::Checksum);
        }
        let kind = Kind::from_u8(b[E_KIND]).ok_or(EntryError::BadKind(b[E_KIND]))?;
        Ok(RawEntry {
            kind,
            sub: b[E_SUB],
            lsn: le_u64(b, E_LSN),
            fid: le_u64(b, E_FID),
            a: le_u64(b, E_A),
            b: le_u64(b, E_B),
            c: le_u64(b, E_C),
            d: le_u64(b, E_D),
            e: le_u32(b, E_E),
            payload: b[E_HDR..E_HDR + plen].to_vec(),
        })
    }

    /// Slots the entry occupies, read from a header without validating it.
    pub fn slots_at(b: &[u8]) -> usize {
        u16::from_le_bytes([b[E_NSLOTS], b[E_NSLOTS + 1]]) as usize
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    #[error("entry truncated")]
    Truncated,
    #[error("entry length field out of range")]
    BadLength,
    #[error("entry checksum mismatch")]
    Checksum,
    #[error("unknown entry kind {0}")]
    BadKind(u8),
}

/// Length-prefixed fields inside a payload (names, handles, xattr values).
pub fn put_field(out: &mut Vec<u8>, f: &[u8]) {
    out.extend_from_slice(&(f.len() as u32).to_le_bytes());
    out.extend_from_slice(f);
}

pub fn get_fields(p: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut v = Vec::new();
    let mut i = 0;
    while i < p.len() {
        if i + 4 > p.len() {
            return None;
        }
        let n = le_u32(p, i) as usize;
        i += 4;
        if i + n > p.len() {
            return None;
        }
        v.push(p[i..i + n].to_vec());
        i += n;
    }
    Some(v)
}

/// The immutable superblock fields.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Superblock {
    pub version: u32,
    pub region_bytes: u64,
    pub uuid: [u8; 16],
    pub lower_id: [u8; 16],
    pub areas: u32,
}

impl Superblock {
    pub fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[SB_MAGIC..SB_MAGIC + 8].copy_from_slice(&MAGIC.to_le_bytes());
        b[SB_VERSION..SB_VERSION + 4].copy_from_slice(&self.version.to_le_bytes());
        b[SB_PAGE_SIZE..SB_PAGE_SIZE + 4].copy_from_slice(&(PAGE as u32).to_le_bytes());
        b[SB_REGION_BYTES..SB_REGION_BYTES + 8].copy_from_slice(&self.region_bytes.to_le_bytes());
        b[SB_UUID..SB_UUID + 16].copy_from_slice(&self.uuid);
        b[SB_LOWER_ID..SB_LOWER_ID + 16].copy_from_slice(&self.lower_id);
        b[SB_AREAS..SB_AREAS + 4].copy_from_slice(&self.areas.to_le_bytes());
        let crc = crc32c::crc32c(&b[..SB_CRC]);
        b[SB_CRC..SB_CRC + 4].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8], actual_len: u64) -> Result<Superblock, SbError> {
        if b.len() < 64 || actual_len < MIN_PAGES * PAGE as u64 {
            return Err(SbError::TooSmall(actual_len));
        }
        if le_u64(b, SB_MAGIC) != MAGIC {
            return Err(SbError::BadMagic);
        }
        let version = le_u32(b, SB_VERSION);
        if !(VERSION_MIN_READ..=VERSION).contains(&version) {
            return Err(SbError::Version(version));
        }
        if crc32c::crc32c(&b[..SB_CRC]) != le_u32(b, SB_CRC) {
            return Err(SbError::Checksum);
        }
        if le_u32(b, SB_PAGE_SIZE) as usize != PAGE {
            return Err(SbError::Geometry("page size".into()));
        }
        let region_bytes = le_u64(b, SB_REGION_BYTES);
        if region_bytes > actual_len {
            return Err(SbError::Truncated {
                expected: region_bytes,
                actual: actual_len,
            });
        }
        if region_bytes % PAGE as u64 != 0 || region_bytes < MIN_PAGES * PAGE as u64 {
            return Err(SbError::Geometry("region size".into()));
        }
        let areas = le_u32(b, SB_AREAS);
        if areas == 0 || areas > MAX_AREAS {
            return Err(SbError::Geometry(format!("{areas} areas")));
        }
        Ok(Superblock {
            version,
            region_bytes,
            uuid: b[SB_UUID..SB_UUID + 16].try_into().expect("16"),
            lower_id: b[SB_LOWER_ID..SB_LOWER_ID + 16].try_into().expect("16"),
            areas,
        })
    }

    pub fn pages(&self) -> u32 {
        (self.region_bytes / PAGE as u64) as u32
    }

    /// Pages of the chunk table (8 bytes per chunk).
    pub fn chunk_table_pages(&self) -> u32 {
        (self.pages() / CHUNK_PAGES * 8)
            .div_ceil(PAGE as u32)
            .max(1)
    }

    /// The first page that holds log or data.
    pub fn first_alloc_page(&self) -> u32 {
        CHUNK_TABLE_PAGE + self.chunk_table_pages()
    }

    pub fn chunks(&self) -> u32 {
        (self.pages() - self.first_alloc_page()).div_ceil(CHUNK_PAGES)
    }

    /// Pages of chunk `c`.
    pub fn chunk_pages(&self, c: u32) -> std::ops::Range<u32> {
        let s = self.first_alloc_page() + c * CHUNK_PAGES;
        s..(s + CHUNK_PAGES).min(self.pages())
    }

    /// Offset of chunk `c`'s owner word (0: free; else 1 + the owning area).
    pub fn chunk_word(&self, c: u32) -> usize {
        CHUNK_TABLE_PAGE as usize * PAGE + c as usize * 8
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SbError {
    #[error("region is too small ({0} bytes; a region needs at least 256 KiB) or truncated")]
    TooSmall(u64),
    #[error("not a pmstack region (bad magic); format it with `pmstack format`")]
    BadMagic,
    #[error("unsupported format version {0} (this pmstack reads version 2)")]
    Version(u32),
    #[error("superblock checksum mismatch: the region is corrupted")]
    Checksum,
    #[error("region is truncated: superblock says {expected} bytes, file has {actual}")]
    Truncated { expected: u64, actual: u64 },
    #[error("superblock geometry is invalid ({0})")]
    Geometry(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_roundtrip_and_bitflip_detected() {
        let mut e = RawEntry::new(Kind::DataInPlace, 42);
        e.lsn = 7;
        e.a = 4096;
        e.payload = (0..300u32).map(|i| i as u8).collect();
        let mut b = e.encode();
        b.resize(PAGE - SLOT, 0);
        assert_eq!(RawEntry::decode(&b).unwrap(), e);
        for bit in [
            5 * 8,
            9 * 8 + 3,
            (E_HDR + 17) * 8 + 1,
            (E_HDR + 299) * 8 + 7,
        ] {
            let mut c = b.clone();
            c[bit / 8] ^= 1 << (bit % 8);
            assert!(
                RawEntry::decode(&c).is_err(),
                "flip of bit {bit} must be detected"
            );
        }
    }

    #[test]
    fn superblock_rejects_corruption() {
        let sb = Superblock {
            version: VERSION,
            region_bytes: MIN_PAGES * PAGE as u64,
            uuid: [1; 16],
            lower_id: [2; 16],
            areas: 8,
        };
        let b = sb.encode();
        assert_eq!(Superblock::decode(&b, sb.region_bytes).unwrap(), sb);
        let mut c = b;
        c[SB_UUID] ^= 1;
        assert_eq!(
            Superblock::decode(&c, sb.region_bytes),
            Err(SbError::Checksum)
        );
        let mut c = b;
        c[0] ^= 1;
        assert_eq!(
            Superblock::decode(&c, sb.region_bytes),
            Err(SbError::BadMagic)
        );
        assert!(matches!(
            Superblock::decode(&b, sb.region_bytes - PAGE as u64),
            Err(SbError::TooSmall(_) | SbError::Truncated { .. })
        ));
    }
}
