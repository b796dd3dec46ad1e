//! The attached processes of the `pmstack run` histories (`super::run`): their descriptors
//! and their counters in the table.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::path::Path;
use std::sync::Arc;

use crate::front::client::{Client, Tracked};
use crate::front::table::{
    Table, P_FALLBACKS, P_NAME_SYNCS, P_NS_DIR_SYNCS, P_NS_SYNCS, P_UNSERVED,
};
use crate::pmem::sim::SimPmem;
use crate::sim::Kinds;

/// A process's descriptor of a file of the history.
pub(super) struct Open {
    pub(super) ino: u64,
    pub(super) fd: i32,
    pub(super) t: Arc<Tracked>,
}

/// The processes' counters in the table, summed: (real syncs, namespace write-backs,
/// unserved, those write-backs that synced only directories, real syncs that synced the
/// file's path too).
pub(super) fn counters(t: &Table, pids: &[u64]) -> (u64, u64, u64, u64, u64) {
    let mut sum = (0, 0, 0, 0, 0);
    for &pid in pids {
        let w = t
            .counters_of(pid)
            .expect("the simulated program is attached");
        sum.0 += w[P_FALLBACKS];
        sum.1 += w[P_NS_SYNCS];
        sum.2 += w[P_UNSERVED];
        sum.3 += w[P_NS_DIR_SYNCS];
        sum.4 += w[P_NAME_SYNCS];
    }
    sum
}

/// The namespace target of the absolute `path` under the root, as `c` finds it (as the
/// library takes a path: kept directories are then found again without opening them,
/// `Client::dir_at`).
pub(super) fn target(c: &Client, path: Vec<u8>) -> crate::front::ns::Target {
    c.targets(&[(libc::AT_FDCWD, path)], |_, _| true)
        .and_then(|mut t| t.pop())
        .expect("a name under the root")
}

/// A descriptor of the file at `path`, opened and tracked by `c` (O_SYNC if `sync`), with
/// the access mode and O_APPEND of `mode` (`open_mode`).
pub(super) fn open_path(c: &Client, path: &[u8], sync: bool, mode: i32) -> Open {
    let p = CString::new(path).unwrap();
    // SAFETY: a C string; the descriptor is this history's.
    let fd = unsafe { libc::open(p.as_ptr(), mode | libc::O_CLOEXEC) };
    assert!(fd >= 0, "opening {}", String::from_utf8_lossy(path));
    let t = c.track_under(fd, sync, Some(mode)).unwrap();
    Open {
        ino: ino_of(fd),
        fd,
        t,
    }
}

/// Whether process `w`'s descriptors of file `id` are write-only (`Kinds::write_only`).
pub(super) fn write_only(kinds: Kinds, w: usize, id: u32) -> bool {
    kinds.write_only && (id as usize + w) % 3 == 0
}

/// Whether process `w`'s descriptors of file `id` are O_APPEND (`Kinds::appends`).
pub(super) fn appending(kinds: Kinds, w: usize, id: u32) -> bool {
    kinds.appends && (id as usize + w) % 4 == 1
}

/// Whether process `w`'s descriptors of file `id` are O_DIRECT (`Kinds::direct`).
pub(super) fn direct(kinds: Kinds, w: usize, id: u32) -> bool {
    kinds.direct && (id as usize + w) % 5 == 3 && !appending(kinds, w, id)
}

/// The access mode, O_APPEND and O_DIRECT of process `w`'s descriptors of file `id`.
pub(super) fn open_mode(kinds: Kinds, w: usize, id: u32) -> i32 {
    let acc = if write_only(kinds, w, id) {
        libc::O_WRONLY
    } else {
        libc::O_RDWR
    };
    let append = if appending(kinds, w, id) {
        libc::O_APPEND
    } else {
        0
    };
    let direct = if direct(kinds, w, id) {
        libc::O_DIRECT
    } else {
        0
    };
    acc | append | direct
}

/// Process `w`'s descriptor of file `id` (at `path`), opened now if it has none (O_SYNC as
/// another process's descriptor of it is). `opens`: each process's descriptors, by file id.
pub(super) fn open_in<'a>(
    clients: &[Client],
    opens: &'a mut [BTreeMap<u32, Open>],
    w: usize,
    id: u32,
    path: &[u8],
    kinds: Kinds,
) -> &'a Open {
    if !opens[w].contains_key(&id) {
        let sync = opens
            .iter()
            .find_map(|m| m.get(&id))
            .is_some_and(|o| o.t.sync);
        let o = open_path(&clients[w], path, sync, open_mode(kinds, w, id));
        opens[w].insert(id, o);
    }
    &opens[w][&id]
}

/// Close every process's descriptor of file `id` (its last name is gone).
pub(super) fn close_everywhere(clients: &[Client], opens: &mut [BTreeMap<u32, Open>], id: u32) {
    for (k, m) in opens.iter_mut().enumerate() {
        if let Some(o) = m.remove(&id) {
            close(&clients[k], o.fd);
        }
    }
}

pub(super) fn ino_of(fd: i32) -> u64 {
    crate::front::sys::fstat(fd).expect("fstat").st_ino
}

/// The size of the file `fd` is open on.
pub(super) fn ino_size(fd: i32) -> u64 {
    crate::front::sys::fstat(fd).expect("fstat").st_size as u64
}

pub(super) fn close(c: &Client, fd: i32) {
    c.untrack(fd);
    // SAFETY: a descriptor this history opened and no longer uses.
    unsafe { libc::close(fd) };
}

/// The attached processes of a history and their clients of the daemon whose table is at
/// `table` (`epoch`), on `pm`, for the lower at `lower`: with `two` (`Kinds::threads`), two,
/// each with its append area, process record and descriptors; each operation is one
/// process's (one at a time). The second goes by the pid of a process that outlives the
/// history (its parent's), as the table takes a dead pid's record for free.
pub(super) fn attach_processes(
    two: bool,
    table: &Path,
    epoch: u64,
    pm: &Arc<SimPmem>,
    lower: &Path,
) -> (Vec<u64>, Vec<Client>) {
    let pids = if two {
        // SAFETY: getppid has no preconditions.
        let parent = unsafe { libc::getppid() } as u64;
        vec![crate::front::table::my_pid(), parent.max(1)]
    } else {
        vec![crate::front::table::my_pid()]
    };
    let clients = pids
        .iter()
        .map(|&pid| {
            Client::attach_as(Table::open(table).unwrap(), epoch, pm.clone(), lower, pid).unwrap()
        })
        .collect();
    (pids, clients)
}
