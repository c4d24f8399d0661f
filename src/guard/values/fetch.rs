//! A typed value's fetch as the fill engine's origin: a service whose answer is the
//! value, encoded, with the value itself in its extensions (so that the entry the fill
//! stores holds it decoded from the start). The engine calls it as it calls an HTTP
//! origin: once per fill for the fleet, bounded by the refresh timeout, in a task of its
//! own (so a fetch is `'static`, and cloned for each refresh in the background). A value
//! whose encoding does not decode is refused here, before it is stored.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tower_service::Service;

use super::codec::{Codec, CodecError};
use crate::cache::Decoded;

/// A fetch, and the codec its value is kept with.
pub(crate) struct Fetch<F, C> {
    pub(crate) fetch: F,
    pub(crate) codec: Arc<C>,
}

impl<F: Clone, C> Clone for Fetch<F, C> {
    fn clone(&self) -> Self {
        Self {
            fetch: self.fetch.clone(),
            codec: self.codec.clone(),
        }
    }
}

/// How a fetch failed, as the engine's inner service fails.
#[derive(Debug)]
pub(crate) enum Fetched<E> {
    /// The fetch's own error.
    Failed(E),
    /// Its value could not be encoded.
    Encode(CodecError),
}

impl<F, Fut, V, E, C> Service<Request<()>> for Fetch<F, C>
where
    F: FnOnce() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<V, E>> + Send + 'static,
    V: Serialize + DeserializeOwned + Send + Sync + 'static,
    E: Send + 'static,
    C: Codec,
{
    type Response = Response<Full<Bytes>>;
    type Error = Fetched<E>;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _request: Request<()>) -> Self::Future {
        let (fetch, codec) = (self.fetch.clone(), self.codec.clone());
        Box::pin(async move {
            let value = fetch().await.map_err(Fetched::Failed)?;
            let bytes = codec.encode(&value).map_err(Fetched::Encode)?;
            // Read back once: this process keeps the value it fetched, decoded, but every
            // other one decodes these bytes; a type whose encoding does not read back
            // (with postcard: `skip_serializing_if`, a field of `serde_json::Value`) would
            // have each instance forget the others' entries.
            if let Err(error) = codec.decode::<V>(&bytes) {
                let why = format!("its {} encoding does not decode: {error}", C::NAME);
                return Err(Fetched::Encode(CodecError(why)));
            }
            let len = bytes.len();
            let mut response = Response::new(Full::new(Bytes::from(bytes)));
            response
                .headers_mut()
                .insert(http::header::CONTENT_LENGTH, len.into());
            let decoded = Decoded(Arc::new(value));
            response.extensions_mut().insert(decoded);
            Ok(response)
        })
    }
}
