//! Hot reload: one thread owns updates to the registry. It watches the plugins folder
//! (`notify`), waits until writes go quiet (debounce), then loads added or changed `.wasm`
//! files (or those whose `NAME.toml` settings changed) and drops deleted ones. A file that
//! fails to load leaves the previous version of its plugin serving; the reason shows in
//! `GET /v1/plugins`. Requests in flight keep the `Arc<Plugin>` they started with, so they
//! finish on their version.

use super::PluginRegistry;
use anyhow::{Context, Result};
use notify::{RecursiveMode, Watcher};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

/// How long the folder must be quiet before changes are applied.
const DEBOUNCE: Duration = Duration::from_millis(100);

/// Keeps the watcher alive; dropping it stops hot reload.
pub struct ReloadHandle {
    _watcher: notify::RecommendedWatcher,
}

pub fn watch(registry: Arc<PluginRegistry>, dir: &Path) -> Result<ReloadHandle> {
    let (tx, rx) = channel::<notify::Result<notify::Event>>();
    let mut watcher = notify::recommended_watcher(tx).context("starting the plugins folder watcher")?;
    // Watched by its canonical path, so the events name files as the registry does.
    let dir = &dir.canonicalize().with_context(|| format!("reading the plugins folder {}", dir.display()))?;
    watcher.watch(dir, RecursiveMode::NonRecursive).with_context(|| format!("watching {}", dir.display()))?;
    std::thread::Builder::new()
        .name("plugin-reload".into())
        .spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut changed = BTreeSet::new();
                collect(first, &mut changed);
                loop {
                    match rx.recv_timeout(DEBOUNCE) {
                        Ok(event) => collect(event, &mut changed),
                        Err(RecvTimeoutError::Timeout) => break,
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                }
                for path in changed {
                    apply(&registry, &path);
                }
            }
        })
        .context("starting the plugin reload thread")?;
    Ok(ReloadHandle { _watcher: watcher })
}

fn collect(event: notify::Result<notify::Event>, changed: &mut BTreeSet<PathBuf>) {
    use notify::event::{EventKind, MetadataKind, ModifyKind};
    match event {
        // Reading a file (as loading it does) is not a change: without this filter every load
        // triggered the next one, forever.
        Ok(e)
            if matches!(
                e.kind,
                EventKind::Access(_) | EventKind::Modify(ModifyKind::Metadata(MetadataKind::AccessTime))
            ) => {}
        // A settings file change reloads its plugin (see `apply`).
        Ok(e) => changed.extend(
            e.paths.into_iter().filter(|p| matches!(p.extension().and_then(|x| x.to_str()), Some("wasm" | "toml"))),
        ),
        Err(e) => tracing::warn!("plugin watcher: {e}"),
    }
}

fn apply(registry: &PluginRegistry, path: &Path) {
    if path.extension().is_some_and(|x| x == "toml") {
        // Settings are matched by plugin name (or the file's stem): reload each file it may
        // belong to that is still there.
        for wasm in registry.files_for_settings(path).into_iter().filter(|w| w.is_file()) {
            let _ = registry.load_file(&wasm);
        }
    } else if path.is_file() {
        // `load_file` logs and records a failure; the previous version stays.
        let _ = registry.load_file(path);
    } else {
        registry.remove_file(path);
    }
}
