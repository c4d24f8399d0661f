//! What every call of one [`Values`](super::Values) handle shares (its route and its
//! codec), and how a key is carried through the engine: as the path of a GET that no
//! client ever sends, whose identity is the value's.

use std::sync::Arc;

use http::Request;
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::codec::Codec;
use super::error::NoValue;
use crate::guard::route::Route;
use crate::keys::LocalKey;

/// The longest a key may be, encoded with postcard: 4 KiB.
pub const MAX_KEY: usize = 4096;

/// A handle's route and codec, and the kind of its values.
pub(crate) struct Cache<C> {
    pub(crate) route: Arc<Route>,
    pub(crate) codec: Arc<C>,
    /// The start of every key's identity: the first bytes of the SHA-256 of the codec's
    /// name and the value's type name, each length-prefixed (hashed once, here, so that
    /// a hit hashes a few bytes for them, not a type's whole name).
    kind: [u8; KIND],
}

/// The bytes of a [`Cache`]'s kind.
const KIND: usize = 8;

/// A key, as the engine carries it.
pub(crate) struct Keyed {
    /// Its identity: the cache's kind, then the key's postcard bytes, length-prefixed.
    identity: Identity,
    /// Its key in L1.
    pub(crate) local: LocalKey,
}

/// The most bytes of identity kept inline: a key whose identity fits costs an L1 hit
/// no allocation.
const INLINE: usize = 64;

/// A key's identity, inline when it fits [`INLINE`] bytes, else on the heap.
enum Identity {
    Inline { bytes: [u8; INLINE], len: usize },
    Heap(Vec<u8>),
}

impl Identity {
    fn as_slice(&self) -> &[u8] {
        match self {
            Self::Inline { bytes, len } => &bytes[..*len],
            Self::Heap(bytes) => bytes,
        }
    }
}

impl Keyed {
    /// Its identity's bytes.
    #[cfg(test)]
    pub(super) fn identity(&self) -> &[u8] {
        self.identity.as_slice()
    }

    /// The path of its request: `/` and the hex of its identity.
    pub(crate) fn path(&self) -> String {
        let identity = self.identity.as_slice();
        let mut path = String::with_capacity(1 + identity.len() * 2);
        path.push('/');
        path.push_str(&hex::encode(identity));
        path
    }

    /// The request that carries the key through the engine: a GET of its path.
    pub(crate) fn request(&self) -> Request<()> {
        let mut request = Request::new(());
        // A `/` and hex digits, at most 8 KiB and a few bytes: always a path.
        *request.uri_mut() = self
            .path()
            .parse()
            .expect("a slash and hex digits, within the length of a URI");
        request
    }
}

impl<C: Codec> Cache<C> {
    /// The cache of values of type `V` on `route`, encoded by `codec`.
    pub(crate) fn new<V>(route: Arc<Route>, codec: Arc<C>) -> Self {
        let mut digest = Sha256::new();
        for name in [C::NAME, std::any::type_name::<V>()] {
            digest.update((name.len() as u32).to_le_bytes());
            digest.update(name.as_bytes());
        }
        let mut kind = [0; KIND];
        kind.copy_from_slice(&digest.finalize()[..KIND]);
        Self { route, codec, kind }
    }

    /// `key`, in this cache.
    pub(crate) fn keyed<K: Serialize + ?Sized>(&self, key: &K) -> Result<Keyed, NoValue> {
        let mut bytes = [0; INLINE];
        let identity = match inline_identity(&mut bytes, &self.kind, key) {
            Some(len) => Identity::Inline { bytes, len },
            None => Identity::Heap(heap_identity(&self.kind, key)?),
        };
        let local = self.route.hex_path_local_key(identity.as_slice());
        Ok(Keyed { identity, local })
    }
}

/// Where, in an identity, the length of the key's bytes is written: after the kind.
const AT: usize = KIND;

/// The identity written into `out`, and its length; `None` when it does not fit, or
/// the key did not encode (the heap's encoding says why: a key written through
/// `collect_str`, say, tells a full buffer by an error of its own).
fn inline_identity<K: Serialize + ?Sized>(
    out: &mut [u8; INLINE],
    kind: &[u8; KIND],
    key: &K,
) -> Option<usize> {
    out[..AT].copy_from_slice(kind);
    let len = postcard::to_slice(key, &mut out[AT + 4..]).ok()?.len();
    // (Within `INLINE` bytes: never too long.)
    out[AT..AT + 4].copy_from_slice(&(len as u32).to_le_bytes());
    Some(AT + 4 + len)
}

/// The identity, on the heap: refused when the key is longer than [`MAX_KEY`].
pub(super) fn heap_identity<K: Serialize + ?Sized>(
    kind: &[u8; KIND],
    key: &K,
) -> Result<Vec<u8>, NoValue> {
    let mut identity = Vec::with_capacity(64);
    identity.extend_from_slice(kind);
    identity.extend_from_slice(&[0; 4]);
    let mut identity =
        postcard::to_extend(key, identity).map_err(|e| NoValue::Encode(e.to_string()))?;
    let len = identity.len() - AT - 4;
    if len > MAX_KEY {
        return Err(NoValue::KeyTooLong(len));
    }
    identity[AT..AT + 4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(identity)
}
