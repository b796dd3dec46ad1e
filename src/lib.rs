//! pmstack: a persistent-memory write-ahead tier stacked over an existing file system.
//!
//! Layers (DESIGN.md §3): [`pmem`] (regions and persistence primitives) → [`engine`] (the PM
//! log) → [`core`] (the file system core: inodes, handles, policies) over [`lower`] (the real or
//! simulated lower file system); [`fuse`] is the thin FUSE adapter.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod config;
pub mod core;
pub mod engine;
pub mod front;
pub mod fuse;
pub mod lower;
pub mod metrics;
pub mod pmem;
pub mod policy;
pub mod region;
pub mod sim;
