//! `tollgate run --pid-file`: this process's id in a file while it runs, so that a reload
//! signals this gateway and no other (`pidof tollgate` finds every tollgate on the host). The
//! file goes when the gateway exits, which it does from its drain (`std::process::exit`, so
//! no destructor runs): every exit path calls [`remove`]. `tollgate demo`'s config file goes
//! the same way ([`remove_at_exit`]).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

static PATHS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Writes the process id to `path` and remembers it for [`remove`].
pub fn write(path: &Path) -> std::io::Result<()> {
    std::fs::write(path, format!("{}\n", std::process::id()))?;
    remove_at_exit(path);
    Ok(())
}

/// Remembers a file of this process's own for [`remove`].
pub fn remove_at_exit(path: &Path) {
    if let Ok(mut p) = PATHS.lock() {
        p.push(path.to_path_buf());
    }
}

/// Removes the files remembered by [`write`] and [`remove_at_exit`], if any (once).
pub fn remove() {
    let paths = PATHS
        .lock()
        .map(|mut p| std::mem::take(&mut *p))
        .unwrap_or_default();
    for path in paths {
        let _ = std::fs::remove_file(path);
    }
}
