//! The ingress's HTTP API against real Postgres and NATS (fresh per test, from the
//! testkit), with the writer in-process and the server on 127.0.0.1:0 (turnlog_e2e::api).

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

mod bad_inputs;
mod context;
mod export;
mod gateway;
mod import;
mod local_mode;
mod mcp;
mod openapi;
mod owners;
mod paging;
mod reads;
mod requests;
mod search;
mod sessions;
mod sizes;
mod tools;
mod transcript;
mod turn_caps;
mod turns;
mod unavailable;
