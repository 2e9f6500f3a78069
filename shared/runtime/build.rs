//! `sqlx::migrate!` embeds the migrations at compile time; this makes a new or changed
//! migration file rebuild the crate (cargo would otherwise only notice Rust sources).
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
