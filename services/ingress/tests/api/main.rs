//! The ingress's HTTP API against real Postgres and NATS (fresh per test, from the
//! testkit), with the writer in-process and the server on 127.0.0.1:0.

// The harness's helpers are test code too; a failed unwrap there is a failed test.
#![allow(clippy::unwrap_used)]

mod bad_inputs;
mod context;
mod gateway;
mod harness;
mod local_mode;
mod openapi;
mod owners;
mod paging;
mod reads;
mod sessions;
mod sizes;
mod transcript;
mod turn_caps;
mod turns;
mod unavailable;
