//! What an owner of private servers keeps beside them between runs: a lock file (one owner
//! at a time; the OS releases it when the holder dies) and a JSON record of the servers'
//! ports and pids, replaced atomically so a reader never sees half of one.

use std::fs::File;
use std::path::Path;

use anyhow::Context as _;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// `dir/lock`, opened for locking (created with `dir` if missing); the caller picks
/// `lock` or `try_lock`.
pub fn open_lock_file(dir: &Path) -> anyhow::Result<File> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join("lock");
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))
}

/// The record at `path`; missing or unreadable means nothing recorded (whatever it
/// described is found dead or absent by the caller's checks, and replaced).
pub fn read_record<T: DeserializeOwned + Default>(path: &Path) -> T {
    std::fs::read(path).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok()).unwrap_or_default()
}

/// Replaces the record at `path` (through a temporary file and a rename).
pub fn write_record<T: Serialize>(path: &Path, record: &T) -> anyhow::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, serde_json::to_vec_pretty(record)?)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}
