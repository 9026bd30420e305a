//! LoRA adapters: registered, resident in a slot (least recently used evicted), running and
//! waiting per adapter — what vLLM's `lora_requests_info` shows.

use std::collections::{BTreeMap, HashMap};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// A registered LoRA adapter.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Adapter {
    pub name: String,
    pub path: String,
    /// vLLM's `lora_int_id`, also the `lora_id` of KV events.
    pub id: u64,
}

/// One series of `vllm:lora_requests_info`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraInfoSeries {
    pub running: String,
    pub waiting: String,
    /// Unix time of the last update of this label combination.
    pub updated: f64,
}

#[derive(Debug, Default)]
pub(super) struct LoraState {
    pub(super) adapters: BTreeMap<String, Adapter>,
    pub(super) next_id: u64,
    /// Resident adapters, least recently used first.
    pub(super) resident: Vec<String>,
    /// Requests holding a slot for the adapter (reserved or running).
    pub(super) active: HashMap<String, usize>,
    pub(super) waiting: BTreeMap<String, usize>,
    pub(super) running: BTreeMap<String, usize>,
    /// `(running, waiting)` label values → last update; series never disappear, as in vLLM.
    pub(super) info: HashMap<(String, String), f64>,
    pub(super) last_ts: f64,
    pub(super) loads: u64,
}

fn joined(m: &BTreeMap<String, usize>) -> String {
    m.keys().cloned().collect::<Vec<_>>().join(",")
}

pub(super) fn bump(m: &mut BTreeMap<String, usize>, k: &str, up: bool) {
    if up {
        *m.entry(k.to_owned()).or_default() += 1;
    } else if let Some(n) = m.get_mut(k) {
        *n -= 1;
        if *n == 0 {
            m.remove(k);
        }
    }
}

impl LoraState {
    pub(super) fn register(&mut self, name: &str, path: &str) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        self.adapters.insert(
            name.to_owned(),
            Adapter {
                name: name.to_owned(),
                path: path.to_owned(),
                id,
            },
        );
        id
    }

    /// Stamps the current label combination with the current time, strictly after the last stamp so
    /// the newest combination always has the largest value.
    pub(super) fn touch(&mut self) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let ts = now.max(self.last_ts + 1e-6);
        self.last_ts = ts;
        let key = (joined(&self.running), joined(&self.waiting));
        self.info.insert(key, ts);
    }

    /// Reserves a slot for `name`: `Some(true)` when it had to be swapped in, `None` when every slot
    /// is busy with other adapters.
    pub(super) fn reserve(&mut self, name: &str, max_loras: usize) -> Option<bool> {
        let swapped = if let Some(pos) = self.resident.iter().position(|r| r == name) {
            let r = self.resident.remove(pos);
            self.resident.push(r);
            false
        } else {
            if max_loras > 0 {
                // Free slots by evicting idle adapters, least recently used first.
                while self.resident.len() >= max_loras {
                    let idle = self
                        .resident
                        .iter()
                        .position(|r| self.active.get(r).copied().unwrap_or(0) == 0)?;
                    self.resident.remove(idle);
                }
            }
            self.resident.push(name.to_owned());
            self.loads += 1;
            true
        };
        *self.active.entry(name.to_owned()).or_default() += 1;
        Some(swapped)
    }

    pub(super) fn unreserve(&mut self, name: &str) {
        if let Some(n) = self.active.get_mut(name) {
            *n -= 1;
            if *n == 0 {
                self.active.remove(name);
            }
        }
    }
}

/// Why a LoRA admin call was refused (vLLM's status and message).
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error("LoRA is not enabled (max_loras is 0)")]
    Disabled,
    #[error("The lora adapter '{0}' has already been loaded.")]
    AlreadyLoaded(String),
    #[error("The lora adapter '{0}' cannot be found.")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
}
