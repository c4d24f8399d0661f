//! The cached response and its encoding.
//!
//! An entry is encoded as two magic bytes (`SG`), a version byte, then the fields in
//! [postcard](https://docs.rs/postcard). Decoding anything else (garbage, a truncated
//! value, another version, a value of another program) is a [`DecodeError`], never a
//! panic; the cache counts it and treats it as a miss.
//!
//! A body larger than [`PART`] is not in the entry: it is kept beside it in parts of
//! [`PART`] bytes (see `cache::l2`), and the entry says how many and how long the body
//! is; each part starts with its entry's token (its generation) and its index, so that
//! a part of another fill, or out of place, is refused when read.
//!
//! An entry holds no absolute time: only how long it is fresh, how long it may be served
//! stale and how long it is kept, all counted from its write. Its age is read from Redis's
//! remaining TTL and then kept on the local monotonic clock, so that no two machines'
//! wall clocks are ever compared.

// Public for the `fuzzing` feature's re-exports only (see `crate::fuzzing`).
#![cfg_attr(not(feature = "fuzzing"), allow(unreachable_pub))]

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};

use crate::lease::FencingToken;
use crate::store::millis;

const MAGIC: [u8; 2] = *b"SG";
/// The encoding's version. Bump it on any change of the encoded fields; old entries then decode as
/// [`DecodeError::Version`] and are refilled.
pub const VERSION: u8 = 2;

/// The size of a part of a body kept in parts (see the [module docs](self)): 512 KiB,
/// so that no Redis command moves more (one command runs alone on Redis's main thread,
/// and a reader's output buffer holds its reply), while a 16 MiB body is 32 commands.
pub(crate) const PART: usize = 512 * 1024;

/// The slowest a reader of a body in parts is given to read it: 256 KiB a second. A
/// generation of parts replaced by a new entry lingers long enough for a reader at this
/// rate to read it whole (see `scripts/variants.lua`: `drop_parts`): 32 s for 4 MiB,
/// 128 s for the default `max_body` of 16 MiB, 512 s for the largest, 64 MiB.
pub(crate) const SLOWEST_READ_RATE: u64 = 256 * 1024;

/// How long a reader at [`SLOWEST_READ_RATE`] takes to read one part.
pub(crate) const PART_READ_AT_SLOWEST: std::time::Duration =
    std::time::Duration::from_millis(PART as u64 * 1000 / SLOWEST_READ_RATE);

/// What opens every part, before its generation and index.
const PART_MAGIC: [u8; 2] = *b"SP";

/// A part's own header: [`PART_MAGIC`], its entry's token, its index.
pub(crate) const PART_HEADER: usize = 2 + 8 + 4;

/// A body kept in parts: how many, and its whole length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Parted {
    pub(crate) count: u32,
    pub(crate) len: u64,
}

impl Parted {
    /// The parts of a body of `len` bytes: `None` when it is kept whole in its entry.
    pub(crate) fn of(len: usize) -> Option<Self> {
        (len > PART).then(|| Self {
            count: len.div_ceil(PART) as u32,
            len: len as u64,
        })
    }

    /// How long part `index` is.
    pub(crate) fn part_len(&self, index: u32) -> usize {
        let start = index as u64 * PART as u64;
        (self.len - start).min(PART as u64) as usize
    }
}

/// Part `index` of a body of the entry written under `token`, with its header.
pub(crate) fn part(token: FencingToken, index: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PART_HEADER + data.len());
    out.extend_from_slice(&part_header(token, index));
    out.extend_from_slice(data);
    out
}

/// The header that opens part `index` of the entry written under `token`.
pub(crate) fn part_header(token: FencingToken, index: u32) -> [u8; PART_HEADER] {
    let mut header = [0u8; PART_HEADER];
    header[..2].copy_from_slice(&PART_MAGIC);
    header[2..10].copy_from_slice(&token.get().to_le_bytes());
    header[10..].copy_from_slice(&index.to_le_bytes());
    header
}

/// The data of part `index` of the entry written under `token`, which must be `len`
/// bytes: `None` for anything else (another generation's part, another index, short,
/// long, garbage).
pub(crate) fn part_data(
    bytes: &[u8],
    token: FencingToken,
    index: u32,
    len: usize,
) -> Option<&[u8]> {
    let (header, data) = bytes.split_at_checked(PART_HEADER)?;
    (header == part_header(token, index) && data.len() == len).then_some(data)
}

/// The most header values an entry accepted by [`decode`] may hold: far more than any
/// response has (servers refuse a few hundred), and far from what `http`'s header map
/// cannot hold (it panics past 24,576 reserved or 32,768 held).
pub(crate) const MAX_HEADERS: usize = 4096;

/// The largest encoded entry accepted by [`decode`]: the body limit's ceiling plus room
/// for headers.
pub(crate) const MAX_ENCODED_LEN: usize = crate::policy::defaults::MAX_BODY_LIMIT + 1024 * 1024;

/// A response as the caches hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedResponse {
    /// The status.
    pub status: StatusCode,
    /// The headers, without hop-by-hop ones and without those the layer sets itself
    /// (`age`, `x-cache`, `cache-status`).
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
    /// How long it is fresh from its write.
    pub fresh_for: Duration,
    /// How long past freshness it is served stale while refreshed.
    pub grace: Duration,
    /// How long it is kept from its write (at least `fresh_for + grace`).
    pub keep: Duration,
    /// The fencing token of the lease it was written under.
    pub token: FencingToken,
}

/// Why bytes could not be decoded as an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Not an entry of this crate: too short, or the magic bytes are wrong.
    #[error("not a stampede-guard entry")]
    NotAnEntry,
    /// An entry of another encoding version.
    #[error("entry version {0}, expected {VERSION}")]
    Version(u8),
    /// Longer than the largest entry a body limit allows, plus room for headers.
    #[error("entry too large")]
    TooLarge,
    /// The fields do not decode (truncated, or corrupted).
    #[error("malformed entry")]
    Malformed,
    /// A field decodes but is not valid (a status out of range, a bad header, times that
    /// do not fit together).
    #[error("invalid entry: {0}")]
    Invalid(&'static str),
}

/// `serde_bytes`: written as one byte string rather than a sequence of `u8`s (the same
/// postcard bytes, written at memcpy speed).
#[derive(Serialize, Deserialize)]
struct Wire<'a> {
    status: u16,
    #[serde(borrow)]
    headers: Vec<(&'a str, &'a serde_bytes::Bytes)>,
    #[serde(with = "serde_bytes")]
    body: &'a [u8],
    fresh_ms: u64,
    grace_ms: u64,
    keep_ms: u64,
    token: u64,
    /// How many parts the body is kept in beside the entry (then `body` is empty), or 0.
    parts: u32,
    /// The body's whole length.
    len: u64,
}

impl CachedResponse {
    /// Encodes the entry: [`decode`] gives it back whole (for tests and fuzzing: the
    /// cache writes [`encode_for_l2`](Self::encode_for_l2)).
    #[cfg_attr(not(any(test, feature = "fuzzing")), allow(dead_code))]
    pub fn encode(&self) -> Vec<u8> {
        self.encode_where(|_| true, None)
    }

    /// Encodes the entry without `age`, `x-cache` and `cache-status`: what L2 keeps of
    /// an entry of L1, whose headers hold placeholders for the three (the layer sets
    /// them on every answer); without its body when `parted` says it is kept in parts.
    pub(crate) fn encode_for_l2(&self, parted: Option<Parted>) -> Vec<u8> {
        self.encode_where(|name| !crate::http::is_set_by_the_layer(name), parted)
    }

    fn encode_where(&self, keep: impl Fn(&HeaderName) -> bool, parted: Option<Parted>) -> Vec<u8> {
        let headers: Vec<(&str, &serde_bytes::Bytes)> = self
            .headers
            .iter()
            .filter(|(name, _)| keep(name))
            .map(|(name, value)| (name.as_str(), serde_bytes::Bytes::new(value.as_bytes())))
            .collect();
        let wire = Wire {
            status: self.status.as_u16(),
            headers,
            body: if parted.is_some() { &[] } else { &self.body },
            fresh_ms: millis(self.fresh_for),
            grace_ms: millis(self.grace),
            keep_ms: millis(self.keep),
            token: self.token.get(),
            parts: parted.map_or(0, |p| p.count),
            len: self.body.len() as u64,
        };
        let mut out = Vec::with_capacity(self.body.len() + 256);
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        // Writing into a Vec cannot fail, and every field serializes.
        postcard::to_io(&wire, &mut out).expect("encoding into a Vec");
        out
    }
}

/// A copy of `headers` that owns its bytes, compactly: every value is a slice of one
/// buffer of their exact total size. Header names and values parsed by an HTTP client
/// are often slices of its read buffer: stored as they are, each would keep the whole
/// buffer (kilobytes) alive for as long as the entry lives.
pub(crate) fn compact(headers: &HeaderMap) -> HeaderMap {
    let pairs: Vec<(&[u8], &[u8], bool)> = headers
        .iter()
        .map(|(name, value)| {
            (
                name.as_str().as_bytes(),
                value.as_bytes(),
                value.is_sensitive(),
            )
        })
        .collect();
    // Valid names and values stay valid; were the map to refuse them (more than it can
    // hold), the headers are kept as they came.
    compact_from(pairs.len(), pairs.iter().copied()).unwrap_or_else(|| headers.clone())
}

/// Builds a compact header map (see [`compact`]) from names and values; `None` when one
/// is not a valid name or value.
fn compact_from<'a>(
    count: usize,
    headers: impl Iterator<Item = (&'a [u8], &'a [u8], bool)> + Clone,
) -> Option<HeaderMap> {
    let total: usize = headers.clone().map(|(_, value, _)| value.len()).sum();
    let mut blob = bytes::BytesMut::with_capacity(total);
    for (_, value, _) in headers.clone() {
        blob.extend_from_slice(value);
    }
    let blob = blob.freeze();
    let mut out = HeaderMap::try_with_capacity(count).ok()?;
    let mut at = 0;
    for (name, value, sensitive) in headers {
        // Standard names are static; others are copied.
        let name = HeaderName::from_bytes(name).ok()?;
        let mut value = HeaderValue::from_maybe_shared(blob.slice(at..at + value.len())).ok()?;
        at += value.len();
        value.set_sensitive(sensitive);
        out.try_append(name, value).ok()?;
    }
    Some(out)
}

/// Decodes an entry: garbage, a truncated value, another version or out-of-range times
/// are a [`DecodeError`], never a panic. An entry whose body is kept in parts comes
/// without it (its parts are read beside it, in `cache::l2`).
pub fn decode(bytes: &[u8]) -> Result<CachedResponse, DecodeError> {
    decode_head(bytes).map(|(response, _)| response)
}

/// Decodes an entry, and whether its body is kept in parts beside it (then its `body`
/// is empty).
pub(crate) fn decode_head(bytes: &[u8]) -> Result<(CachedResponse, Option<Parted>), DecodeError> {
    if bytes.len() > MAX_ENCODED_LEN {
        return Err(DecodeError::TooLarge);
    }
    if bytes.len() < 3 || bytes[..2] != MAGIC {
        return Err(DecodeError::NotAnEntry);
    }
    if bytes[2] != VERSION {
        return Err(DecodeError::Version(bytes[2]));
    }
    let (wire, rest): (Wire<'_>, &[u8]) =
        postcard::take_from_bytes(&bytes[3..]).map_err(|_| DecodeError::Malformed)?;
    if !rest.is_empty() {
        return Err(DecodeError::Malformed);
    }
    let status = StatusCode::from_u16(wire.status).map_err(|_| DecodeError::Invalid("status"))?;
    if wire.headers.len() > MAX_HEADERS {
        return Err(DecodeError::Invalid("header"));
    }
    let headers = compact_from(
        wire.headers.len(),
        wire.headers
            .iter()
            .map(|(name, value)| (name.as_bytes(), value.as_ref(), false)),
    )
    .ok_or(DecodeError::Invalid("header"))?;
    let day_ms = 24 * 3600 * 1000;
    // (Fresh for none: a `no-cache` answer, revalidated on every use.)
    if wire.fresh_ms > day_ms
        || wire.grace_ms > day_ms
        || wire.keep_ms > 3 * day_ms
        || wire.keep_ms < wire.fresh_ms + wire.grace_ms
    {
        return Err(DecodeError::Invalid("times"));
    }
    if wire.token == 0 {
        return Err(DecodeError::Invalid("token"));
    }
    let parted = match wire.parts {
        0 if wire.len == wire.body.len() as u64 => None,
        parts => match Parted::of(wire.len as usize) {
            Some(parted)
                if parted.count == parts
                    && wire.body.is_empty()
                    && wire.len <= crate::policy::defaults::MAX_BODY_LIMIT as u64 =>
            {
                Some(parted)
            }
            _ => return Err(DecodeError::Invalid("parts")),
        },
    };
    let response = CachedResponse {
        status,
        headers,
        body: Bytes::copy_from_slice(wire.body),
        fresh_for: Duration::from_millis(wire.fresh_ms),
        grace: Duration::from_millis(wire.grace_ms),
        keep: Duration::from_millis(wire.keep_ms),
        token: FencingToken::new(wire.token),
    };
    Ok((response, parted))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn sample() -> CachedResponse {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("text/plain"));
        headers.append("x-multi", HeaderValue::from_static("a"));
        headers.append("x-multi", HeaderValue::from_static("b"));
        CachedResponse {
            status: StatusCode::OK,
            headers,
            body: Bytes::from_static(b"hello"),
            fresh_for: Duration::from_secs(1),
            grace: Duration::from_secs(10),
            keep: Duration::from_secs(60),
            token: FencingToken::new(42),
        }
    }

    #[test]
    fn a_body_in_parts_is_said_in_the_entry_and_each_part_is_checked() {
        let mut entry = sample();
        entry.body = Bytes::from(vec![7u8; PART * 2 + 10]);
        let parted = Parted::of(entry.body.len()).unwrap();
        assert_eq!(
            parted,
            Parted {
                count: 3,
                len: (PART * 2 + 10) as u64
            }
        );
        assert_eq!((parted.part_len(0), parted.part_len(2)), (PART, 10));
        assert_eq!(Parted::of(PART), None, "a body of one part is kept whole");
        let encoded = entry.encode_for_l2(Some(parted));
        assert!(encoded.len() < 1024, "the body is not in the entry");
        let (head, read) = decode_head(&encoded).unwrap();
        assert_eq!((head.body.len(), read), (0, Some(parted)));
        let token = entry.token;
        let part = part(token, 2, &entry.body[..10]);
        assert_eq!(part_data(&part, token, 2, 10), Some(&entry.body[..10]));
        // Another generation's, another index's, short or long: refused.
        assert_eq!(part_data(&part, FencingToken::new(43), 2, 10), None);
        assert_eq!(part_data(&part, token, 1, 10), None);
        assert_eq!(part_data(&part, token, 2, 11), None);
        assert_eq!(part_data(&part[..part.len() - 1], token, 2, 10), None);
        assert_eq!(part_data(b"SP", token, 0, 0), None);
    }

    #[test]
    fn round_trips() {
        let entry = sample();
        assert_eq!(decode(&entry.encode()).unwrap(), entry);
    }

    #[test]
    fn garbage_truncation_and_other_versions_are_errors() {
        let bytes = sample().encode();
        assert_eq!(decode(b""), Err(DecodeError::NotAnEntry));
        assert_eq!(decode(b"hello world"), Err(DecodeError::NotAnEntry));
        let mut other = bytes.clone();
        other[2] = 9;
        assert_eq!(decode(&other), Err(DecodeError::Version(9)));
        for cut in 3..bytes.len() {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode(&longer), Err(DecodeError::Malformed));
    }

    /// An entry with more header values than [`MAX_HEADERS`] is refused, however many:
    /// never a panic from the header map.
    #[test]
    fn too_many_headers_are_refused() {
        for count in [MAX_HEADERS, MAX_HEADERS + 1, 20_000] {
            let mut entry = sample();
            entry.headers.clear();
            for n in 0..count {
                entry
                    .headers
                    .append(HeaderName::from_static("x-n"), HeaderValue::from(n));
            }
            let decoded = decode(&entry.encode());
            if count <= MAX_HEADERS {
                assert_eq!(decoded.unwrap(), entry);
            } else {
                assert_eq!(decoded, Err(DecodeError::Invalid("header")), "{count}");
            }
        }
    }

    /// `encode` keeps every header; what L2 keeps leaves out the two the layer sets.
    #[test]
    fn encode_is_whole_and_l2_leaves_out_age_and_x_cache() {
        let mut entry = sample();
        entry
            .headers
            .insert(http::header::AGE, HeaderValue::from_static("3"));
        entry
            .headers
            .insert(crate::X_CACHE, HeaderValue::from_static("hit"));
        assert_eq!(decode(&entry.encode()).unwrap(), entry);
        let kept = decode(&entry.encode_for_l2(None)).unwrap();
        assert!(!kept.headers.contains_key(http::header::AGE));
        assert!(!kept.headers.contains_key(crate::X_CACHE));
        entry.headers.remove(http::header::AGE);
        entry.headers.remove(crate::X_CACHE);
        assert_eq!(kept, entry);
    }

    proptest! {
        #[test]
        fn any_entry_round_trips(
            status in 200u16..600,
            headers in proptest::collection::vec(("[a-z][a-z0-9-]{0,20}", "[ -~]{0,40}"), 0..8),
            body in proptest::collection::vec(any::<u8>(), 0..4096),
            fresh_ms in 1u64..86_400_000,
            grace_ms in 0u64..86_400_000,
            extra_ms in 0u64..86_400_000,
            token in 1u64..(1 << 53),
        ) {
            let mut map = HeaderMap::new();
            for (name, value) in &headers {
                map.append(
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from_str(value).unwrap(),
                );
            }
            let entry = CachedResponse {
                status: StatusCode::from_u16(status).unwrap(),
                headers: map,
                body: Bytes::from(body),
                fresh_for: Duration::from_millis(fresh_ms),
                grace: Duration::from_millis(grace_ms),
                keep: Duration::from_millis(fresh_ms + grace_ms + extra_ms),
                token: FencingToken::new(token),
            };
            prop_assert_eq!(decode(&entry.encode()).unwrap(), entry);
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
            let mut framed = b"SG\x02".to_vec();
            framed.extend_from_slice(&bytes);
            let _ = decode(&framed);
        }
    }
}
