//! What every call of one [`Values`](super::Values) handle shares (its route and its
//! codec), and how a key is carried through the engine: as the path of a GET that no
//! client ever sends, whose identity is the value's.

use std::sync::Arc;

use http::Request;
use serde::Serialize;

use super::codec::Codec;
use super::error::NoValue;
use crate::guard::route::Route;
use crate::keys::LocalKey;

/// The longest a key may be, encoded with postcard: 4 KiB.
pub const MAX_KEY: usize = 4096;

/// A handle's route and codec.
pub(crate) struct Cache<C> {
    pub(crate) route: Arc<Route>,
    pub(crate) codec: Arc<C>,
}

/// A key, as the engine carries it.
pub(crate) struct Keyed {
    /// Its identity: the codec's name, the value's type name and the key's postcard
    /// bytes, each length-prefixed.
    identity: Vec<u8>,
    /// Its key in L1.
    pub(crate) local: LocalKey,
}

impl Keyed {
    /// The path of its request: `/` and the hex of its identity.
    pub(crate) fn path(&self) -> String {
        let mut path = String::with_capacity(1 + self.identity.len() * 2);
        path.push('/');
        path.push_str(&hex::encode(&self.identity));
        path
    }

    /// The request that carries the key through the engine: a GET of its path.
    pub(crate) fn request(&self) -> Request<()> {
        let mut request = Request::new(());
        // A `/` and hex digits, at most 32 KiB (see `keyed`): always a path.
        *request.uri_mut() = self
            .path()
            .parse()
            .expect("a slash and hex digits, within the length of a URI");
        request
    }
}

impl<C: Codec> Cache<C> {
    /// `key`, for values of type `V`.
    pub(crate) fn keyed<V, K: Serialize + ?Sized>(&self, key: &K) -> Result<Keyed, NoValue> {
        let type_name = std::any::type_name::<V>();
        let mut identity = Vec::with_capacity(64 + type_name.len());
        for part in [C::NAME.as_bytes(), type_name.as_bytes()] {
            identity.extend_from_slice(&(part.len() as u32).to_le_bytes());
            identity.extend_from_slice(part);
        }
        // The key's length first, then its bytes, written in place.
        let at = identity.len();
        identity.extend_from_slice(&[0; 4]);
        let identity =
            postcard::to_extend(key, identity).map_err(|e| NoValue::Encode(e.to_string()))?;
        let mut identity = identity;
        let len = identity.len() - at - 4;
        // (The path, twice the identity, must also fit a URI: the type's name counts.)
        if len > MAX_KEY || identity.len() > 4 * MAX_KEY {
            return Err(NoValue::KeyTooLong(len));
        }
        identity[at..at + 4].copy_from_slice(&(len as u32).to_le_bytes());
        let local = self.route.hex_path_local_key(&identity);
        Ok(Keyed { identity, local })
    }
}
