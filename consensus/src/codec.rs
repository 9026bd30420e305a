//! One encoding for everything this crate persists or sends: MessagePack with named fields.
//!
//! Named fields (maps, not positional arrays) keep `#[serde(skip_serializing_if)]`, `flatten`
//! and field additions working, and MessagePack allows non-string map keys, which JSON does not.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Encoding or decoding failed.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The value could not be serialized.
    #[error("encode {type_name}: {source}")]
    Encode {
        /// Rust type being encoded.
        type_name: &'static str,
        /// Underlying error.
        source: rmp_serde::encode::Error,
    },
    /// The bytes did not decode as the expected type.
    #[error("decode {type_name}: {source}")]
    Decode {
        /// Rust type being decoded.
        type_name: &'static str,
        /// Underlying error.
        source: rmp_serde::decode::Error,
    },
}

/// Encodes `value`.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
    rmp_serde::to_vec_named(value).map_err(|source| CodecError::Encode {
        type_name: std::any::type_name::<T>(),
        source,
    })
}

/// Decodes a `T` from `bytes`.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    rmp_serde::from_slice(bytes).map_err(|source| CodecError::Decode {
        type_name: std::any::type_name::<T>(),
        source,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn round_trips_non_string_map_keys_and_options() {
        let mut m: BTreeMap<(u64, u64), Option<String>> = BTreeMap::new();
        m.insert((1, 2), None);
        m.insert((3, 4), Some("x".into()));
        let back: BTreeMap<(u64, u64), Option<String>> = decode(&encode(&m).unwrap()).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn decode_error_names_the_type() {
        let err = decode::<u64>(b"\xc1").unwrap_err();
        assert!(err.to_string().contains("u64"), "{err}");
    }
}
