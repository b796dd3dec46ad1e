//! Syncs, for both front ends: what an fsync or fdatasync of a file or of a directory does
//! (absorbed by the log, or the lower file system's own), and what a creation, or any
//! namespace record, needs of the directories it changes. Each front end tells the facts
//! from its own per-object state (the mount's inode table, the shared table of
//! `pmstack run`) and carries out what these functions choose.

use std::io;

/// What a front end knows of a file when a program syncs it.
#[derive(Clone, Copy, Debug, Default)]
pub struct FileFacts {
    /// There is a log to absorb the sync: a PM mode, and under `pmstack run` a daemon
    /// serving it.
    pub logging: bool,
    /// Every write of the object was durable when it returned (strict mode): a sync has
    /// nothing left to do.
    pub durable_on_return: bool,
    /// Every change of the object since the lower last made it durable went through this
    /// front end and is logged or held as dirty by the caller: always through the mount
    /// (its lower changes only through it); under `pmstack run`, once the object has a
    /// baseline (it was born through the log, or its last sync was the lower's own) and
    /// every writer since was seen.
    pub all_changes_seen: bool,
    /// Another process wrote to the object without logging, and the caller holds none of
    /// those bytes (under `pmstack run`: an attached process's unsynced writes).
    pub others_unlogged: bool,
    /// The object has no baseline (`all_changes_seen` is false), but every writer is seen
    /// from now on, the whole file is small enough to log, and its name is durable in the
    /// lower. The lower's own fsync, which a baseline stands in for, would make the name
    /// durable too (ext4 and XFS commit it with the file): once a power cut took a name that
    /// no record holds, the file's records would have nothing to be replayed on.
    pub baseline_ready: bool,
}

/// How a sync of a file is carried out (`file_sync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileSync {
    /// Nothing to do: everything is durable already.
    Durable,
    /// Log the bytes written since the last sync (the dirty ranges) and commit.
    LogDirty,
    /// Log the whole file as it is now (its size and every byte): its baseline. Replayed,
    /// it gives the file as this sync saw it, as the lower's own fsync would have.
    LogWhole,
    /// The lower file system's own fsync, then the object's older entries expired (they
    /// must never replay over what it made durable: `super::expire_synced`).
    Lower,
}

/// The rule: a sync is absorbed only where the log can make durable everything a real
/// fsync would, and nothing the lower may hold newer. So never without a log, nor where
/// another process left bytes the log lacks (only the lower's fsync covers them); the dirty
/// ranges where every change since the last durable state was seen; the whole file where
/// only what came before it was vetted is unseen and it may be logged whole; else the
/// lower's own sync.
pub fn file_sync(f: FileFacts) -> FileSync {
    if !f.logging || f.others_unlogged {
        FileSync::Lower
    } else if f.durable_on_return {
        FileSync::Durable
    } else if f.all_changes_seen {
        FileSync::LogDirty
    } else if f.baseline_ready {
        FileSync::LogWhole
    } else {
        FileSync::Lower
    }
}

/// Carry out a file sync that `file_sync` chose as `how`, over the object's state `st`
/// (locked by the caller for the whole sequence). `log_dirty` and `log_whole` return
/// Ok(false) where the log cannot take the sync (PM full, bytes that cannot be read back),
/// having changed nothing that a real sync does not cover: the lower's own sync (`lower`)
/// then runs instead, never an error for want of room. Whether the sync was absorbed.
pub fn sync_file<S>(
    st: &mut S,
    how: FileSync,
    log_dirty: impl FnOnce(&mut S) -> io::Result<bool>,
    log_whole: impl FnOnce(&mut S) -> io::Result<bool>,
    lower: impl FnOnce(&mut S) -> io::Result<()>,
) -> io::Result<bool> {
    let absorbed = match how {
        FileSync::Durable => true,
        FileSync::LogDirty => log_dirty(st)?,
        FileSync::LogWhole => log_whole(st)?,
        FileSync::Lower => false,
    };
    if !absorbed {
        lower(st)?;
    }
    Ok(absorbed)
}

/// What a front end knows of a directory when a program syncs it.
#[derive(Clone, Copy, Debug, Default)]
pub struct DirFacts {
    /// There is a log (`FileFacts::logging`).
    pub logging: bool,
    /// Every change of its names since it was last made durable is in the log
    /// (`names_logged`): always through the mount.
    pub names_logged: bool,
    /// Every change of its own attributes (mode, owner, times) since then is in the log:
    /// always through the mount; under `pmstack run` attribute calls on directories are not
    /// logged.
    pub attrs_logged: bool,
}

/// How a sync of a directory is carried out (`dir_sync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirSync {
    /// Nothing to do: the log holds every change a real fsync would make durable.
    Durable,
    /// The directory's own fsync in the lower (its names are logged, or there is no log).
    Lower,
    /// A namespace write-back: the lower made durable (syncfs, or an fsync of every
    /// directory the log's records changed) and every older namespace record expired. A
    /// record logged after a change the log lacks could replay over it, or name an object
    /// whose creation is not durable.
    WriteBack,
}

/// The rule for a directory's sync: with a log, unlogged names mean a namespace write-back,
/// unlogged attributes the directory's own fsync, and a fully logged directory nothing.
pub fn dir_sync(f: DirFacts) -> DirSync {
    if !f.logging {
        DirSync::Lower
    } else if !f.names_logged {
        DirSync::WriteBack
    } else if !f.attrs_logged {
        DirSync::Lower
    } else {
        DirSync::Durable
    }
}

/// Whether every change of a directory's names since it was last made durable is in the
/// log, told by its change time: `now`, read now (0: unreadable), is `recorded`, the one
/// stored right after its last logged change or write-back. A change no front end saw (a
/// program outside `pmstack run`, a call the library does not interpose) moves it. Never
/// where the lower's change times are `coarse`: an unlogged change in the same clock tick
/// as the last logged one would go unseen.
pub fn names_logged(recorded: u64, now: u64, coarse: bool) -> bool {
    now != 0 && !coarse && recorded == now
}

/// How a creation (a file, directory, symlink or special file) reaches the lower and the
/// log, for both front ends: logged after the call, since only the call tells the new
/// object (its identity, what it replaced). The caller holds the namespace order for the
/// whole sequence.
///
/// - `names_logged`: every earlier change of the directories it changes is in the log.
/// - `apply`: the creation on the lower file system.
/// - `log(out, append)`: whether the call changed anything (false: nothing to log); where
///   `append`, its record appended and committed, Err where the log had no room.
/// - `write_back`: make every namespace change so far durable in the lower and expire the
///   live namespace records.
///
/// A creation in a directory with changes the log lacks is not logged: its record could
/// replay over them. It is written back, with them, before it returns, as one the log has
/// no room for.
pub fn create<T, E>(
    names_logged: bool,
    apply: impl FnOnce() -> io::Result<T>,
    log: impl FnOnce(&T, bool) -> Result<bool, E>,
    write_back: impl FnOnce() -> io::Result<()>,
) -> io::Result<(T, Created)> {
    let out = apply()?;
    let how = match log(&out, names_logged) {
        Ok(false) => Created::Unchanged,
        Ok(true) if names_logged => Created::Logged,
        _ => {
            write_back()?;
            Created::WrittenBack
        }
    };
    Ok((out, how))
}

/// What `create` did with a creation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Created {
    /// The call changed nothing; nothing logged.
    Unchanged,
    /// Its record is in the log.
    Logged,
    /// Made durable in the lower by a namespace write-back.
    WrittenBack,
}

/// Before a record of a rename, link or removal is logged (`super::change_namespace`) in
/// directories whose names the log may not all hold (`names_logged` false): everything is
/// written back first, so that the log holds the whole story from then on (replayed after
/// changes it lacks, a record could undo them). Whether it wrote back.
pub fn settle_unlogged(
    names_logged: bool,
    write_back: impl FnOnce() -> io::Result<()>,
) -> io::Result<bool> {
    if names_logged {
        return Ok(false);
    }
    write_back()?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> FileFacts {
        FileFacts {
            logging: true,
            all_changes_seen: true,
            ..FileFacts::default()
        }
    }

    /// Each fact that makes absorbing unsafe sends the sync to the lower.
    #[test]
    fn a_sync_is_absorbed_only_where_the_log_can_cover_it() {
        assert_eq!(file_sync(facts()), FileSync::LogDirty);
        let no_log = FileFacts {
            logging: false,
            durable_on_return: true,
            ..facts()
        };
        assert_eq!(file_sync(no_log), FileSync::Lower);
        let others = FileFacts {
            others_unlogged: true,
            durable_on_return: true,
            ..facts()
        };
        assert_eq!(file_sync(others), FileSync::Lower);
        let unseen = FileFacts {
            all_changes_seen: false,
            ..facts()
        };
        assert_eq!(file_sync(unseen), FileSync::Lower);
        let baseline = FileFacts {
            baseline_ready: true,
            ..unseen
        };
        assert_eq!(file_sync(baseline), FileSync::LogWhole);
        let strict = FileFacts {
            durable_on_return: true,
            ..facts()
        };
        assert_eq!(file_sync(strict), FileSync::Durable);
    }

    /// `sync_file` of `how` with logs that take the sync as told: whether it was absorbed,
    /// and how many times the lower's own sync ran.
    fn carried_out(how: FileSync, dirty_taken: bool, whole_taken: bool) -> (bool, u32) {
        let mut lower = 0;
        let absorbed = sync_file(
            &mut lower,
            how,
            |_| Ok(dirty_taken),
            |_| Ok(whole_taken),
            |n| {
                *n += 1;
                Ok(())
            },
        )
        .unwrap();
        (absorbed, lower)
    }

    /// A log that cannot take the sync falls back to the lower's own, never an error.
    #[test]
    fn a_sync_the_log_cannot_take_is_the_lowers_own() {
        for how in [FileSync::LogDirty, FileSync::LogWhole] {
            assert_eq!(carried_out(how, false, false), (false, 1), "{how:?}");
        }
        assert_eq!(carried_out(FileSync::LogDirty, true, false), (true, 0));
        assert_eq!(
            carried_out(FileSync::Durable, false, false),
            (true, 0),
            "nothing to do"
        );
        assert_eq!(
            carried_out(FileSync::Lower, true, true),
            (false, 1),
            "the lower's own"
        );
    }

    #[test]
    fn a_directory_sync_writes_back_where_its_names_are_not_all_logged() {
        let all = DirFacts {
            logging: true,
            names_logged: true,
            attrs_logged: true,
        };
        assert_eq!(dir_sync(all), DirSync::Durable);
        let names = DirFacts {
            names_logged: false,
            attrs_logged: false,
            ..all
        };
        assert_eq!(dir_sync(names), DirSync::WriteBack);
        let attrs = DirFacts {
            attrs_logged: false,
            ..all
        };
        assert_eq!(dir_sync(attrs), DirSync::Lower);
        let none = DirFacts {
            logging: false,
            ..all
        };
        assert_eq!(dir_sync(none), DirSync::Lower);
    }

    #[test]
    fn names_are_logged_only_while_the_change_time_stays_as_recorded() {
        assert!(names_logged(5, 5, false));
        assert!(!names_logged(5, 6, false), "changed since");
        assert!(!names_logged(5, 5, true), "coarse change times");
        assert!(!names_logged(0, 0, false), "unreadable");
    }

    /// A creation after changes the log lacks is written back, never logged.
    #[test]
    fn a_creation_after_unlogged_changes_is_written_back_not_logged() {
        for (names, log_result, want) in [
            (true, Ok(true), Created::Logged),
            (true, Ok(false), Created::Unchanged),
            (true, Err(()), Created::WrittenBack),
            (false, Ok(true), Created::WrittenBack),
            (false, Ok(false), Created::Unchanged),
        ] {
            let mut appended = None;
            let mut wb = 0;
            let (_, how) = create(
                names,
                || Ok(()),
                |_, append| {
                    appended = Some(append);
                    log_result
                },
                || {
                    wb += 1;
                    Ok(())
                },
            )
            .unwrap();
            assert_eq!(how, want, "{names} {log_result:?}");
            assert_eq!(
                appended,
                Some(names),
                "appends only where the names are logged"
            );
            assert_eq!(wb, (want == Created::WrittenBack) as i32);
        }
        let mut logged = false;
        let r = create::<(), ()>(
            true,
            || Err(io::Error::from_raw_os_error(libc::EEXIST)),
            |_, _| {
                logged = true;
                Ok(true)
            },
            || Ok(()),
        );
        assert!(r.is_err() && !logged, "a failed call logs nothing");
    }
}
