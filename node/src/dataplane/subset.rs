//! The subset hint (GIE protocol v0.3): the proxy may restrict a request to some endpoints through
//! request metadata, `filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]`
//! = a list of `ip:port` strings (a comma-separated string is accepted too). As in llm-d the EPP
//! matches by IP only, and a hint that is present but empty leaves no candidates (503).

use std::net::{IpAddr, SocketAddr};

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::value::Kind;

pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

fn ip_of(s: &str) -> Option<IpAddr> {
    let s = s.trim();
    s.parse::<SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| s.parse::<IpAddr>())
        .ok()
}

/// The allowed IPs, if the metadata carries a hint. Entries that are not addresses are skipped
/// (logged); a hint of only such entries allows nothing.
pub fn subset_hint(md: &Metadata) -> Option<Vec<IpAddr>> {
    let value = md
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET_KEY)?;
    let entries: Vec<String> = match &value.kind {
        Some(Kind::ListValue(l)) => l
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.clone()),
                _ => None,
            })
            .collect(),
        Some(Kind::StringValue(s)) => s
            .split(',')
            .filter(|x| !x.trim().is_empty())
            .map(str::to_string)
            .collect(),
        other => {
            tracing::debug!(
                ?other,
                "subset hint of an unexpected type: treated as empty"
            );
            Vec::new()
        }
    };
    Some(
        entries
            .iter()
            .filter_map(|e| {
                let ip = ip_of(e);
                if ip.is_none() {
                    tracing::debug!(entry = %e, "subset hint entry is not an address");
                }
                ip
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};

    fn md(value: Kind) -> Metadata {
        let mut s = Struct::default();
        s.fields
            .insert(SUBSET_KEY.into(), Value { kind: Some(value) });
        let mut m = Metadata::default();
        m.filter_metadata.insert(SUBSET_NAMESPACE.into(), s);
        m
    }

    fn list(items: &[&str]) -> Kind {
        Kind::ListValue(ListValue {
            values: items
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue((*s).into())),
                })
                .collect(),
        })
    }

    #[test]
    fn reads_lists_strings_and_ips() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            subset_hint(&md(list(&[
                "10.0.0.1:8000",
                "10.0.0.2",
                "[::1]:80",
                "nope"
            ]))),
            Some(vec![ip("10.0.0.1"), ip("10.0.0.2"), ip("::1")])
        );
        assert_eq!(
            subset_hint(&md(Kind::StringValue("10.0.0.3:1, 10.0.0.4:2".into()))),
            Some(vec![ip("10.0.0.3"), ip("10.0.0.4")])
        );
        // present but empty: nothing allowed
        assert_eq!(subset_hint(&md(list(&[]))), Some(vec![]));
        assert_eq!(subset_hint(&md(Kind::NumberValue(1.0))), Some(vec![]));
        // absent: no hint
        assert_eq!(subset_hint(&Metadata::default()), None);
    }
}
