//! How a typed value is kept in Redis: encoded by a [`Codec`]. [`Postcard`] by default
//! (compact, and fast); [`Json`] behind the `json` feature, for values other services or
//! people read too. The codec's name is part of every key of the values it encodes, so
//! that two codecs never read each other's bytes.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Why a value could not be encoded or decoded: the codec's own words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CodecError(pub(crate) String);

/// Turns values into bytes and back, the same way in every process of the fleet.
///
/// A value that no longer decodes (its type changed in a rolling deploy) is a miss,
/// fetched again, never a panic (see [`Values`](crate::Values) for versions).
pub trait Codec: Send + Sync + 'static {
    /// A short name, part of the keys of the values it encodes.
    const NAME: &'static str;

    /// The bytes of `value`.
    fn encode<V: Serialize>(&self, value: &V) -> Result<Vec<u8>, CodecError>;

    /// The value `bytes` encode.
    fn decode<V: DeserializeOwned>(&self, bytes: &[u8]) -> Result<V, CodecError>;
}

/// [postcard](https://docs.rs/postcard): a compact binary encoding of serde's data
/// model, without field names (so a field added or moved changes what decodes: raise
/// the route's [`version`](crate::policy::PolicyBuilder::version) with it).
#[derive(Debug, Clone, Copy, Default)]
pub struct Postcard;

impl Codec for Postcard {
    const NAME: &'static str = "postcard";

    fn encode<V: Serialize>(&self, value: &V) -> Result<Vec<u8>, CodecError> {
        postcard::to_stdvec(value).map_err(|e| CodecError(e.to_string()))
    }

    fn decode<V: DeserializeOwned>(&self, bytes: &[u8]) -> Result<V, CodecError> {
        postcard::from_bytes(bytes).map_err(|e| CodecError(e.to_string()))
    }
}

/// JSON, through serde_json: larger and slower than [`Postcard`], but readable by
/// anyone who looks in Redis, and tolerant of fields added with `#[serde(default)]`.
#[cfg(feature = "json")]
#[derive(Debug, Clone, Copy, Default)]
pub struct Json;

#[cfg(feature = "json")]
impl Codec for Json {
    const NAME: &'static str = "json";

    fn encode<V: Serialize>(&self, value: &V) -> Result<Vec<u8>, CodecError> {
        serde_json::to_vec(value).map_err(|e| CodecError(e.to_string()))
    }

    fn decode<V: DeserializeOwned>(&self, bytes: &[u8]) -> Result<V, CodecError> {
        serde_json::from_slice(bytes).map_err(|e| CodecError(e.to_string()))
    }
}
