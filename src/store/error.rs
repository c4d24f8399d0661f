//! How a Redis operation failed: the operation, the kind of failure, and its cause.

use std::fmt;

/// What the crate was doing when Redis failed; a bounded set, fit for a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Operation {
    /// Taking a lease.
    Acquire,
    /// Extending a lease.
    Renew,
    /// Giving a lease back.
    Release,
    /// A health check.
    Ping,
    /// Reading a cache entry.
    Read,
    /// The fenced write of a cache entry (and the release of its lease).
    Write,
    /// Deleting a cache entry for everyone.
    Invalidate,
    /// Listening to other instances' notices.
    Subscribe,
    /// Telling other instances about a fill that wrote nothing, or a learned `Vary`.
    Publish,
    /// Looking at keys, for debugging.
    Inspect,
}

impl Operation {
    /// Every operation, for series registered at zero (see `RedisStore`).
    pub(crate) const ALL: [Self; 10] = [
        Self::Acquire,
        Self::Renew,
        Self::Release,
        Self::Ping,
        Self::Read,
        Self::Write,
        Self::Invalidate,
        Self::Subscribe,
        Self::Publish,
        Self::Inspect,
    ];

    /// The operation's name, as used in logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Acquire => "acquire",
            Self::Renew => "renew",
            Self::Release => "release",
            Self::Ping => "ping",
            Self::Read => "read",
            Self::Write => "write",
            Self::Invalidate => "invalidate",
            Self::Subscribe => "subscribe",
            Self::Publish => "publish",
            Self::Inspect => "inspect",
        }
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a Redis operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// No connection could be had before the deadline: Redis is down, refusing, not
    /// answering the handshake, or the pool is exhausted. The command was not sent.
    NoConnection,
    /// The command was sent and no reply came before the deadline. Whether Redis ran it
    /// is unknown.
    Timeout,
    /// The connection broke while the command was in flight (reset, closed). Whether
    /// Redis ran it is unknown.
    ConnectionLost,
    /// Redis answered with an error reply (`READONLY`, `OOM`, `NOPERM`, `BUSY`,
    /// `NOAUTH`, a script error, ...). See [`StoreError::server_code`].
    Server,
    /// Redis answered with something the crate could not understand.
    Response,
    /// The circuit breaker is open after repeated failures: Redis was not asked.
    CircuitOpen,
}

impl StoreErrorKind {
    /// Every kind, for series registered at zero (see `RedisStore`).
    pub(crate) const ALL: [Self; 6] = [
        Self::NoConnection,
        Self::Timeout,
        Self::ConnectionLost,
        Self::Server,
        Self::Response,
        Self::CircuitOpen,
    ];

    /// The kind's name, as used in logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoConnection => "no_connection",
            Self::Timeout => "timeout",
            Self::ConnectionLost => "connection_lost",
            Self::Server => "server",
            Self::Response => "response",
            Self::CircuitOpen => "circuit_open",
        }
    }
}

impl fmt::Display for StoreErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NoConnection => "no connection to Redis in time",
            Self::Timeout => "no reply from Redis in time (outcome unknown)",
            Self::ConnectionLost => "connection lost with the command in flight (outcome unknown)",
            Self::Server => "Redis answered with an error",
            Self::Response => "unexpected reply from Redis",
            Self::CircuitOpen => "circuit breaker open, Redis not asked",
        })
    }
}

/// A Redis operation that did not complete.
///
/// It says which [`Operation`] failed and how ([`StoreErrorKind`]); the redis-rs error
/// behind it, where there is one, is its [`source`](std::error::Error::source), and its
/// message ends with it, so that the message alone says why:
///
/// ```text
/// redis ping: no connection to Redis in time: TLS: invalid peer certificate: UnknownIssuer
/// redis ping: no connection to Redis in time: Connection refused (os error 111)
/// redis acquire: Redis answered with an error (NOPERM): this user has no permissions to run the 'evalsha' command
/// ```
///
/// A check-out from the pool that ran out of time carries the error of the pool's last
/// failed connect, if there was one since the last that succeeded. (A printer of error
/// chains, such as anyhow's `{:#}`, shows the cause twice: in the message and as the
/// source.)
#[derive(Debug, Clone)]
pub struct StoreError {
    operation: Operation,
    kind: StoreErrorKind,
    source: Option<redis::RedisError>,
}

impl StoreError {
    pub(crate) fn new(
        operation: Operation,
        kind: StoreErrorKind,
        source: Option<redis::RedisError>,
    ) -> Self {
        Self {
            operation,
            kind,
            source,
        }
    }

    /// Sorts a redis-rs error into a kind.
    pub(crate) fn from_redis(operation: Operation, error: redis::RedisError) -> Self {
        let error = without_echo(error);
        let kind = if error.is_connection_refusal() {
            StoreErrorKind::NoConnection
        } else if error.is_timeout() {
            StoreErrorKind::Timeout
        } else if error.is_io_error() || error.is_connection_dropped() {
            StoreErrorKind::ConnectionLost
        } else if error.code().is_some() {
            StoreErrorKind::Server
        } else {
            StoreErrorKind::Response
        };
        Self::new(operation, kind, Some(error))
    }

    /// What was being done.
    pub fn operation(&self) -> Operation {
        self.operation
    }

    /// How it failed.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// The error code of an error reply (`READONLY`, `OOM`, `NOSCRIPT`, ...).
    pub fn server_code(&self) -> Option<&str> {
        self.source.as_ref().and_then(|e| e.code())
    }

    /// Whether Redis may have run the command: true for timeouts and connections lost
    /// in flight. A caller must then assume the worst of both worlds: that the command
    /// did not take effect *and* that it may have.
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self.kind,
            StoreErrorKind::Timeout | StoreErrorKind::ConnectionLost
        )
    }

    /// Whether it says Redis cannot be reached or understood (what opens the breaker),
    /// as opposed to Redis answering with an error.
    pub(crate) fn counts_against_redis(&self) -> bool {
        matches!(
            self.kind,
            StoreErrorKind::NoConnection
                | StoreErrorKind::Timeout
                | StoreErrorKind::ConnectionLost
                | StoreErrorKind::Response
        )
    }

    /// Whether the connection it happened on should be thrown away.
    pub(crate) fn breaks_connection(&self) -> bool {
        matches!(
            self.kind,
            StoreErrorKind::Timeout | StoreErrorKind::ConnectionLost | StoreErrorKind::NoConnection
        ) || self
            .source
            .as_ref()
            .is_some_and(redis::RedisError::is_unrecoverable_error)
    }
}

/// Says why, after what failed: the error reply's code and text, or the cause of a
/// failed connection as redis-rs and rustls give it (a refused port, a name that did not
/// resolve, a certificate refused, a wrong password), so that the message alone is
/// enough to act on.
impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "redis {}: {}", self.operation, self.kind)?;
        let Some(source) = &self.source else {
            return Ok(());
        };
        match (source.code(), source.detail()) {
            (Some(code), Some(detail)) => write!(f, " ({code}): {detail}"),
            (Some(code), None) => write!(f, " ({code})"),
            _ if is_tls(source) => write!(f, ": TLS: {source}"),
            _ => write!(f, ": {source}"),
        }
    }
}

/// Redis echoes the start of a command it does not know, and a command's arguments may
/// hold a password (`HELLO 3 AUTH user password` to a server that has no `HELLO`): an
/// error reply that echoes is kept without what it echoes, in the message and in the
/// source (which anything printing the error's chain, or its `Debug`, shows).
fn without_echo(error: redis::RedisError) -> redis::RedisError {
    let (Some(code), Some(detail)) = (error.code(), error.detail()) else {
        return error;
    };
    let Some(echo) = detail.find("with args beginning with") else {
        return error;
    };
    let reply = format!("-{code} {}(arguments left out)\r\n", &detail[..echo]);
    match redis::parse_redis_value(reply.as_bytes()).map(redis::Value::extract_error) {
        Ok(Err(redacted)) => redacted,
        // Cannot be (the reply is an error): nothing rather than the arguments.
        _ => redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "an error reply",
        )),
    }
}

/// Whether an error comes from the TLS handshake: rustls' error inside an I/O error,
/// which redis-rs keeps behind an `Arc`.
#[cfg(feature = "tls")]
fn is_tls(error: &redis::RedisError) -> bool {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    let is_rustls = |error: &(dyn std::error::Error + 'static)| {
        error.is::<rustls::Error>()
            || error
                .downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                .is_some_and(|inner| inner.is::<rustls::Error>())
    };
    let mut source = std::error::Error::source(error);
    while let Some(error) = source {
        let shared = error.downcast_ref::<Shared>().map(|shared| &**shared as _);
        if is_rustls(error) || shared.is_some_and(is_rustls) {
            return true;
        }
        source = error.source();
    }
    false
}

/// Without TLS, nothing comes from a handshake.
#[cfg(not(feature = "tls"))]
fn is_tls(_: &redis::RedisError) -> bool {
    false
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error reply's text is in the message, but not the arguments Redis echoes.
    #[test]
    fn an_error_reply_says_why_without_the_arguments_redis_echoes() {
        // As Redis sends it, and redis-rs reads it.
        let reply = |text: &str| {
            let value = redis::parse_redis_value(format!("-{text}\r\n").as_bytes()).unwrap();
            let error = value.extract_error().unwrap_err();
            StoreError::from_redis(Operation::Ping, error).to_string()
        };
        let noperm = reply("NOPERM this user has no permissions to run the 'ping' command");
        assert_eq!(
            noperm,
            "redis ping: Redis answered with an error (NOPERM): this user has no permissions \
             to run the 'ping' command"
        );
        let echoed =
            "ERR unknown command 'HELLO', with args beginning with: '3' 'AUTH' 'u' 'secret-pw'";
        let unknown = reply(echoed);
        assert!(!unknown.contains("secret-pw"), "{unknown}");
        assert!(unknown.contains("unknown command"), "{unknown}");
        assert!(unknown.ends_with("(arguments left out)"), "{unknown}");
        // Nor in its source, nor in its `Debug`.
        let value = redis::parse_redis_value(format!("-{echoed}\r\n").as_bytes()).unwrap();
        let error = StoreError::from_redis(Operation::Ping, value.extract_error().unwrap_err());
        let source = std::error::Error::source(&error).unwrap().to_string();
        assert!(
            !source.contains("secret-pw") && source.contains("HELLO"),
            "{source}"
        );
        assert!(!format!("{error:?}").contains("secret-pw"), "{error:?}");
        assert_eq!(error.server_code(), Some("ERR"));
    }

    /// `ALL` lists every variant once, in order. A new variant fails to compile in the
    /// matches below: give it the next number, and put it in `ALL`.
    #[test]
    fn every_operation_and_kind_is_listed() {
        let operation = |op: Operation| match op {
            Operation::Acquire => 0,
            Operation::Renew => 1,
            Operation::Release => 2,
            Operation::Ping => 3,
            Operation::Read => 4,
            Operation::Write => 5,
            Operation::Invalidate => 6,
            Operation::Subscribe => 7,
            Operation::Publish => 8,
            Operation::Inspect => 9,
        };
        let kind = |kind: StoreErrorKind| match kind {
            StoreErrorKind::NoConnection => 0,
            StoreErrorKind::Timeout => 1,
            StoreErrorKind::ConnectionLost => 2,
            StoreErrorKind::Server => 3,
            StoreErrorKind::Response => 4,
            StoreErrorKind::CircuitOpen => 5,
        };
        let numbered: Vec<usize> = Operation::ALL.into_iter().map(operation).collect();
        assert_eq!(numbered, (0..10).collect::<Vec<_>>());
        let numbered: Vec<usize> = StoreErrorKind::ALL.into_iter().map(kind).collect();
        assert_eq!(numbered, (0..6).collect::<Vec<_>>());
    }
}
