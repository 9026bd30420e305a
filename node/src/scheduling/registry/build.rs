//! Building a whole `EndpointPickerConfig`: every plugin constructed, profiles assembled, the
//! profile handler chosen, llm-d's defaults injected (the data producers a consumer needs, the
//! metrics data source), references validated.

use super::*;

/// What the configuration builds: the scheduler and the data-layer settings.
#[derive(Debug, Clone)]
pub struct Built {
    pub scheduler: Scheduler,
    pub metrics_source: MetricsSourceParams,
    /// The in-flight ledger, when a plugin needs one (the response path releases into it).
    pub inflight: Option<Arc<InflightTracker>>,
    pub admission: AdmissionConfig,
    /// The `vllm_http` token producer, when the request needs engine tokens.
    pub render: Option<crate::request::tokens::TokenBackend>,
    /// Where agents' session ids are read (`agent-identity`; its built-in headers when not
    /// configured).
    pub agent: AgentIdentity,
    /// Effective configuration, for the start-up log line.
    pub summary: String,
}

/// Instantiate every plugin, apply llm-d's default injection and validate references — as a
/// list of steps: the plugins, the profiles and their handler, the data producers the profiles
/// need, the data layer, the request handler, admission, agent identity and sessions.
pub fn build(cfg: &EndpointPickerConfig) -> Result<Built, ConfigError> {
    check_gates(cfg)?;
    let plugins = Instances::construct(cfg)?;
    let profiles = plugins.profiles(cfg)?;
    let (handler, rank_port) = plugins.handler(profiles)?;
    let data = plugins.producers(cfg, &handler)?;
    let metrics_source = plugins.data_layer(cfg)?;
    plugins.check_parsers(cfg)?;
    let admission = AdmissionConfig::from_config(cfg)?;
    let admitters: Vec<Arc<dyn Admitter>> = plugins.all(|p| match p {
        Plugin::Admitter(a) => Some(a.clone()),
        _ => None,
    });
    let agent = plugins.agent_identity()?;
    let sessions = plugins.sessions(&agent, &handler)?;
    let summary = summary(&data, &handler, &metrics_source, &admission, &admitters);
    let prefill_profile = match &handler {
        Handler::Disagg {
            prefill: Some((p, _)),
            ..
        } => Some(p.name.clone()),
        _ => None,
    };
    Ok(Built {
        scheduler: Scheduler {
            producers: data.producers,
            handler,
            prefix_index: data.prefix_index,
            precise: data.precise,
            cost_model: data.cost_model,
            sessions,
            prefill_profile,
            admitters,
            rank_port,
        },
        metrics_source,
        inflight: data.inflight,
        admission,
        render: data.render,
        agent,
        summary,
    })
}

/// Every feature-gate entry is `name`, `name=true` or `name=false`.
fn check_gates(cfg: &EndpointPickerConfig) -> Result<(), ConfigError> {
    for g in &cfg.feature_gates {
        let name = g.split_once('=').map_or(g.as_str(), |(n, _)| n);
        cfg.gate(name.trim())?;
    }
    Ok(())
}

/// The configured plugins, constructed: (instance name, type, plugin) in configuration order,
/// and their positions by name.
struct Instances {
    list: Vec<(String, String, Plugin)>,
    by_name: HashMap<String, usize>,
}

/// The producers the profiles need, beyond the configured ones (llm-d's default injection).
struct Needs {
    prefix: bool,
    inflight: bool,
    cost: bool,
    /// Predicted latency (on the cost model), with its parameters.
    latency: Option<latency::LatencyParams>,
    mm_cache: bool,
}

/// The data producers, in the order they run, and the ones the scheduler holds by name.
struct Producers {
    producers: Vec<Arc<dyn Producer>>,
    prefix_index: Option<Arc<ApproxPrefixProducer>>,
    precise: Option<Arc<precise::PrecisePrefixProducer>>,
    cost_model: Option<Arc<cost_model::CostModel>>,
    inflight: Option<Arc<InflightTracker>>,
    render: Option<crate::request::tokens::TokenBackend>,
}

impl Instances {
    fn construct(cfg: &EndpointPickerConfig) -> Result<Instances, ConfigError> {
        let mut out = Instances {
            list: Vec::new(),
            by_name: HashMap::new(),
        };
        for (i, spec) in cfg.plugins.iter().enumerate() {
            let path = format!("plugins[{i}].parameters");
            let name = spec.instance_name().to_string();
            if out.by_name.contains_key(&name) {
                return Err(ConfigError::Field {
                    path: format!("plugins[{i}].name"),
                    message: format!("duplicate plugin name `{name}`"),
                });
            }
            let plugin = construct(&spec.type_name, spec.parameters.as_ref(), &path).map_err(
                |e| match e {
                    ConfigError::Invalid(m) => ConfigError::Invalid(
                        m.replace(&format!("{path}:"), &format!("plugins[{i}].type:")),
                    ),
                    other => other,
                },
            )?;
            out.by_name.insert(name.clone(), out.list.len());
            out.list.push((name, spec.type_name.clone(), plugin));
        }
        Ok(out)
    }

    /// The first plugin `f` picks something from.
    fn first<T>(&self, f: impl FnMut(&Plugin) -> Option<T>) -> Option<T> {
        self.list.iter().map(|(_, _, p)| p).find_map(f)
    }

    /// Everything `f` picks, in configuration order.
    fn all<T>(&self, f: impl FnMut(&Plugin) -> Option<T>) -> Vec<T> {
        self.list.iter().map(|(_, _, p)| p).filter_map(f).collect()
    }

    /// The plugin named `name`, with its type.
    fn named(&self, name: &str) -> Option<(&str, &Plugin)> {
        self.by_name
            .get(name)
            .map(|i| (self.list[*i].1.as_str(), &self.list[*i].2))
    }

    /// The scheduling profiles: as configured, or llm-d's single `default` one holding every
    /// filter, scorer (weight 1) and the first picker.
    fn profiles(&self, cfg: &EndpointPickerConfig) -> Result<Vec<Profile>, ConfigError> {
        // First picker anywhere, or the default max-score-picker.
        let default_picker: Arc<dyn Picker> = self
            .first(|p| match p {
                Plugin::Picker(p) => Some(p.clone()),
                _ => None,
            })
            .unwrap_or_else(|| Arc::new(MaxScorePicker { max_endpoints: 1 }));
        if cfg.scheduling_profiles.is_empty() {
            let mut scorers = Vec::new();
            let mut filters = Vec::new();
            for (name, _, p) in &self.list {
                if let Some(f) = p.as_filter() {
                    filters.push(f);
                } else if let Some(scorer) = p.as_scorer() {
                    scorers.push(WeightedScorer {
                        name: name.clone(),
                        weight: 1.0,
                        scorer,
                    });
                }
            }
            return Ok(vec![Profile {
                name: "default".into(),
                filters,
                scorers,
                picker: default_picker,
            }]);
        }
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for (k, spec) in cfg.scheduling_profiles.iter().enumerate() {
            if !seen.insert(spec.name.as_str()) {
                return Err(ConfigError::Field {
                    path: format!("schedulingProfiles[{k}].name"),
                    message: format!("duplicate profile name `{}`", spec.name),
                });
            }
            out.push(build_profile(
                k,
                spec,
                &self.list,
                &self.by_name,
                &default_picker,
            )?);
        }
        Ok(out)
    }

    /// The profile handler (at most one; default `single-profile-handler`) over `profiles`, and
    /// the data-parallel rank port it maps picks to, if any.
    fn handler(&self, profiles: Vec<Profile>) -> Result<(Handler, Option<u16>), ConfigError> {
        let handlers = self.all(|p| match p {
            Plugin::ProfileHandler(h) => Some(h.clone()),
            _ => None,
        });
        if handlers.len() > 1 {
            return Err(ConfigError::invalid(
                "plugins: more than one profile handler configured",
            ));
        }
        Ok(
            match handlers.into_iter().next().unwrap_or(HandlerSpec::Single) {
                HandlerSpec::Single => {
                    if profiles.len() > 1 {
                        return Err(ConfigError::invalid(format!(
                            "schedulingProfiles: {} profiles need a multi-profile handler; `{SINGLE_PROFILE_HANDLER}` runs exactly one",
                            profiles.len()
                        )));
                    }
                    match profiles.into_iter().next() {
                        Some(p) => (Handler::Single(p), None),
                        None => return Err(ConfigError::invalid("schedulingProfiles: no profile")),
                    }
                }
                HandlerSpec::Pd(spec) => {
                    let decode = find_profile(
                        &profiles,
                        &spec.decode,
                        &format!("{PD_PROFILE_HANDLER}: parameters.decodeProfile"),
                    )?;
                    // No prefill profile: llm-d ran the decode profile alone.
                    let prefill = profiles
                        .iter()
                        .find(|p| p.name == spec.prefill)
                        .map(|p| (p.clone(), spec.decider));
                    (Handler::Disagg { decode, prefill }, spec.primary_port)
                }
                HandlerSpec::DataParallel(port) => {
                    // llm-d: "intended to be used with a single profile".
                    let n = profiles.len();
                    match <[Profile; 1]>::try_from(profiles) {
                        Ok([p]) => (Handler::Single(p), Some(port)),
                        Err(_) => {
                            return Err(ConfigError::invalid(format!(
                                "schedulingProfiles: `{DATA_PARALLEL_PROFILE_HANDLER}` runs exactly one profile, {n} configured"
                            )));
                        }
                    }
                }
                HandlerSpec::Disagg(params) => (self.disagg(&profiles, &params)?, None),
                HandlerSpec::Header(params) => {
                    if profiles.is_empty() {
                        return Err(ConfigError::invalid("schedulingProfiles: no profile"));
                    }
                    if profiles.len() > 1
                        && !profiles.iter().any(|p| p.name == params.default_profile)
                    {
                        tracing::warn!(
                            "{HEADER_PROFILE_HANDLER}: no profile named `{}` (defaultProfile): requests \
                         without the `{}` header will be refused",
                            params.default_profile,
                            params.header_name
                        );
                    }
                    let handler = Handler::Header {
                        header: params.header_name.trim().to_ascii_lowercase(),
                        default: params.default_profile.trim().to_string(),
                        profiles,
                    };
                    (handler, None)
                }
            },
        )
    }

    /// `disagg-profile-handler`: the decode profile, and the prefill one behind its decider.
    fn disagg(&self, profiles: &[Profile], params: &DisaggParams) -> Result<Handler, ConfigError> {
        let find = |name: &str, key: &str| {
            find_profile(
                profiles,
                name,
                &format!("{DISAGG_PROFILE_HANDLER}: parameters.profiles.{key}"),
            )
        };
        let decode = find(&params.profiles.decode, "decode")?;
        if params.deciders.encode.is_some() {
            return Err(ConfigError::invalid(format!(
                "{DISAGG_PROFILE_HANDLER}: parameters.deciders.encode: encode disaggregation is not implemented by this build yet"
            )));
        }
        let prefill = match &params.deciders.prefill {
            None => {
                tracing::warn!(
                    "{DISAGG_PROFILE_HANDLER} without deciders.prefill: every request is decode-only"
                );
                None
            }
            Some(name) => {
                let decider = match self.named(name) {
                    Some((_, Plugin::Decider(d))) => *d,
                    _ => {
                        return Err(ConfigError::invalid(format!(
                            "{DISAGG_PROFILE_HANDLER}: parameters.deciders.prefill: `{name}` is not a P/D decider plugin"
                        )));
                    }
                };
                Some((find(&params.profiles.prefill, "prefill")?, decider))
            }
        };
        Ok(Handler::Disagg { decode, prefill })
    }

    /// The data producers: the configured ones, plus llm-d's defaults for every consumer in
    /// `handler`'s profiles that needs one.
    fn producers(
        &self,
        cfg: &EndpointPickerConfig,
        handler: &Handler,
    ) -> Result<Producers, ConfigError> {
        let needs = self.needs(cfg, handler);
        let mut producers: Vec<Arc<dyn Producer>> = Vec::new();
        let configured_prefix = self.first(|p| match p {
            Plugin::PrefixProducer(p) => Some(p.clone()),
            _ => None,
        });
        let precise = self.first(|p| match p {
            Plugin::PrecisePrefix(p) => Some(p.clone()),
            _ => None,
        });
        if precise.is_some() && configured_prefix.is_some() {
            return Err(ConfigError::invalid(format!(
                "plugins: `{}` and `{}` both produce the prefix match; configure one",
                precise::PRODUCER_TYPE,
                prefix::PRODUCER_TYPE
            )));
        }
        let prefix_index = match (configured_prefix, &precise) {
            (Some(p), _) => Some(p),
            (None, None) if needs.prefix => Some(Arc::new(ApproxPrefixProducer::new(
                prefix::ProducerParams::default(),
            ))),
            _ => None,
        };
        if let Some(p) = &prefix_index {
            producers.push(p.clone());
        }
        if let Some(p) = &precise {
            producers.push(p.clone());
        }
        let render = self.token_backend(precise.is_some())?;
        let inflight_params = match self.first(|p| match p {
            Plugin::InflightProducer(p) => Some(p.clone()),
            _ => None,
        }) {
            Some(p) => Some(p),
            None if needs.inflight => Some(inflight::InflightParams::default()),
            None => None,
        };
        let inflight = inflight_params.map(|params| {
            let tracker = Arc::new(InflightTracker::default());
            producers.push(Arc::new(InflightProducer {
                params,
                tracker: tracker.clone(),
            }));
            tracker
        });
        // After the prefix and in-flight producers: it predicts from their data.
        let cost_model = match self.first(|p| match p {
            Plugin::CostModel(c) => Some(c.clone()),
            _ => None,
        }) {
            Some(c) => Some(c),
            None if needs.cost => Some(Arc::new(cost_model::CostModel::new(
                cost_model::CostModelParams::default(),
            ))),
            None => None,
        };
        if let Some(c) = &cost_model {
            producers.push(c.clone());
            if let Some(params) = needs.latency {
                producers.push(Arc::new(latency::PredictedLatency {
                    params,
                    cost: c.clone(),
                }));
            }
        }
        // The encoder-cache match: configured, or for a scorer that reads it (llm-d's default
        // producer).
        match self.first(|p| match p {
            Plugin::MmCache(c) => Some(c.clone()),
            _ => None,
        }) {
            Some(c) => producers.push(c),
            None if needs.mm_cache => producers.push(Arc::new(mm_cache::MmCache::new(
                &mm_cache::MmCacheParams::default(),
            ))),
            None => {}
        }
        // No-hit LRU scorers record where cold requests went.
        producers.extend(self.all(|p| match p {
            Plugin::NoHitLru(s) => Some(s.clone() as Arc<dyn Producer>),
            _ => None,
        }));
        Ok(Producers {
            producers,
            prefix_index,
            precise,
            cost_model,
            inflight,
            render,
        })
    }

    /// Which producers `handler`'s profiles (and the configured plugins) need.
    fn needs(&self, cfg: &EndpointPickerConfig, handler: &Handler) -> Needs {
        let profiles = handler_profiles(handler);
        let uses = |t: &[&str]| {
            profiles.iter().any(|profile| {
                profile
                    .scorers
                    .iter()
                    .any(|s| t.contains(&s.scorer.type_name()))
                    || profile.filters.iter().any(|f| t.contains(&f.type_name()))
            })
        };
        let has_decider = matches!(
            handler,
            Handler::Disagg {
                prefill: Some((_, PdDecider::PrefixBased { .. })),
                ..
            }
        );
        // The cost model: for its scorer, or for an affinity filter that takes its TTFT from it.
        let affinity_on_cost = cfg.plugins.iter().any(|p| {
            p.type_name == prefix::AFFINITY_FILTER_TYPE
                && p.parameters
                    .as_ref()
                    .and_then(|v| v.get("ttftSource"))
                    .and_then(|v| v.as_str())
                    .is_some_and(prefix::ttft_from_cost_model)
        });
        // The latency plugins read predictions the cost model makes.
        let latency_admitter = self
            .first(|p| {
                matches!(p, Plugin::Admitter(a) if a.type_name() == latency::ADMITTER_TYPE)
                    .then_some(())
            })
            .is_some();
        let latency_params = match self.first(|p| match p {
            Plugin::PredictedLatency(l) => Some(l.clone()),
            _ => None,
        }) {
            Some(l) => Some(l),
            None if latency_admitter
                || uses(&[latency::SCORER_TYPE, latency::TIER_FILTER_TYPE]) =>
            {
                Some(latency::LatencyParams::default())
            }
            None => None,
        };
        let needs_cost =
            affinity_on_cost || latency_params.is_some() || uses(&[cost_model::SCORER_TYPE]);
        let needs_prefix = has_decider
            || needs_cost
            || uses(&[
                prefix::SCORER_TYPE,
                prefix::AFFINITY_FILTER_TYPE,
                no_hit_lru::TYPE,
            ]);
        let needs_inflight = needs_cost
            || uses(&[
                load_scorers::TOKEN_LOAD_TYPE,
                load_scorers::ACTIVE_REQUEST_TYPE,
                prefix::AFFINITY_FILTER_TYPE,
                filters::UTILIZATION_TYPE,
            ]);
        Needs {
            prefix: needs_prefix,
            inflight: needs_inflight,
            cost: needs_cost,
            latency: latency_params,
            mm_cache: uses(&[mm_cache::SCORER_TYPE]),
        }
    }

    /// Engine tokens: the configured token producer's backend; the precise producer cannot
    /// match without them, so it gets the render backend (on the pods) unless one is configured.
    fn token_backend(
        &self,
        precise: bool,
    ) -> Result<Option<crate::request::tokens::TokenBackend>, ConfigError> {
        let configured = self.first(|p| match p {
            Plugin::TokenProducer(r) => Some(r.clone()),
            _ => None,
        });
        Ok(match configured {
            Some(Some(r)) => Some(r),
            Some(None) if precise => {
                tracing::warn!(
                    "{} with the estimate token backend matches nothing: configure token-producer \
                     with backend vllm_http or local",
                    precise::PRODUCER_TYPE
                );
                None
            }
            Some(None) => None,
            None if precise => crate::request::tokens::TokenProducerParams {
                backend: crate::request::tokens::VLLM_HTTP.into(),
                ..Default::default()
            }
            .render("token-producer")?,
            None => None,
        })
    }

    /// `dataLayer`: its sources and extractors name such plugins, discovery is refused, the
    /// cross-replica syncer is a `local-syncer`; the metrics source (a configured one, else the
    /// default).
    fn data_layer(&self, cfg: &EndpointPickerConfig) -> Result<MetricsSourceParams, ConfigError> {
        let mut metrics_source = None;
        if let Some(dl) = &cfg.data_layer {
            for (i, src) in dl.sources.iter().enumerate() {
                let path = format!("dataLayer.sources[{i}].pluginRef");
                match self.named(&src.plugin_ref) {
                    Some((_, Plugin::MetricsSource(p))) => metrics_source = Some(p.clone()),
                    found => {
                        let message = match found {
                            None => format!("no plugin named `{}`", src.plugin_ref),
                            Some(_) => format!("`{}` is not a data source", src.plugin_ref),
                        };
                        return Err(ConfigError::Field { path, message });
                    }
                }
                for (k, ex) in src.extractors.iter().enumerate() {
                    if !matches!(self.named(&ex.plugin_ref), Some((_, Plugin::Extractor))) {
                        return Err(ConfigError::Field {
                            path: format!("dataLayer.sources[{i}].extractors[{k}].pluginRef"),
                            message: format!("`{}` is not a metrics extractor", ex.plugin_ref),
                        });
                    }
                }
            }
            if let Some(d) = &dl.discovery {
                let key = if d.endpoints.is_some() {
                    "endpoints"
                } else {
                    "peers"
                };
                return Err(ConfigError::Field {
                    path: format!("dataLayer.discovery.{key}"),
                    message: "discovery plugins are not supported: the pool's pods come from the \
                              InferencePool (Kubernetes) or --endpoints-file, the peer replicas \
                              from --peers"
                        .into(),
                });
            }
            if let Some(r) = dl
                .cross_replica
                .as_ref()
                .and_then(|c| c.syncer_plugin_ref.as_ref())
                && !matches!(self.named(r), Some((t, _)) if t == super::LOCAL_SYNCER)
            {
                return Err(ConfigError::Field {
                    path: "dataLayer.crossReplica.syncerPluginRef".into(),
                    message: format!("`{r}` is not a `{}` plugin", super::LOCAL_SYNCER),
                });
            }
        }
        Ok(metrics_source
            .or_else(|| {
                self.first(|p| match p {
                    Plugin::MetricsSource(p) => Some(p.clone()),
                    _ => None,
                })
            })
            .unwrap_or_default())
    }

    /// `requestHandler.parsers` name parsers (configured instances or built-in types).
    fn check_parsers(&self, cfg: &EndpointPickerConfig) -> Result<(), ConfigError> {
        let Some(rh) = &cfg.request_handler else {
            return Ok(());
        };
        for (i, r) in rh.parsers.iter().enumerate() {
            let known = matches!(self.named(&r.plugin_ref), Some((_, Plugin::Parser(_))))
                || PARSERS.contains(&r.plugin_ref.as_str());
            if !known {
                return Err(ConfigError::Field {
                    path: format!("requestHandler.parsers[{i}].pluginRef"),
                    message: format!("`{}` is not a parser", r.plugin_ref),
                });
            }
        }
        Ok(())
    }

    /// Agent identity: the configured headers (one instance), for flow control's fairness id and
    /// the session-affinity plugins' `agent-identity` source.
    fn agent_identity(&self) -> Result<AgentIdentity, ConfigError> {
        let agents = self.all(|p| match p {
            Plugin::AgentIdentity(a) => Some(a.clone()),
            _ => None,
        });
        if agents.len() > 1 {
            return Err(ConfigError::invalid(
                "plugins: more than one `agent-identity` configured",
            ));
        }
        Ok(agents.into_iter().next().unwrap_or_default())
    }

    /// The session-affinity instances wired to their id sources; the ones `handler`'s profiles
    /// use record decisions and write tokens back.
    fn sessions(
        &self,
        agent: &AgentIdentity,
        handler: &Handler,
    ) -> Result<Vec<Arc<session::SessionAffinity>>, ConfigError> {
        let id_sources: HashMap<String, session::SessionIdSource> = self
            .list
            .iter()
            .filter_map(|(name, _, p)| match p {
                Plugin::SessionIdProducer(s) => Some((name.clone(), s.clone())),
                _ => None,
            })
            .collect();
        for (name, _, p) in &self.list {
            if let Plugin::Session(s) = p {
                s.use_agent_identity(agent.clone());
                if let Some(missing) = s.use_session_id_producers(id_sources.clone()).first() {
                    return Err(ConfigError::invalid(format!(
                        "plugins `{name}`: a session source reads the `{}` attribute of `{missing}`, \
                         which is not a `{}` plugin of this configuration",
                        session::SESSION_ID_ATTRIBUTE,
                        session::SESSION_ID_PRODUCER
                    )));
                }
            }
        }
        let profiles = handler_profiles(handler);
        Ok(self
            .all(|p| match p {
                Plugin::Session(s) => Some(s.clone()),
                _ => None,
            })
            .into_iter()
            .filter(|s| {
                let me = Arc::as_ptr(s) as *const ();
                profiles.iter().any(|profile| {
                    profile
                        .scorers
                        .iter()
                        .any(|w| Arc::as_ptr(&w.scorer) as *const () == me)
                        || profile
                            .filters
                            .iter()
                            .any(|f| Arc::as_ptr(f) as *const () == me)
                })
            })
            .collect())
    }
}

/// The profiles `handler` runs.
fn handler_profiles(handler: &Handler) -> Vec<&Profile> {
    match handler {
        Handler::Single(p) => vec![p],
        Handler::Disagg { decode, prefill } => std::iter::once(decode)
            .chain(prefill.as_ref().map(|(p, _)| p))
            .collect(),
        Handler::Header { profiles, .. } => profiles.iter().collect(),
    }
}

/// The effective configuration, for the start-up log line and `validate-config`.
fn summary(
    data: &Producers,
    handler: &Handler,
    metrics_source: &MetricsSourceParams,
    admission: &AdmissionConfig,
    admitters: &[Arc<dyn Admitter>],
) -> String {
    let profiles = match handler {
        Handler::Single(p) => describe_profile(p),
        Handler::Disagg { decode, prefill } => {
            let mut s = format!(
                "{DISAGG_PROFILE_HANDLER} decode: {}",
                describe_profile(decode)
            );
            match prefill {
                Some((p, d)) => {
                    s += &format!(" | prefill when {}: {}", d.type_name(), describe_profile(p))
                }
                None => s += " | no prefill decider",
            }
            s
        }
        Handler::Header {
            header,
            default,
            profiles,
        } => format!(
            "{HEADER_PROFILE_HANDLER} (header {header}, default {default}) {}",
            profiles
                .iter()
                .map(|p| format!("{}: {}", p.name, describe_profile(p)))
                .collect::<Vec<_>>()
                .join(" | ")
        ),
    };
    let names = |v: Vec<&str>| v.join(", ");
    let mut s = format!(
        "producers=[{}] tokens={} {} metrics={}://<pod>{} every {} {}",
        names(data.producers.iter().map(|p| p.type_name()).collect()),
        match &data.render {
            Some(crate::request::tokens::TokenBackend::Render(r)) => format!(
                "vllm_http({})",
                r.url.as_deref().unwrap_or("render on the pods")
            ),
            Some(crate::request::tokens::TokenBackend::Local(_)) => "local".into(),
            None => "estimate".into(),
        },
        profiles,
        metrics_source.scheme,
        metrics_source.path,
        metrics_source.interval.as_deref().unwrap_or("base tick"),
        admission.summary(),
    );
    if !admitters.is_empty() {
        s += &format!(
            " admitters=[{}]",
            names(admitters.iter().map(|a| a.type_name()).collect())
        );
    }
    s
}

fn describe_profile(profile: &Profile) -> String {
    format!(
        "profile={} filters=[{}] scorers=[{}] picker={}",
        profile.name,
        profile
            .filters
            .iter()
            .map(|f| f.type_name())
            .collect::<Vec<_>>()
            .join(", "),
        profile
            .scorers
            .iter()
            .map(|s| format!("{}({})*{}", s.name, s.scorer.type_name(), s.weight))
            .collect::<Vec<_>>()
            .join(", "),
        profile.picker.type_name(),
    )
}

/// Build configured profile `k` from its plugin references.
fn build_profile(
    k: usize,
    spec: &crate::config::ProfileSpec,
    instances: &[(String, String, Plugin)],
    by_name: &HashMap<String, usize>,
    default_picker: &Arc<dyn Picker>,
) -> Result<Profile, ConfigError> {
    let mut scorers = Vec::new();
    let mut filters = Vec::new();
    let mut picker = None;
    for (j, r) in spec.plugins.iter().enumerate() {
        let path = format!("schedulingProfiles[{k}].plugins[{j}].pluginRef");
        let idx = by_name
            .get(&r.plugin_ref)
            .ok_or_else(|| ConfigError::Field {
                path: path.clone(),
                message: format!("no plugin named `{}`", r.plugin_ref),
            })?;
        let (name, type_name, p) = &instances[*idx];
        if let Some(f) = p.as_filter() {
            filters.push(f);
            continue;
        }
        if let Some(scorer) = p.as_scorer() {
            let weight = r.weight.unwrap_or(1.0);
            if !weight.is_finite() || weight < 0.0 {
                return Err(ConfigError::Field {
                    path: format!("schedulingProfiles[{k}].plugins[{j}].weight"),
                    message: "weight must be a finite number >= 0".into(),
                });
            }
            scorers.push(WeightedScorer {
                name: name.clone(),
                weight,
                scorer,
            });
            continue;
        }
        match p {
            Plugin::Picker(p) => {
                if picker.is_some() {
                    return Err(ConfigError::Field {
                        path,
                        message: "a profile takes one picker".into(),
                    });
                }
                picker = Some(p.clone());
            }
            // Producers run for every request; llm-d's chart names one in its profile.
            Plugin::PredictedLatency(_)
            | Plugin::PrefixProducer(_)
            | Plugin::PrecisePrefix(_)
            | Plugin::CostModel(_)
            | Plugin::InflightProducer(_)
            | Plugin::TokenProducer(_)
            | Plugin::MmCache(_)
            | Plugin::SessionIdProducer(_) => {}
            _ => {
                return Err(ConfigError::Field {
                    path,
                    message: format!(
                        "plugin `{name}` of type `{type_name}` cannot be used in a scheduling profile"
                    ),
                });
            }
        }
    }
    Ok(Profile {
        name: spec.name.clone(),
        filters,
        scorers,
        picker: picker.unwrap_or_else(|| default_picker.clone()),
    })
}

/// The scheduling profile named `name`, or an error naming the parameter (`what`) that names it.
fn find_profile(profiles: &[Profile], name: &str, what: &str) -> Result<Profile, ConfigError> {
    profiles
        .iter()
        .find(|p| p.name == name)
        .cloned()
        .ok_or_else(|| {
            ConfigError::invalid(format!(
                "{what} names `{name}`, which is not a scheduling profile"
            ))
        })
}
