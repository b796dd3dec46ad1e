//! A program that is not attached, in the `pmstack run` histories (`Kinds::outside`): it
//! changes names in the lower itself, nothing of it logged, and fsyncs the directories it
//! changed before the next operation (durable by the lower's own means). It renames and
//! removes only files it made whose names no attached process changed since (`ids`): a name
//! whose creation is still in the log, removed or renamed over by a program pmstack does not
//! see, may come back in recovery (the known limit in `docs/preload.md`). With
//! `Kinds::unsynced_outside` it also makes files it syncs nothing of, their names nor their
//! bytes (`Model::unsettled`).

use std::collections::BTreeSet;
use std::fs;
use std::os::fd::AsRawFd;
use std::path::Path;

use rand::rngs::StdRng;
use rand::Rng;

use super::{new_file_name, pattern, Kinds, Model, Stash};

/// What `change` did.
pub(super) struct Change {
    /// The inode of the file it made.
    pub(super) made: Option<u64>,
    /// The file id whose last name it removed.
    pub(super) gone: Option<u32>,
    /// It synced what it changed (the lower's journal committed its names up to here).
    pub(super) synced: bool,
    /// It renamed a file (and synced nothing: `Kinds::unsynced_renames`).
    pub(super) renamed: bool,
}

fn sync_dir_of(path: &Path) {
    let d = path.parent().expect("a name under the lower");
    let f = fs::File::open(d).expect("harness: open of a directory");
    crate::lower::real::fsync(f.as_raw_fd(), false).expect("harness: fsync of a directory");
}

/// One change (in operation `op`): an empty file made (its data and name synced), a file of
/// `ids` renamed to a new name, or one removed; with `Kinds::unsynced_outside`, also a file
/// made, maybe with a record written to it, and nothing synced; with
/// `Kinds::unsynced_renames`, also a file of `ids` renamed, nothing synced; with
/// `Kinds::unsynced_removals`, one removed, nothing synced. `ids`: the files it made
/// whose names no attached process changed since (the caller takes out those an attached
/// process touches). None if it changed nothing.
#[allow(clippy::too_many_arguments)]
pub(super) fn change(
    ids: &mut BTreeSet<u32>,
    rng: &mut StdRng,
    model: &mut Model,
    kinds: Kinds,
    lower: &Path,
    stash: &Stash,
    next_file: &mut u32,
    op: usize,
) -> Option<Change> {
    let names: Vec<String> = model
        .names
        .iter()
        .filter(|(_, id)| ids.contains(*id))
        .map(|(n, _)| n.clone())
        .collect();
    // Its files whose names are settled: those it renames or removes without a sync.
    let settled: Vec<String> = names
        .iter()
        .filter(|n| !model.is_unsettled(model.names[*n]))
        .cloned()
        .collect();
    let at = |n: &str| lower.join(n);
    let one_of = |rng: &mut StdRng, names: &[String]| names[rng.gen_range(0..names.len())].clone();
    // A name for a file it makes or renames to, that the model does not have.
    let new_name = |rng: &mut StdRng, model: &Model| {
        let name = new_file_name(rng, model, kinds);
        (!model.names.contains_key(&name)).then_some(name)
    };
    let create = |name: &str| {
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(at(name))
            .expect("harness: a new file")
    };
    let did = |made, gone, synced, renamed| {
        Some(Change {
            made,
            gone,
            synced,
            renamed,
        })
    };
    let kinds_of_change = match (
        kinds.unsynced_outside,
        kinds.unsynced_renames,
        kinds.unsynced_removals,
    ) {
        (false, _, _) => 3,
        (true, false, false) => 4,
        (true, true, false) => 5,
        (true, _, true) => 6,
    };
    match rng.gen_range(0..kinds_of_change) {
        0 => {
            let name = new_name(rng, model)?;
            let f = create(&name);
            // Its (empty) data durable too, as a careful program makes it.
            f.sync_all().expect("harness: fsync");
            sync_dir_of(&at(&name));
            *next_file += 1;
            ids.insert(*next_file);
            model.create(&name, *next_file);
            let ino = crate::lower::real::fstat(f.as_raw_fd())
                .expect("harness: fstat")
                .st_ino;
            did(Some(ino), None, true, false)
        }
        1 if !names.is_empty() => {
            let a = one_of(rng, &names);
            let b = new_name(rng, model)?;
            stash.keep_last(lower, &b);
            fs::rename(at(&a), at(&b)).expect("harness: rename");
            sync_dir_of(&at(&a));
            sync_dir_of(&at(&b));
            did(None, model.rename(&a, &b), true, false)
        }
        2 if !names.is_empty() => {
            let a = one_of(rng, &names);
            stash.keep_last(lower, &a);
            fs::remove_file(at(&a)).expect("harness: unlink");
            sync_dir_of(&at(&a));
            did(None, model.unlink(&a), true, false)
        }
        3 => {
            let name = new_name(rng, model)?;
            let f = create(&name);
            *next_file += 1;
            ids.insert(*next_file);
            model.create_unsettled(&name, *next_file, op);
            if rng.gen_bool(0.5) {
                // A record of its own, in the page cache only.
                use std::os::unix::fs::FileExt;
                let len = rng.gen_range(1..3000);
                let (id, idx) = model.write(&name, len, false);
                f.write_all_at(&pattern(id, idx, len), idx * super::REC)
                    .expect("harness: a write");
            }
            did(None, None, false, false)
        }
        4 if kinds.unsynced_renames && !settled.is_empty() => {
            // A rename to a new name, nothing synced.
            let a = one_of(rng, &settled);
            let b = new_name(rng, model)?;
            stash.keep_last(lower, &b);
            fs::rename(at(&a), at(&b)).expect("harness: rename");
            model.rename_unsettled(&a, &b, op);
            did(None, None, false, true)
        }
        4 | 5 if kinds.unsynced_removals && !settled.is_empty() => {
            // A removal, nothing synced.
            let a = one_of(rng, &settled);
            stash.keep_last(lower, &a);
            fs::remove_file(at(&a)).expect("harness: unlink");
            did(None, model.unlink_unsettled(&a, op), false, false)
        }
        _ => None,
    }
}
