//! Every record kind survives encoding and decoding.

use super::*;

#[test]
fn every_record_kind_roundtrips() {
    let recs = vec![
        Record::Data {
            fid: 9,
            off: 3,
            bytes: b"hello".to_vec(),
        },
        Record::DataPage {
            fid: 9,
            off: 8192,
            page: 77,
            crc: 0xdead,
        },
        Record::Bind {
            fid: 9,
            handle: vec![1, 2, 3, 4, 5, 6, 7, 8, 9],
        },
        Record::WriteBack { fid: 0, upto: 1234 },
        Record::Attr {
            fid: 4,
            op: AttrOp::Truncate(99),
        },
        Record::Attr {
            fid: 4,
            op: AttrOp::Chmod(0o644),
        },
        Record::Attr {
            fid: 4,
            op: AttrOp::Chown(1, u32::MAX),
        },
        Record::Attr {
            fid: 4,
            op: AttrOp::Times {
                atime_ns: None,
                mtime_ns: Some(-5),
            },
        },
        Record::Attr {
            fid: 4,
            op: AttrOp::SetXattr {
                name: b"user.a".to_vec(),
                value: vec![0; 3],
                flags: 1,
            },
        },
        Record::Attr {
            fid: 4,
            op: AttrOp::RemoveXattr {
                name: b"user.a".to_vec(),
            },
        },
        Record::Attr {
            fid: 4,
            op: AttrOp::Fallocate {
                mode: 3,
                offset: 5,
                len: 6,
            },
        },
        Record::Ns(NsOp::Create {
            parent: 1,
            name: b"a".to_vec(),
            child: 5,
            kind: NodeKind::Symlink,
            mode: 0o777,
            rdev: 0,
            uid: 1000,
            gid: 100,
            target: b"../x".to_vec(),
        }),
        Record::Ns(NsOp::Remove {
            parent: 1,
            name: b"a".to_vec(),
            dir: true,
            victim: 12,
            nlink: 2,
        }),
        Record::Ns(NsOp::Rename {
            parent: 1,
            name: b"a".to_vec(),
            newparent: 2,
            newname: b"b".to_vec(),
            flags: 2,
            src: 8,
            victim: 9,
        }),
        Record::Ns(NsOp::Link {
            fid: 5,
            newparent: 2,
            newname: b"c".to_vec(),
            nlink: 3,
        }),
        Record::NsIntent(NsOp::Rename {
            parent: 1,
            name: b"a".to_vec(),
            newparent: 2,
            newname: b"b".to_vec(),
            flags: 2,
            src: 8,
            victim: 9,
        }),
        Record::NsIntent(NsOp::Remove {
            parent: 1,
            name: b"a".to_vec(),
            dir: false,
            victim: 12,
            nlink: 2,
        }),
        Record::NsDone {
            lsn: 77,
            applied: true,
        },
        Record::NsDone {
            lsn: 78,
            applied: false,
        },
    ];
    for r in recs {
        let raw = r.to_raw();
        let enc = raw.encode();
        let dec = RawEntry::decode(&enc).unwrap();
        assert_eq!(Record::from_raw(&dec).as_ref(), Some(&r));
    }
}
