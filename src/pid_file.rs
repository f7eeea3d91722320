//! `tollgate run --pid-file`: this process's id in a file while it runs, so that a reload
//! signals this gateway and no other (`pidof tollgate` finds every tollgate on the host). The
//! file goes when the gateway exits, which it does from its drain (`std::process::exit`, so
//! no destructor runs): every exit path calls [`remove`].

use std::path::{Path, PathBuf};
use std::sync::Mutex;

static PATH: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Writes the process id to `path` and remembers it for [`remove`].
pub fn write(path: &Path) -> std::io::Result<()> {
    std::fs::write(path, format!("{}\n", std::process::id()))?;
    if let Ok(mut p) = PATH.lock() {
        *p = Some(path.to_path_buf());
    }
    Ok(())
}

/// Removes the file written by [`write`], if any (once).
pub fn remove() {
    if let Some(path) = PATH.lock().ok().and_then(|mut p| p.take()) {
        let _ = std::fs::remove_file(path);
    }
}
