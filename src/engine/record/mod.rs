//! Typed log records and their mapping onto [`RawEntry`] fields (see `docs/format.md`).
//!
//! Files are named by a file id (`fid`): a number the fs core gives each object; a `Bind`
//! record ties a fid to the lower file system's handle of the object, so recovery can find it
//! again. Fid 1 is always the lower root directory.

use super::format::{get_fields, put_field, Kind, RawEntry};

pub const ROOT_FID: u64 = 1;
/// The fid that write-back records use for "the namespace".
pub const NAMESPACE_FID: u64 = 0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[repr(u8)]
pub enum NodeKind {
    File = 1,
    Dir = 2,
    Symlink = 3,
    Fifo = 4,
    Socket = 5,
    CharDev = 6,
    BlockDev = 7,
}

impl NodeKind {
    /// The kind of an object from its `st_mode`.
    pub fn from_mode(mode: u32) -> Self {
        match mode & libc::S_IFMT {
            libc::S_IFDIR => Self::Dir,
            libc::S_IFLNK => Self::Symlink,
            libc::S_IFIFO => Self::Fifo,
            libc::S_IFSOCK => Self::Socket,
            libc::S_IFCHR => Self::CharDev,
            libc::S_IFBLK => Self::BlockDev,
            _ => Self::File,
        }
    }

    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::File,
            2 => Self::Dir,
            3 => Self::Symlink,
            4 => Self::Fifo,
            5 => Self::Socket,
            6 => Self::CharDev,
            7 => Self::BlockDev,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NsOp {
    /// `child` was created as `name` in `parent`.
    Create {
        parent: u64,
        name: Vec<u8>,
        child: u64,
        kind: NodeKind,
        mode: u32,
        rdev: u64,
        uid: u32,
        gid: u32,
        /// Symlink target; empty otherwise.
        target: Vec<u8>,
    },
    /// `name` in `parent` (which was object `victim`, with `nlink` names before: 0 when not
    /// known, in logs written before the count was recorded) was removed.
    Remove {
        parent: u64,
        name: Vec<u8>,
        dir: bool,
        victim: u64,
        nlink: u64,
    },
    /// `name` in `parent` (object `src`) moved to `newname` in `newparent`.
    /// (…replacing object `victim` at `newname`; 0: nothing replaced.)
    Rename {
        parent: u64,
        name: Vec<u8>,
        newparent: u64,
        newname: Vec<u8>,
        flags: u32,
        src: u64,
        victim: u64,
    },
    /// Object `fid` got a new name `newname` in `newparent`, after which it had `nlink`
    /// names (0: not known; logs written before the count was recorded).
    Link {
        fid: u64,
        newparent: u64,
        newname: Vec<u8>,
        nlink: u64,
    },
}

impl NsOp {
    /// The objects this operation names, which recovery must be able to find (the created
    /// child is not among them: its creation record describes it).
    pub fn named_fids(&self) -> Vec<u64> {
        match self {
            NsOp::Create { parent, .. } => vec![*parent],
            NsOp::Remove { parent, victim, .. } => vec![*parent, *victim],
            NsOp::Rename {
                parent,
                newparent,
                src,
                ..
            } => vec![*parent, *newparent, *src],
            NsOp::Link { fid, newparent, .. } => vec![*fid, *newparent],
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttrOp {
    Truncate(u64),
    Chmod(u32),
    /// u32::MAX leaves that id unchanged.
    Chown(u32, u32),
    /// Nanoseconds since the epoch; None leaves that time unchanged.
    Times {
        atime_ns: Option<i64>,
        mtime_ns: Option<i64>,
    },
    SetXattr {
        name: Vec<u8>,
        value: Vec<u8>,
        flags: u32,
    },
    RemoveXattr {
        name: Vec<u8>,
    },
    /// fallocate(mode, offset, len) incl. punch hole.
    Fallocate {
        mode: u32,
        offset: u64,
        len: u64,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// Bytes written at `off` (byte granular, data inline).
    Data {
        fid: u64,
        off: u64,
        bytes: Vec<u8>,
    },
    /// A whole page written at `off` (page aligned), data in PM page `page` with crc `crc`.
    DataPage {
        fid: u64,
        off: u64,
        page: u32,
        crc: u32,
    },
    Bind {
        fid: u64,
        handle: Vec<u8>,
    },
    /// A namespace operation logged after the lower file system did it (creations; every
    /// namespace operation in logs of format version 3 and older).
    Ns(NsOp),
    /// A namespace operation logged before the lower file system saw it (renames, links,
    /// removals). It took effect if an `NsDone` with its LSN and `applied` follows; one with
    /// `applied: false` says it did not. Without either, it was in flight at the crash, and
    /// recovery asks the lower whether it happened (and records its answer the same way).
    NsIntent(NsOp),
    /// What became of the `NsIntent` of LSN `lsn`.
    NsDone {
        lsn: u64,
        applied: bool,
    },
    Attr {
        fid: u64,
        op: AttrOp,
    },
    /// Everything about `fid` (NAMESPACE_FID: every namespace record) below `upto` is durable
    /// in the lower file system.
    WriteBack {
        fid: u64,
        upto: u64,
    },
}

const NS_CREATE: u8 = 1;
const NS_REMOVE: u8 = 2;
const NS_RENAME: u8 = 3;
const NS_LINK: u8 = 4;
const NS_DONE: u8 = 5;
/// Or-ed into the operation's code: an `NsIntent`.
const NS_INTENT: u8 = 0x10;

const AT_TRUNC: u8 = 1;
const AT_CHMOD: u8 = 2;
const AT_CHOWN: u8 = 3;
const AT_TIMES: u8 = 4;
const AT_SETX: u8 = 5;
const AT_REMX: u8 = 6;
const AT_FALLOC: u8 = 7;

impl Record {
    /// The file a record belongs to (namespace records belong to the namespace).
    pub fn fid(&self) -> u64 {
        match self {
            Record::Data { fid, .. }
            | Record::DataPage { fid, .. }
            | Record::Bind { fid, .. }
            | Record::Attr { fid, .. }
            | Record::WriteBack { fid, .. } => *fid,
            Record::Ns(_) | Record::NsIntent(_) | Record::NsDone { .. } => NAMESPACE_FID,
        }
    }

    pub fn to_raw(&self) -> RawEntry {
        match self {
            Record::Data { fid, off, bytes } => {
                let mut e = RawEntry::new(Kind::DataInPlace, *fid);
                e.a = *off;
                e.payload = bytes.clone();
                e
            }
            Record::DataPage {
                fid,
                off,
                page,
                crc,
            } => {
                let mut e = RawEntry::new(Kind::DataPage, *fid);
                e.a = *off;
                e.b = *page as u64;
                e.e = *crc;
                e
            }
            Record::Bind { fid, handle } => {
                let mut e = RawEntry::new(Kind::Bind, *fid);
                e.payload = handle.clone();
                e
            }
            Record::WriteBack { fid, upto } => {
                let mut e = RawEntry::new(Kind::WriteBack, *fid);
                e.a = *upto;
                e
            }
            Record::Attr { fid, op } => {
                let mut e = RawEntry::new(Kind::Attr, *fid);
                match op {
                    AttrOp::Truncate(s) => {
                        e.sub = AT_TRUNC;
                        e.a = *s;
                    }
                    AttrOp::Chmod(m) => {
                        e.sub = AT_CHMOD;
                        e.a = *m as u64;
                    }
                    AttrOp::Chown(u, g) => {
                        e.sub = AT_CHOWN;
                        e.a = *u as u64;
                        e.b = *g as u64;
                    }
                    AttrOp::Times { atime_ns, mtime_ns } => {
                        e.sub = AT_TIMES;
                        e.a = atime_ns.unwrap_or(0) as u64;
                        e.b = mtime_ns.unwrap_or(0) as u64;
                        e.c = atime_ns.is_some() as u64 | (mtime_ns.is_some() as u64) << 1;
                    }
                    AttrOp::SetXattr { name, value, flags } => {
                        e.sub = AT_SETX;
                        e.a = *flags as u64;
                        put_field(&mut e.payload, name);
                        put_field(&mut e.payload, value);
                    }
                    AttrOp::RemoveXattr { name } => {
                        e.sub = AT_REMX;
                        put_field(&mut e.payload, name);
                    }
                    AttrOp::Fallocate { mode, offset, len } => {
                        e.sub = AT_FALLOC;
                        e.a = *offset;
                        e.b = *len;
                        e.c = *mode as u64;
                    }
                }
                e
            }
            Record::NsDone { lsn, applied } => {
                let mut e = RawEntry::new(Kind::Namespace, NAMESPACE_FID);
                e.sub = NS_DONE;
                e.a = *lsn;
                e.b = *applied as u64;
                e
            }
            Record::NsIntent(op) => {
                let mut e = Record::Ns(op.clone()).to_raw();
                e.sub |= NS_INTENT;
                e
            }
            Record::Ns(op) => {
                let mut e = RawEntry::new(Kind::Namespace, NAMESPACE_FID);
                match op {
                    NsOp::Create {
                        parent,
                        name,
                        child,
                        kind,
                        mode,
                        rdev,
                        uid,
                        gid,
                        target,
                    } => {
                        e.sub = NS_CREATE;
                        e.a = *parent;
                        e.b = *child;
                        e.c = (*kind as u64) << 32 | *mode as u64;
                        e.d = *rdev;
                        e.e = *uid;
                        put_field(&mut e.payload, name);
                        put_field(&mut e.payload, target);
                        put_field(&mut e.payload, &gid.to_le_bytes());
                    }
                    NsOp::Remove {
                        parent,
                        name,
                        dir,
                        victim,
                        nlink,
                    } => {
                        e.sub = NS_REMOVE;
                        e.a = *parent;
                        e.b = *victim;
                        e.c = *dir as u64;
                        e.d = *nlink;
                        put_field(&mut e.payload, name);
                    }
                    NsOp::Rename {
                        parent,
                        name,
                        newparent,
                        newname,
                        flags,
                        src,
                        victim,
                    } => {
                        e.sub = NS_RENAME;
                        e.a = *parent;
                        e.b = *newparent;
                        e.c = *flags as u64;
                        e.d = *src;
                        put_field(&mut e.payload, name);
                        put_field(&mut e.payload, newname);
                        put_field(&mut e.payload, &victim.to_le_bytes());
                    }
                    NsOp::Link {
                        fid,
                        newparent,
                        newname,
                        nlink,
                    } => {
                        e.sub = NS_LINK;
                        e.a = *fid;
                        e.b = *newparent;
                        e.c = *nlink;
                        put_field(&mut e.payload, newname);
                    }
                }
                e
            }
        }
    }

    /// Interpret a checksum-valid raw entry. `None` for pads and malformed payloads.
    pub fn from_raw(e: &RawEntry) -> Option<Record> {
        Some(match e.kind {
            Kind::Pad | Kind::Part => return None,
            Kind::DataInPlace => Record::Data {
                fid: e.fid,
                off: e.a,
                bytes: e.payload.clone(),
            },
            Kind::DataPage => Record::DataPage {
                fid: e.fid,
                off: e.a,
                page: u32::try_from(e.b).ok()?,
                crc: e.e,
            },
            Kind::Bind => Record::Bind {
                fid: e.fid,
                handle: e.payload.clone(),
            },
            Kind::WriteBack => Record::WriteBack {
                fid: e.fid,
                upto: e.a,
            },
            Kind::Attr => {
                let op = match e.sub {
                    AT_TRUNC => AttrOp::Truncate(e.a),
                    AT_CHMOD => AttrOp::Chmod(e.a as u32),
                    AT_CHOWN => AttrOp::Chown(e.a as u32, e.b as u32),
                    AT_TIMES => AttrOp::Times {
                        atime_ns: (e.c & 1 != 0).then_some(e.a as i64),
                        mtime_ns: (e.c & 2 != 0).then_some(e.b as i64),
                    },
                    AT_SETX => {
                        let mut f = get_fields(&e.payload)?.into_iter();
                        AttrOp::SetXattr {
                            name: f.next()?,
                            value: f.next()?,
                            flags: e.a as u32,
                        }
                    }
                    AT_REMX => AttrOp::RemoveXattr {
                        name: get_fields(&e.payload)?.into_iter().next()?,
                    },
                    AT_FALLOC => AttrOp::Fallocate {
                        mode: e.c as u32,
                        offset: e.a,
                        len: e.b,
                    },
                    _ => return None,
                };
                Record::Attr { fid: e.fid, op }
            }
            Kind::Namespace if e.sub == NS_DONE => Record::NsDone {
                lsn: e.a,
                applied: e.b != 0,
            },
            Kind::Namespace => {
                let mut f = get_fields(&e.payload)?.into_iter();
                let op = match e.sub & !NS_INTENT {
                    NS_CREATE => {
                        let name = f.next()?;
                        let target = f.next()?;
                        let gid = u32::from_le_bytes(f.next()?.try_into().ok()?);
                        NsOp::Create {
                            parent: e.a,
                            name,
                            child: e.b,
                            kind: NodeKind::from_u8((e.c >> 32) as u8)?,
                            mode: e.c as u32,
                            rdev: e.d,
                            uid: e.e,
                            gid,
                            target,
                        }
                    }
                    NS_REMOVE => NsOp::Remove {
                        parent: e.a,
                        name: f.next()?,
                        dir: e.c != 0,
                        victim: e.b,
                        nlink: e.d,
                    },
                    NS_RENAME => NsOp::Rename {
                        parent: e.a,
                        newparent: e.b,
                        flags: e.c as u32,
                        name: f.next()?,
                        newname: f.next()?,
                        src: e.d,
                        victim: u64::from_le_bytes(f.next()?.try_into().ok()?),
                    },
                    NS_LINK => NsOp::Link {
                        fid: e.a,
                        newparent: e.b,
                        newname: f.next()?,
                        nlink: e.c,
                    },
                    _ => return None,
                };
                if e.sub & NS_INTENT != 0 {
                    Record::NsIntent(op)
                } else {
                    Record::Ns(op)
                }
            }
        })
    }
}

#[cfg(test)]
mod tests;
