//! A program that is not attached, in the `pmstack run` histories (`Kinds::outside`): it
//! changes names in the lower itself, nothing of it logged, and fsyncs the directories it
//! changed before the next operation (durable by the lower's own means). It renames and
//! removes only files it made whose names no attached process changed since (`ids`): a name
//! whose creation is still in the log, removed or renamed over by a program pmstack does not
//! see, may come back in recovery (the known limit in `docs/preload.md`).

use std::collections::BTreeSet;
use std::fs;
use std::os::fd::AsRawFd;
use std::path::Path;

use rand::rngs::StdRng;
use rand::Rng;

use super::{new_file_name, Kinds, Model, Stash};

fn sync_dir_of(path: &Path) {
    let d = path.parent().expect("a name under the lower");
    let f = fs::File::open(d).expect("harness: open of a directory");
    crate::lower::real::fsync(f.as_raw_fd(), false).expect("harness: fsync of a directory");
}

/// One change: an empty file made (its data and name synced), a file of `ids` renamed to a
/// new name, or one removed. `ids`: the files it made whose names no attached process
/// changed since (the caller takes out those an attached process touches). Returns the inode
/// it made, and the file id whose last name it removed; None if it changed nothing.
pub(super) fn change(
    ids: &mut BTreeSet<u32>,
    rng: &mut StdRng,
    model: &mut Model,
    kinds: Kinds,
    lower: &Path,
    stash: &Stash,
    next_file: &mut u32,
) -> Option<(Option<u64>, Option<u32>)> {
    let names: Vec<String> = model
        .names
        .iter()
        .filter(|(_, id)| ids.contains(*id))
        .map(|(n, _)| n.clone())
        .collect();
    let at = |n: &str| lower.join(n);
    match rng.gen_range(0..3) {
        0 => {
            let name = new_file_name(rng, model, kinds);
            if model.names.contains_key(&name) {
                return None;
            }
            let f = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(at(&name))
                .expect("harness: a new file");
            // Its (empty) data durable too, as a careful program makes it.
            f.sync_all().expect("harness: fsync");
            sync_dir_of(&at(&name));
            *next_file += 1;
            ids.insert(*next_file);
            model.create(&name, *next_file);
            let ino = crate::lower::real::fstat(f.as_raw_fd())
                .expect("harness: fstat")
                .st_ino;
            Some((Some(ino), None))
        }
        1 if !names.is_empty() => {
            let a = names[rng.gen_range(0..names.len())].clone();
            let b = new_file_name(rng, model, kinds);
            if model.names.contains_key(&b) {
                return None;
            }
            stash.keep_last(lower, &b);
            fs::rename(at(&a), at(&b)).expect("harness: rename");
            sync_dir_of(&at(&a));
            sync_dir_of(&at(&b));
            Some((None, model.rename(&a, &b)))
        }
        2 if !names.is_empty() => {
            let a = names[rng.gen_range(0..names.len())].clone();
            stash.keep_last(lower, &a);
            fs::remove_file(at(&a)).expect("harness: unlink");
            sync_dir_of(&at(&a));
            Some((None, model.unlink(&a)))
        }
        _ => None,
    }
}
