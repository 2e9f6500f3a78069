//! Every end-to-end suite in one test binary (one link step instead of nine): each module
//! is a suite, run by `cargo nextest run -p turnlog-e2e` (filter one with `-E 'test(/^api::/)'`).

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

#[path = "api/main.rs"]
mod api;
mod compactor;
mod conversation;
mod distiller;
mod files;
mod forks;
mod memory;
mod openai;
#[path = "ops/main.rs"]
mod ops;
