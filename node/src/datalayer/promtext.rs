//! A small, allocation-light parser for the Prometheus text exposition format.
//!
//! It yields one [`Sample`] per sample line, skipping comments and blank lines; only the metric
//! name is read up front — labels and value are parsed when asked for, so the many lines a
//! caller does not want (an engine's histogram buckets are most of its exposition) cost a name
//! search and nothing more. A garbage line never poisons the rest of the scrape: its value or
//! labels read as absent. Labels are returned with escapes undone only for `\"` and `\\`.

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// The line after the name: `{labels} value [timestamp]` or ` value [timestamp]`.
    rest: &'a str,
}

impl<'a> Sample<'a> {
    /// Raw `k="v",...` text between the braces (empty when there are none) and what follows.
    fn split(&self) -> Option<(&'a str, &'a str)> {
        match self.rest.strip_prefix('{') {
            Some(inner) => {
                let close = find_label_end(inner)?;
                Some((&inner[..close], &inner[close + 1..]))
            }
            None => Some(("", self.rest)),
        }
    }

    /// The sample's value; `None` for a line that has none or cannot be read.
    pub fn value(&self) -> Option<f64> {
        let (_, rest) = self.split()?;
        parse_value(rest.split_whitespace().next()?)
    }

    /// The value of label `key`, unescaped only for the common `\"`/`\\` cases.
    pub fn label(&self, key: &str) -> Option<String> {
        let (mut rest, _) = self.split()?;
        loop {
            rest = rest.trim_start_matches([',', ' ']);
            if rest.is_empty() {
                return None;
            }
            let eq = rest.find('=')?;
            let k = rest[..eq].trim();
            let after = rest[eq + 1..].trim_start();
            let after = after.strip_prefix('"')?;
            // find the closing quote, honouring backslash escapes
            let mut end = None;
            let mut escaped = false;
            for (i, c) in after.char_indices() {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == '"' {
                    end = Some(i);
                    break;
                }
            }
            let end = end?;
            let raw = &after[..end];
            if k == key {
                return Some(raw.replace("\\\"", "\"").replace("\\\\", "\\"));
            }
            rest = &after[end + 1..];
        }
    }
}

/// Iterate over the sample lines of an exposition text.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(parse_line)
}

fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(['{', ' ', '\t'])?;
    if name_end == 0 {
        return None;
    }
    Some(Sample {
        name: &line[..name_end],
        rest: &line[name_end..],
    })
}

/// Position of the `}` closing the label set, skipping quoted strings.
fn find_label_end(s: &str) -> Option<usize> {
    let mut in_str = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if in_str {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_str = false;
            }
        } else if c == '"' {
            in_str = true;
        } else if c == '}' {
            return Some(i);
        }
    }
    None
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_samples_and_labels() {
        let text = "# HELP x y\n# TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 3.0\n\
            plain 7\n\
            vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"4096\",weird=\"a\\\"b,c}\"} 1.0 1700000000\n\
            garbage line here\n{broken\n";
        let all: Vec<_> = samples(text).filter(|s| s.value().is_some()).collect();
        assert_eq!(all.len(), 3);
        assert_eq!(all[0].name, "vllm:num_requests_waiting");
        assert_eq!(all[0].value(), Some(3.0));
        assert_eq!(all[0].label("engine").as_deref(), Some("0"));
        assert_eq!(all[1].name, "plain");
        assert_eq!(all[2].label("num_gpu_blocks").as_deref(), Some("4096"));
        assert_eq!(all[2].label("weird").as_deref(), Some("a\"b,c}"));
        assert_eq!(all[2].label("missing"), None);
    }

    #[test]
    fn tolerates_garbage() {
        let text = "\u{0}\u{1}binary{{{ 12\nok 1\nbad{a=\"unterminated 3\n";
        let all: Vec<_> = samples(text).collect();
        assert!(all.iter().any(|s| s.name == "ok" && s.value() == Some(1.0)));
        assert!(all.iter().all(|s| s.name == "ok" || s.value().is_none()));
    }
}
