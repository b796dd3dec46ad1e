//! What runs of the crash simulator covered.

/// What runs of the simulator exercised.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Coverage {
    /// Histories run (one crash each).
    pub histories: u64,
    /// Operations executed before the crashes.
    pub ops: u64,
    /// Crash images recovered: PM as a power cut at a fence left it (flushed-and-fenced lines
    /// plus any subset of dirty 8-byte words), with the lower rewound to a power-cut state.
    pub crash_images: u64,
    /// Fences at which images were captured (all fences of each crashing operation).
    pub fences_captured: u64,
    /// Crashes in the middle of a write-back.
    pub crashes_in_write_back: u64,
    /// Power cuts in which the lower lost acknowledged namespace operations: its names were
    /// rewound to an earlier committed prefix of its journal than the crash point's.
    pub namespace_rewinds: u64,
    /// Namespace operations those power cuts took back (each operation that changed names).
    pub namespace_ops_lost: u64,
    /// Crashes whose choice of fence or of namespace prefix was narrowed because a real
    /// directory cannot be brought back with its inode once removed (`restorable`).
    pub dir_removals_kept: u64,
    /// Recoveries killed at a random step, followed by another recovery.
    pub recoveries_interrupted: u64,
    /// Replays run twice (a recovery that replayed everything but did not empty the log).
    pub double_replays: u64,
    /// FUSE inode evictions (FORGET, then lookup and reopen).
    pub forgets: u64,
    pub write_backs: u64,
    pub renames: u64,
    pub exchanges: u64,
    pub unlinks: u64,
    pub fsyncs: u64,
    pub truncates: u64,
    pub fallocates: u64,
    pub links: u64,
    pub mkdirs: u64,
    pub rmdirs: u64,
    /// Renames of directories.
    pub dir_renames: u64,
    /// RENAME_EXCHANGEs of two directories (`pmstack run`).
    pub dir_exchanges: u64,
    /// Objects recovery had to create again.
    pub recreated: u64,
    /// `pmstack run`: times the daemon was taken for dead (its heartbeat aged), operations
    /// run while it was, and syncs the lower made durable (the client's real syncs and
    /// namespace write-backs).
    pub daemon_deaths: u64,
    pub unserved_ops: u64,
    pub real_syncs: u64,
    /// Histories over a lower that ignores syncfs (`Kinds::syncfs_ignored`), and the objects
    /// their write-backs made durable with their own fsync.
    pub syncfs_ignored: u64,
    pub objects_synced: u64,
    /// Histories over a lower that commits each directory's entries separately
    /// (`Kinds::per_dir_commits`), and their power cuts that left names no single prefix of
    /// the operations had (directories rewound to different operations).
    pub per_dir_commits: u64,
    pub names_apart: u64,
    /// `pmstack run` over a lower that ignores syncfs: namespace operations refused (EIO)
    /// while the daemon was taken for dead with namespace records live.
    pub refused_unserved: u64,
    /// Data operations (write, fsync, truncate, fallocate) refused so: a new file's real sync
    /// that could not sync its path (its name removed while it lives on under a link).
    pub refused_unserved_data: u64,
    /// `pmstack run` over a lower that ignores syncfs: real syncs of new files that synced
    /// the directories of their path too (`F_BORN_UNSYNCED`).
    pub paths_synced: u64,
    /// `pmstack run`: names changed in the lower by a program that is not attached.
    pub outside_changes: u64,
    /// `pmstack run`: files such a program made and synced nothing of
    /// (`Kinds::unsynced_outside`).
    pub outside_unsynced: u64,
    /// Crashes after which such a file's name was gone (the power cut took it back), with
    /// nothing of it acknowledged as durable since.
    pub unsynced_names_lost: u64,
    /// `pmstack run`: files such a program renamed and synced nothing of
    /// (`Kinds::unsynced_renames`).
    pub outside_unsynced_renames: u64,
    /// Crashes after which such a file was back under its name before.
    pub unsynced_renames_lost: u64,
    /// `pmstack run`: files such a program removed and synced nothing of
    /// (`Kinds::unsynced_removals`).
    pub outside_unsynced_removals: u64,
    /// Crashes after which such a name was back.
    pub unsynced_removals_back: u64,
    /// Histories that ended in a kill of the processes rather than a power cut.
    pub kills: u64,
    /// Crash images whose live log records were in more than one append area (recovery
    /// merged them by LSN).
    pub multi_area_logs: u64,
    /// Power cuts that took back an rmdir (the directory came back with its inode).
    pub rmdirs_taken_back: u64,
    /// `pmstack run`: histories whose daemon had a table of a few slots, and the slots its
    /// write-backs freed there (an object tracked again takes a new one).
    pub small_tables: u64,
    pub slots_freed: u64,
    /// `pmstack run`: changes of a directory's mode before its fsync (a clean directory stays
    /// clean, and the fsync is real).
    pub dir_attr_changes: u64,
    /// `pmstack run`: first syncs of objects with no baseline (a slot claimed again after the
    /// daemon freed it) absorbed by logging the whole file (`Client::log_baseline`).
    pub baselines_logged: u64,
    /// `pmstack run` over a lower that ignores syncfs (whose clients keep copies of dirty
    /// bytes): absorbed syncs whose bytes all came from those copies, none read back.
    pub syncs_from_copies: u64,
    /// `pmstack run`: fsyncs through a write-only descriptor (`Kinds::write_only`).
    pub write_only_syncs: u64,
    /// `pmstack run`: writes through an O_APPEND descriptor (`Kinds::appends`).
    pub appends: u64,
    /// `pmstack run`: writes through an O_DIRECT descriptor (`Kinds::direct`).
    pub direct_writes: u64,
    /// `pmstack run`: histories whose write-backs of the whole file system settled
    /// directories (`front::settle`), and the times a directory was taken for clean so.
    pub settling: u64,
    pub dirs_settled: u64,
    /// `pmstack run`: histories whose processes that synced nothing ran their namespace
    /// operations as the lower's own (`Client::unsynced_allowed`), those operations, and the
    /// logged operations of such a process that came after some (all of them must be
    /// durable then).
    pub unsynced_ns_histories: u64,
    pub unsynced_ns_ops: u64,
    pub unsynced_ns_then_logged: u64,
}

impl Coverage {
    pub fn add(&mut self, o: &Coverage) {
        self.histories += o.histories;
        self.ops += o.ops;
        self.crash_images += o.crash_images;
        self.fences_captured += o.fences_captured;
        self.crashes_in_write_back += o.crashes_in_write_back;
        self.namespace_rewinds += o.namespace_rewinds;
        self.namespace_ops_lost += o.namespace_ops_lost;
        self.recoveries_interrupted += o.recoveries_interrupted;
        self.dir_removals_kept += o.dir_removals_kept;
        self.double_replays += o.double_replays;
        self.forgets += o.forgets;
        self.write_backs += o.write_backs;
        self.renames += o.renames;
        self.exchanges += o.exchanges;
        self.unlinks += o.unlinks;
        self.fsyncs += o.fsyncs;
        self.truncates += o.truncates;
        self.fallocates += o.fallocates;
        self.links += o.links;
        self.mkdirs += o.mkdirs;
        self.rmdirs += o.rmdirs;
        self.dir_renames += o.dir_renames;
        self.dir_exchanges += o.dir_exchanges;
        self.recreated += o.recreated;
        self.daemon_deaths += o.daemon_deaths;
        self.unserved_ops += o.unserved_ops;
        self.real_syncs += o.real_syncs;
        self.syncfs_ignored += o.syncfs_ignored;
        self.objects_synced += o.objects_synced;
        self.per_dir_commits += o.per_dir_commits;
        self.names_apart += o.names_apart;
        self.refused_unserved += o.refused_unserved;
        self.refused_unserved_data += o.refused_unserved_data;
        self.paths_synced += o.paths_synced;
        self.outside_changes += o.outside_changes;
        self.outside_unsynced += o.outside_unsynced;
        self.unsynced_names_lost += o.unsynced_names_lost;
        self.outside_unsynced_renames += o.outside_unsynced_renames;
        self.unsynced_renames_lost += o.unsynced_renames_lost;
        self.outside_unsynced_removals += o.outside_unsynced_removals;
        self.unsynced_removals_back += o.unsynced_removals_back;
        self.kills += o.kills;
        self.multi_area_logs += o.multi_area_logs;
        self.rmdirs_taken_back += o.rmdirs_taken_back;
        self.small_tables += o.small_tables;
        self.slots_freed += o.slots_freed;
        self.dir_attr_changes += o.dir_attr_changes;
        self.baselines_logged += o.baselines_logged;
        self.syncs_from_copies += o.syncs_from_copies;
        self.write_only_syncs += o.write_only_syncs;
        self.appends += o.appends;
        self.direct_writes += o.direct_writes;
        self.settling += o.settling;
        self.dirs_settled += o.dirs_settled;
        self.unsynced_ns_histories += o.unsynced_ns_histories;
        self.unsynced_ns_ops += o.unsynced_ns_ops;
        self.unsynced_ns_then_logged += o.unsynced_ns_then_logged;
    }
}
