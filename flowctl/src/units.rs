//! Kubernetes resource quantities ("1Gi", "1k", "500M", plain integers) and Go duration strings
//! ("60s", "500ms", "1m30s"), the two value syntaxes llm-d's `flowControl` section uses.
//!
//! Both parse to plain integers (a count/byte number, nanoseconds) so the state machine never sees a
//! string. Both deserialize from YAML/JSON strings; quantities also from non-negative integers.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// Time in nanoseconds. Every state-machine call takes `now` in this unit; the crate never reads a clock.
pub type Nanos = u64;

pub const NANOS_PER_MILLI: Nanos = 1_000_000;
pub const NANOS_PER_SEC: Nanos = 1_000_000_000;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    #[error("invalid quantity `{input}`: {why}")]
    Quantity { input: String, why: &'static str },
    #[error("invalid duration `{input}`: {why}")]
    Duration { input: String, why: &'static str },
}

/// A non-negative Kubernetes resource quantity, rounded up to an integer (as `Quantity.Value()` does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Quantity(pub u64);

impl Quantity {
    pub fn value(self) -> u64 {
        self.0
    }

    /// Parse `<number><suffix>`: number is digits with an optional fraction (`1.5Gi`); suffix is one of
    /// the binary `Ki Mi Gi Ti Pi Ei`, the decimal `n u m k M G T P E` or an exponent `e3`/`E3`.
    /// Fractions round up (`500m` → 1). Negative values and overflow are errors.
    pub fn parse(input: &str) -> Result<Quantity, UnitError> {
        let err = |why| UnitError::Quantity {
            input: input.to_string(),
            why,
        };
        let s = input.trim();
        let s = s.strip_prefix('+').unwrap_or(s);
        if s.starts_with('-') {
            return Err(err("quantities must not be negative"));
        }
        let num_end = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (number, suffix) = s.split_at(num_end);
        if number.is_empty() || number == "." {
            return Err(err("missing number"));
        }
        let (int_part, frac_part) = match number.split_once('.') {
            Some((i, f)) => (i, f),
            None => (number, ""),
        };
        if frac_part.contains('.') {
            return Err(err("more than one decimal point"));
        }
        if int_part.len() + frac_part.len() > 30 {
            return Err(err("too many digits"));
        }
        // mantissa = all digits as an integer; value = mantissa * num / den.
        let mut mantissa: u128 = 0;
        for c in int_part.chars().chain(frac_part.chars()) {
            mantissa = mantissa * 10 + u128::from(c as u8 - b'0');
        }
        let mut den: u128 = 10u128.pow(frac_part.len() as u32);
        let mut num: u128 = 1;
        match suffix {
            "" => {}
            "Ki" => num = 1 << 10,
            "Mi" => num = 1 << 20,
            "Gi" => num = 1 << 30,
            "Ti" => num = 1 << 40,
            "Pi" => num = 1 << 50,
            "Ei" => num = 1 << 60,
            "n" => den *= 1_000_000_000,
            "u" => den *= 1_000_000,
            "m" => den *= 1_000,
            "k" => num = 1_000,
            "M" => num = 1_000_000,
            "G" => num = 1_000_000_000,
            "T" => num = 1_000_000_000_000,
            "P" => num = 1_000_000_000_000_000,
            "E" => num = 1_000_000_000_000_000_000,
            other => {
                let exp = other
                    .strip_prefix('e')
                    .or_else(|| other.strip_prefix('E'))
                    .ok_or_else(|| err("unknown suffix"))?;
                let (neg, digits) = match exp.strip_prefix('-') {
                    Some(d) => (true, d),
                    None => (false, exp.strip_prefix('+').unwrap_or(exp)),
                };
                if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
                    return Err(err("bad exponent"));
                }
                let e: u32 = digits.parse().map_err(|_| err("bad exponent"))?;
                if e > 30 {
                    return Err(err("exponent too large"));
                }
                if neg {
                    den *= 10u128.pow(e);
                } else {
                    num = 10u128.pow(e);
                }
            }
        }
        let scaled = mantissa
            .checked_mul(num)
            .ok_or_else(|| err("value too large"))?;
        let value = scaled.div_ceil(den);
        u64::try_from(value)
            .map(Quantity)
            .map_err(|_| err("value too large"))
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Quantity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a Kubernetes quantity such as 5000, \"1k\" or \"1Gi\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Quantity, E> {
                Ok(Quantity(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Quantity, E> {
                u64::try_from(v)
                    .map(Quantity)
                    .map_err(|_| E::custom("quantities must not be negative"))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Quantity, E> {
                if v.is_finite() && v >= 0.0 && v <= u64::MAX as f64 {
                    Ok(Quantity(v.ceil() as u64))
                } else {
                    Err(E::custom("quantities must be finite and not negative"))
                }
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Quantity, E> {
                Quantity::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A Go `time.Duration` string, held as nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GoDuration(pub Nanos);

impl GoDuration {
    pub fn from_millis(ms: u64) -> Self {
        GoDuration(ms.saturating_mul(NANOS_PER_MILLI))
    }

    pub fn from_secs(s: u64) -> Self {
        GoDuration(s.saturating_mul(NANOS_PER_SEC))
    }

    pub fn nanos(self) -> Nanos {
        self.0
    }

    /// Parse like Go's `time.ParseDuration`: a sequence of `<decimal><unit>` with units
    /// `ns us µs ms s m h`, e.g. `1m30s`, `1.5s`, `500ms`; `0` alone is allowed. Negative durations
    /// are rejected (no TTL can be negative).
    pub fn parse(input: &str) -> Result<GoDuration, UnitError> {
        let err = |why| UnitError::Duration {
            input: input.to_string(),
            why,
        };
        let mut s = input.trim();
        if let Some(rest) = s.strip_prefix('+') {
            s = rest;
        }
        if s.starts_with('-') {
            return Err(err("durations must not be negative"));
        }
        if s == "0" {
            return Ok(GoDuration(0));
        }
        if s.is_empty() {
            return Err(err("empty duration"));
        }
        let mut total: u128 = 0;
        while !s.is_empty() {
            let num_end = s
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .ok_or_else(|| err("missing unit"))?;
            let (number, rest) = s.split_at(num_end);
            if number.is_empty() || number == "." {
                return Err(err("missing number"));
            }
            let unit_end = rest
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(rest.len());
            let (unit, rest) = rest.split_at(unit_end);
            let unit_nanos: u128 = match unit {
                "ns" => 1,
                "us" | "µs" | "μs" => 1_000,
                "ms" => 1_000_000,
                "s" => 1_000_000_000,
                "m" => 60 * 1_000_000_000,
                "h" => 3_600 * 1_000_000_000,
                "" => return Err(err("missing unit")),
                _ => return Err(err("unknown unit")),
            };
            let (int_part, frac_part) = match number.split_once('.') {
                Some((i, f)) => (i, f),
                None => (number, ""),
            };
            if frac_part.contains('.') || int_part.len() > 20 || frac_part.len() > 18 {
                return Err(err("bad number"));
            }
            let int: u128 = if int_part.is_empty() {
                0
            } else {
                int_part.parse().map_err(|_| err("bad number"))?
            };
            let mut part = int
                .checked_mul(unit_nanos)
                .ok_or_else(|| err("duration too large"))?;
            if !frac_part.is_empty() {
                let frac: u128 = frac_part.parse().map_err(|_| err("bad number"))?;
                let scale = 10u128.pow(frac_part.len() as u32);
                // Go truncates the fractional nanoseconds.
                part += frac * unit_nanos / scale;
            }
            total = total
                .checked_add(part)
                .ok_or_else(|| err("duration too large"))?;
            s = rest;
        }
        u64::try_from(total)
            .map(GoDuration)
            .map_err(|_| err("duration too large"))
    }
}

impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ns", self.0)
    }
}

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{}ns", self.0))
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        GoDuration::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        let q = |s: &str| Quantity::parse(s).unwrap().value();
        assert_eq!(q("0"), 0);
        assert_eq!(q("5000"), 5000);
        assert_eq!(q("1k"), 1_000);
        assert_eq!(q("500M"), 500_000_000);
        assert_eq!(q("1G"), 1_000_000_000);
        assert_eq!(q("1Gi"), 1 << 30);
        assert_eq!(q("1.5Ki"), 1536);
        assert_eq!(q("2Mi"), 2 << 20);
        assert_eq!(q("500m"), 1, "fractions round up");
        assert_eq!(q("1500m"), 2);
        assert_eq!(q("1e3"), 1_000);
        assert_eq!(q("1.5e1"), 15);
        assert_eq!(q("+7"), 7);
        for bad in [
            "",
            "-1",
            "1x",
            "Gi",
            "1.2.3",
            "1e",
            "99999999999999999999E",
            "1 k",
        ] {
            assert!(Quantity::parse(bad).is_err(), "{bad} should fail");
        }
    }

    #[test]
    fn durations() {
        let d = |s: &str| GoDuration::parse(s).unwrap().nanos();
        assert_eq!(d("0"), 0);
        assert_eq!(d("60s"), 60 * NANOS_PER_SEC);
        assert_eq!(d("500ms"), 500 * NANOS_PER_MILLI);
        assert_eq!(d("1m30s"), 90 * NANOS_PER_SEC);
        assert_eq!(d("1.5s"), 1_500 * NANOS_PER_MILLI);
        assert_eq!(d("2h"), 7_200 * NANOS_PER_SEC);
        assert_eq!(d("300us"), 300_000);
        assert_eq!(d("300µs"), 300_000);
        assert_eq!(d("7ns"), 7);
        assert_eq!(d(".5s"), 500 * NANOS_PER_MILLI);
        for bad in ["", "60", "-1s", "1x", "s", "1.2.3s", "5d"] {
            assert!(GoDuration::parse(bad).is_err(), "{bad} should fail");
        }
    }

    #[test]
    fn serde_forms() {
        let q: Quantity = serde_json::from_value(serde_json::json!("1Gi")).unwrap();
        assert_eq!(q.0, 1 << 30);
        let q: Quantity = serde_json::from_value(serde_json::json!(42)).unwrap();
        assert_eq!(q.0, 42);
        assert!(serde_json::from_value::<Quantity>(serde_json::json!(-3)).is_err());
        let d: GoDuration = serde_json::from_value(serde_json::json!("1m")).unwrap();
        assert_eq!(d.0, 60 * NANOS_PER_SEC);
        let back: GoDuration = serde_json::from_value(serde_json::to_value(d).unwrap()).unwrap();
        assert_eq!(back, d);
    }
}
