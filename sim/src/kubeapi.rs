//! A fake Kubernetes API server for tests: the real list/watch HTTP protocol over JSON objects,
//! enough for `kube::Client` watchers (no real API server runs on the test machines).
//!
//! - **Objects** are JSON values with `apiVersion`, `kind` and `metadata`; [`FakeKube::apply`]
//!   creates or replaces one, stamping `metadata.resourceVersion` from one global counter (and
//!   `uid`, `creationTimestamp`, `generation` as the API server does), [`FakeKube::delete`]
//!   removes it. Collections: `/api/v1/[namespaces/NS/]PLURAL` for the core group,
//!   `/apis/GROUP/VERSION/[namespaces/NS/]PLURAL` for the others; the plural is the lower-cased
//!   kind plus `s` (pods, inferencepools, inferenceobjectives, inferencemodelrewrites,
//!   tenantquotas).
//! - **List** (`GET` a collection): `labelSelector` (`k=v`, `k==v`, `k!=v`, `k`, `!k`, comma =
//!   and), `fieldSelector` (`metadata.name`, `metadata.namespace`; `=`/`!=`), `limit` with a
//!   `continue` token; the list's `metadata.resourceVersion` is the current one.
//! - **Watch** (`watch=true`): newline-delimited JSON events (`ADDED`, `MODIFIED`, `DELETED`,
//!   `BOOKMARK` every [`BOOKMARK_EVERY`] with `allowWatchBookmarks=true`) of the changes after
//!   `resourceVersion`, replayed from the history then live. With a selector, an object that
//!   stops matching is `DELETED` and one that starts matching is `ADDED`, as the real server
//!   does. A `resourceVersion` older than the last [`FakeKube::compact`] gets an `ERROR` event
//!   with a 410 `Expired` status (the client must relist). `timeoutSeconds` ends the stream.
//! - **Faults**: [`FakeKube::drop_watches`] ends every open watch (clients resume from their
//!   last resource version), [`FakeKube::set_down`] answers every request 503 and drops the
//!   watches until brought back, [`FakeKube::uninstall`] makes a kind unknown (404, as for a CRD
//!   not installed). [`FakeKube::requests`] lists what clients asked.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::PoisonError;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Query;
use axum::extract::State as AxumState;
use axum::http::StatusCode;
use axum::http::Uri;
use axum::response::IntoResponse;
use axum::response::Response;
use bytes::Bytes;
use serde_json::Value;
use serde_json::json;
use tokio::sync::mpsc;

/// How often an open watch with bookmarks allowed gets one.
pub const BOOKMARK_EVERY: Duration = Duration::from_millis(500);

/// Events buffered per watch; a client further behind is cut off (as a slow watcher would be).
const WATCH_BUFFER: usize = 4096;

/// `(collection, namespace, name)`; collection is `api/v1/pods` or `apis/GROUP/VERSION/PLURAL`.
type Key = (String, String, String);

#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    key: Key,
    old: Option<Value>,
    new: Option<Value>,
}

struct Watch {
    collection: String,
    namespace: Option<String>,
    labels: Selector,
    fields: Selector,
    tx: mpsc::Sender<Bytes>,
}

#[derive(Default)]
struct State {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    history: Vec<Change>,
    /// Resource versions at or below this are gone from the history.
    compacted: u64,
    watches: Vec<Watch>,
    down: bool,
    /// Collections answered 404 (their CRD not installed).
    missing: std::collections::BTreeSet<String>,
    requests: Vec<String>,
    uids: u64,
}

/// A running fake API server on 127.0.0.1.
pub struct FakeKube {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl FakeKube {
    /// Serves on an OS-chosen loopback port.
    pub async fn start() -> anyhow::Result<FakeKube> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let app = Router::new()
            .fallback(handle)
            .with_state(Arc::clone(&state));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(FakeKube { addr, state, task })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig for this server (namespace `namespace`) to `path`.
    pub fn write_kubeconfig(&self, path: &Path, namespace: &str) -> std::io::Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: fake\n  user:\n    token: fake-token\ncontexts:\n- name: fake\n  \
             context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\n\
             current-context: fake\n",
            self.url()
        );
        std::fs::write(path, text)
    }

    /// Creates or replaces `obj` (by apiVersion, kind, namespace, name); returns it as stored.
    pub fn apply(&self, mut obj: Value) -> anyhow::Result<Value> {
        let key = key_of(&obj)
            .ok_or_else(|| anyhow::anyhow!("an object needs apiVersion, kind and metadata.name"))?;
        let mut st = lock(&self.state);
        st.rv += 1;
        let rv = st.rv;
        let old = st.objects.get(&key).cloned();
        let meta = obj["metadata"]
            .as_object_mut()
            .ok_or_else(|| anyhow::anyhow!("metadata must be an object"))?;
        meta.insert("namespace".into(), json!(key.1));
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        let uid = match old.as_ref().and_then(|o| o["metadata"]["uid"].as_str()) {
            Some(uid) => uid.to_string(),
            None => {
                st.uids += 1;
                format!("00000000-0000-4000-8000-{:012x}", st.uids)
            }
        };
        let meta = obj["metadata"]
            .as_object_mut()
            .ok_or_else(|| anyhow::anyhow!("metadata must be an object"))?;
        meta.entry("uid").or_insert(json!(uid));
        meta.entry("creationTimestamp")
            .or_insert(json!("2026-12-01T00:00:00Z"));
        let generation = old
            .as_ref()
            .and_then(|o| o["metadata"]["generation"].as_u64())
            .map_or(1, |g| g + 1);
        meta.insert("generation".into(), json!(generation));
        st.objects.insert(key.clone(), obj.clone());
        record(&mut st, rv, key, old, Some(obj.clone()));
        Ok(obj)
    }

    /// Deletes an object; `false` if there was none.
    pub fn delete(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> bool {
        let key = (
            collection(api_version, &plural(kind)),
            namespace.to_string(),
            name.to_string(),
        );
        let mut st = lock(&self.state);
        let Some(old) = st.objects.remove(&key) else {
            return false;
        };
        st.rv += 1;
        let rv = st.rv;
        record(&mut st, rv, key, Some(old), None);
        true
    }

    /// The stored object, if any.
    pub fn get(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let key = (
            collection(api_version, &plural(kind)),
            namespace.to_string(),
            name.to_string(),
        );
        lock(&self.state).objects.get(&key).cloned()
    }

    /// Forgets the change history: watches resuming from an older version get 410 Gone.
    pub fn compact(&self) {
        let mut st = lock(&self.state);
        st.compacted = st.rv;
        st.history.clear();
    }

    /// Ends every open watch stream.
    pub fn drop_watches(&self) {
        lock(&self.state).watches.clear();
    }

    /// `true`: every request is answered 503 and open watches end, until `false`.
    pub fn set_down(&self, down: bool) {
        let mut st = lock(&self.state);
        st.down = down;
        if down {
            st.watches.clear();
        }
    }

    /// Answers 404 for the kind's collections from now on (its CRD not installed); its open
    /// watches end.
    pub fn uninstall(&self, api_version: &str, kind: &str) {
        let mut st = lock(&self.state);
        let c = collection(api_version, &plural(kind));
        st.watches.retain(|w| w.collection != c);
        st.missing.insert(c);
    }

    /// Requests received so far (`METHOD path?query`).
    pub fn requests(&self) -> Vec<String> {
        lock(&self.state).requests.clone()
    }

    /// Open watch streams.
    pub fn open_watches(&self) -> usize {
        let mut st = lock(&self.state);
        st.watches.retain(|w| !w.tx.is_closed());
        st.watches.len()
    }
}

/// Lower-cased kind plus `s`.
fn plural(kind: &str) -> String {
    format!("{}s", kind.to_ascii_lowercase())
}

fn collection(api_version: &str, plural: &str) -> String {
    if api_version == "v1" {
        format!("api/v1/{plural}")
    } else {
        format!("apis/{api_version}/{plural}")
    }
}

fn key_of(obj: &Value) -> Option<Key> {
    let api_version = obj["apiVersion"].as_str()?;
    let kind = obj["kind"].as_str()?;
    let name = obj["metadata"]["name"].as_str()?;
    let ns = obj["metadata"]["namespace"].as_str().unwrap_or("default");
    Some((
        collection(api_version, &plural(kind)),
        ns.to_string(),
        name.to_string(),
    ))
}

/// Appends a change and sends it to the watches it concerns.
fn record(st: &mut State, rv: u64, key: Key, old: Option<Value>, new: Option<Value>) {
    let change = Change { rv, key, old, new };
    st.watches.retain(|w| match event_for(w, &change) {
        Some(line) => w.tx.try_send(line).is_ok(),
        None => !w.tx.is_closed(),
    });
    st.history.push(change);
}

/// The watch event `change` is for `w`, if any (a newline-terminated JSON line).
fn event_for(w: &Watch, change: &Change) -> Option<Bytes> {
    if change.key.0 != w.collection || w.namespace.as_ref().is_some_and(|n| *n != change.key.1) {
        return None;
    }
    let matches = |o: &Option<Value>| {
        o.as_ref()
            .is_some_and(|o| w.labels.matches_labels(o) && w.fields.matches_fields(o))
    };
    let (was, is) = (matches(&change.old), matches(&change.new));
    let (kind, obj) = match (was, is) {
        (false, true) => ("ADDED", change.new.clone()?),
        (true, true) => ("MODIFIED", change.new.clone()?),
        (true, false) => {
            // Gone from the watch's view: the last state it matched, at this version.
            let mut obj = change.old.clone()?;
            obj["metadata"]["resourceVersion"] = json!(change.rv.to_string());
            ("DELETED", obj)
        }
        (false, false) => return None,
    };
    Some(line(&json!({"type": kind, "object": obj})))
}

fn line(v: &Value) -> Bytes {
    let mut text = v.to_string();
    text.push('\n');
    Bytes::from(text)
}

/// A parsed label or field selector: requirements that must all hold.
#[derive(Debug, Clone, Default)]
struct Selector(Vec<Requirement>);

#[derive(Debug, Clone)]
enum Requirement {
    Eq(String, String),
    Ne(String, String),
    Exists(String),
    Absent(String),
}

impl Selector {
    fn parse(text: Option<&str>) -> Result<Selector, String> {
        let mut out = Vec::new();
        for part in text.unwrap_or_default().split(',').map(str::trim) {
            if part.is_empty() {
                continue;
            }
            let req = if let Some((k, v)) = part.split_once("!=") {
                Requirement::Ne(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                Requirement::Eq(k.trim().into(), v.trim().into())
            } else if let Some(k) = part.strip_prefix('!') {
                Requirement::Absent(k.trim().into())
            } else if part.contains(' ') || part.contains('(') {
                return Err(format!("unsupported selector `{part}`"));
            } else {
                Requirement::Exists(part.into())
            };
            out.push(req);
        }
        Ok(Selector(out))
    }

    fn holds(&self, get: impl Fn(&str) -> Option<String>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::Eq(k, v) => get(k).as_deref() == Some(v),
            Requirement::Ne(k, v) => get(k).as_deref() != Some(v),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::Absent(k) => get(k).is_none(),
        })
    }

    fn matches_labels(&self, obj: &Value) -> bool {
        self.holds(|k| obj["metadata"]["labels"][k].as_str().map(str::to_string))
    }

    fn matches_fields(&self, obj: &Value) -> bool {
        self.holds(|k| match k {
            "metadata.name" => obj["metadata"]["name"].as_str().map(str::to_string),
            "metadata.namespace" => obj["metadata"]["namespace"].as_str().map(str::to_string),
            _ => None,
        })
    }
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    (
        code,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// `(collection, namespace)` of a request path, if it names a collection.
fn parse_path(path: &str) -> Option<(String, Option<String>)> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (prefix, rest): (String, &[&str]) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => ("api/v1".into(), rest),
        ["apis", group, version, rest @ ..] => (format!("apis/{group}/{version}"), rest),
        _ => return None,
    };
    match rest {
        ["namespaces", ns, plural] => Some((format!("{prefix}/{plural}"), Some(ns.to_string()))),
        [plural] => Some((format!("{prefix}/{plural}"), None)),
        _ => None,
    }
}

/// `PodList` for `api/v1/pods`, `InferencePoolList` for `.../inferencepools`.
fn list_kind(collection: &str) -> String {
    let plural = collection.rsplit('/').next().unwrap_or_default();
    let singular = plural.strip_suffix('s').unwrap_or(plural);
    let kind = match singular {
        "pod" => "Pod",
        "inferencepool" => "InferencePool",
        "inferenceobjective" => "InferenceObjective",
        "inferencemodelrewrite" => "InferenceModelRewrite",
        "tenantquota" => "TenantQuota",
        other => other,
    };
    format!("{kind}List")
}

fn api_version_of(collection: &str) -> String {
    let parts: Vec<&str> = collection.split('/').collect();
    match parts.as_slice() {
        ["api", "v1", _] => "v1".into(),
        ["apis", group, version, _] => format!("{group}/{version}"),
        _ => "v1".into(),
    }
}

async fn handle(
    AxumState(state): AxumState<Arc<Mutex<State>>>,
    method: axum::http::Method,
    uri: Uri,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    {
        let mut st = lock(&state);
        st.requests.push(format!(
            "{method} {}",
            uri.path_and_query().map_or("", |p| p.as_str())
        ));
        if st.down {
            return status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "the fake API server is down",
            );
        }
    }
    if method != axum::http::Method::GET {
        return status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the fake API server is read-only over HTTP",
        );
    }
    let Some((collection, namespace)) = parse_path(uri.path()) else {
        return status(StatusCode::NOT_FOUND, "NotFound", "no such collection");
    };
    if lock(&state).missing.contains(&collection) {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource",
        );
    }
    let (labels, fields) = match (
        Selector::parse(q.get("labelSelector").map(String::as_str)),
        Selector::parse(q.get("fieldSelector").map(String::as_str)),
    ) {
        (Ok(l), Ok(f)) => (l, f),
        (Err(e), _) | (_, Err(e)) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e),
    };
    if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        watch(&state, collection, namespace, labels, fields, &q)
    } else {
        list(
            &state,
            &collection,
            namespace.as_deref(),
            &labels,
            &fields,
            &q,
        )
    }
}

fn list(
    state: &Mutex<State>,
    collection: &str,
    namespace: Option<&str>,
    labels: &Selector,
    fields: &Selector,
    q: &BTreeMap<String, String>,
) -> Response {
    let st = lock(state);
    let after = q.get("continue").filter(|c| !c.is_empty()).cloned();
    let limit = q
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    let mut items = Vec::new();
    let mut next = None;
    for ((c, ns, name), obj) in &st.objects {
        if c != collection || namespace.is_some_and(|n| n != ns) {
            continue;
        }
        let token = format!("{ns}/{name}");
        if after.as_ref().is_some_and(|a| token <= *a) {
            continue;
        }
        if !labels.matches_labels(obj) || !fields.matches_fields(obj) {
            continue;
        }
        if items.len() == limit {
            next = items.last().map(|o: &Value| {
                format!(
                    "{}/{}",
                    o["metadata"]["namespace"].as_str().unwrap_or_default(),
                    o["metadata"]["name"].as_str().unwrap_or_default()
                )
            });
            break;
        }
        items.push(obj.clone());
    }
    let mut metadata = json!({"resourceVersion": st.rv.to_string()});
    if let Some(next) = next {
        metadata["continue"] = json!(next);
    }
    let body = json!({
        "kind": list_kind(collection),
        "apiVersion": api_version_of(collection),
        "metadata": metadata,
        "items": items,
    });
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn watch(
    state: &Arc<Mutex<State>>,
    collection: String,
    namespace: Option<String>,
    labels: Selector,
    fields: Selector,
    q: &BTreeMap<String, String>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(WATCH_BUFFER);
    let from = q
        .get("resourceVersion")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs);
    let w = Watch {
        collection: collection.clone(),
        namespace,
        labels,
        fields,
        tx: tx.clone(),
    };
    {
        let mut st = lock(state);
        if from > 0 && from < st.compacted {
            let gone = json!({
                "type": "ERROR",
                "object": {
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": format!("too old resource version: {from} ({})", st.compacted),
                    "reason": "Expired", "code": 410,
                },
            });
            let _ = tx.try_send(line(&gone));
            drop(tx);
            return stream_response(rx);
        }
        if from == 0 {
            // "Any version": the current state as ADDED, then the changes.
            let current: Vec<Value> = st
                .objects
                .iter()
                .filter(|((c, ns, _), o)| {
                    *c == w.collection
                        && w.namespace.as_ref().is_none_or(|n| n == ns)
                        && w.labels.matches_labels(o)
                        && w.fields.matches_fields(o)
                })
                .map(|(_, o)| o.clone())
                .collect();
            for obj in current {
                let _ = tx.try_send(line(&json!({"type": "ADDED", "object": obj})));
            }
        } else {
            for change in st.history.iter().filter(|c| c.rv > from) {
                if let Some(event) = event_for(&w, change) {
                    let _ = tx.try_send(event);
                }
            }
        }
        st.watches.push(w);
    }
    let state = Arc::clone(state);
    let kind = list_kind(&collection)
        .strip_suffix("List")
        .unwrap_or_default()
        .to_string();
    let api_version = api_version_of(&collection);
    tokio::spawn(async move {
        let started = tokio::time::Instant::now();
        let mut tick = tokio::time::interval(BOOKMARK_EVERY);
        tick.tick().await;
        loop {
            tokio::select! {
                () = tx.closed() => return,
                _ = tick.tick() => {}
            }
            if timeout.is_some_and(|t| started.elapsed() >= t) {
                // The server ends the watch; dropping our sender and the registry's ends it.
                let mut st = lock(&state);
                st.watches.retain(|w| !w.tx.same_channel(&tx));
                return;
            }
            // Still registered? (dropped watches must end.)
            let rv = {
                let st = lock(&state);
                if !st.watches.iter().any(|w| w.tx.same_channel(&tx)) {
                    return;
                }
                st.rv
            };
            if bookmarks {
                let mark = json!({
                    "type": "BOOKMARK",
                    "object": {
                        "kind": kind, "apiVersion": api_version,
                        "metadata": {"resourceVersion": rv.to_string()},
                    },
                });
                if tx.send(line(&mark)).await.is_err() {
                    return;
                }
            }
        }
    });
    stream_response(rx)
}

fn stream_response(rx: mpsc::Receiver<Bytes>) -> Response {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
