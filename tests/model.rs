//! Reference-model test: random operation sequences through the mount and on a plain
//! directory, compared call by call and tree by tree (the test itself: `common/model.rs`).

mod common;

use common::model::run_mode;

#[test]
fn model_sync_mode() {
    run_mode("sync", None);
}

#[test]
fn model_adaptive_mode() {
    run_mode("adaptive", None);
}

#[test]
fn model_strict_mode() {
    run_mode("strict", None);
}

#[test]
fn model_passthrough_mode() {
    run_mode("passthrough", None);
}
