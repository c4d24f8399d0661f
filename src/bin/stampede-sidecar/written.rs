//! When an answer's last byte was written. A body that ended has only been handed to
//! its connection: hyper (and TLS) buffer what it gave, and write it as the client
//! takes it. What waits for that is called at the connection's next flush that
//! completes (hyper asks its stream to flush only once its own buffer is written out),
//! or when the connection goes. As nginx's `$request_time`: the last byte handed to
//! the kernel, whose own buffers a client may not have read yet.

use std::sync::{Arc, Mutex};

/// What waits on one connection for its written bytes: shared by the connection's
/// stream and its requests (as a request extension).
#[derive(Clone, Default)]
pub(crate) struct Written(Arc<Mutex<Vec<Waiting>>>);

type Waiting = Box<dyn FnOnce() + Send>;

impl Written {
    /// Calls `then` once what was handed to the connection so far is written.
    pub(crate) fn then(&self, then: impl FnOnce() + Send + 'static) {
        self.lock().push(Box::new(then));
    }

    /// The connection flushed (or went): everything waiting is called.
    pub(crate) fn flushed(&self) {
        let waiting = std::mem::take(&mut *self.lock());
        for then in waiting {
            then();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Waiting>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
