//! The Redis section: which backend (one server, a Cluster, Sentinel's primary, or
//! none), its TLS files and ACL user. A backend given by flags replaces the file's.

use std::fmt;
use std::path::PathBuf;

use super::file::File;
use super::place::{Place, SettingError};
use crate::args::{Args, redacted};

/// The fleet's Redis, if any, and how to reach it. The password is not here: it comes
/// from `STAMPEDE_SIDECAR_REDIS_PASSWORD` or the URLs, when the store is built.
pub(crate) struct Redis {
    pub(crate) backend: Backend,
    pub(crate) ca: Option<PathBuf>,
    pub(crate) client_cert: Option<PathBuf>,
    pub(crate) client_key: Option<PathBuf>,
    pub(crate) username: Option<String>,
}

/// Which Redis.
pub(crate) enum Backend {
    /// None: the local cache only.
    Local,
    /// One server (`redis`).
    Single(String),
    /// A Redis Cluster, by some of its nodes (`redis_cluster`).
    Cluster(Vec<String>),
    /// The primary the sentinels watch under `service` (`redis_sentinels`,
    /// `redis_sentinel_service`).
    Sentinel {
        sentinels: Vec<String>,
        service: String,
    },
}

impl Backend {
    /// Whether a fleet shares it (and so needs a shared secret).
    pub(crate) fn is_shared(&self) -> bool {
        !matches!(self, Self::Local)
    }
}

/// Says which backend, without a password: for `--check`, the start line and `Debug`.
impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |urls: &[String]| {
            urls.iter()
                .map(|u| redacted(u))
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            Self::Local => f.write_str("the local cache only"),
            Self::Single(url) => write!(f, "Redis at {}", redacted(url)),
            Self::Cluster(nodes) => write!(f, "Redis Cluster from {}", list(nodes)),
            Self::Sentinel { sentinels, service } => {
                write!(
                    f,
                    "Redis Sentinel service {service} from {}",
                    list(sentinels)
                )
            }
        }
    }
}

impl fmt::Debug for Redis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redis")
            .field("backend", &self.backend.to_string())
            .field("ca", &self.ca)
            .field("client_cert", &self.client_cert)
            .field("client_key", &self.client_key)
            .field("username", &self.username)
            .finish()
    }
}

/// The Redis settings: a backend given by flags replaces the file's; one backend at
/// most; the TLS files and the user from the flags, else the file.
pub(super) fn redis(args: &Args, file: &File, top: &Place<'_>) -> Result<Redis, SettingError> {
    let redis = Redis {
        backend: backend(args, file, top)?,
        ca: args.redis_ca.clone().or(file.redis_ca.clone()),
        client_cert: args
            .redis_client_cert
            .clone()
            .or(file.redis_client_cert.clone()),
        client_key: args
            .redis_client_key
            .clone()
            .or(file.redis_client_key.clone()),
        username: args.redis_username.clone().or(file.redis_username.clone()),
    };
    if redis.client_cert.is_some() != redis.client_key.is_some() {
        let missing = if redis.client_cert.is_some() {
            "redis_client_key"
        } else {
            "redis_client_cert"
        };
        return Err(top.error(
            missing,
            "redis_client_cert and redis_client_key go together",
        ));
    }
    if !redis.backend.is_shared()
        && let Some(field) = [
            ("redis_ca", redis.ca.is_some()),
            ("redis_client_cert", redis.client_cert.is_some()),
            ("redis_username", redis.username.is_some()),
        ]
        .iter()
        .find_map(|(field, set)| set.then_some(*field))
    {
        return Err(top.error(field, "is set, but no Redis is"));
    }
    Ok(redis)
}

/// Which backend: the flags' if they name one, else the file's; one at most.
fn backend(args: &Args, file: &File, top: &Place<'_>) -> Result<Backend, SettingError> {
    let flags =
        !(args.redis.is_none() && args.redis_cluster.is_empty() && args.redis_sentinels.is_empty());
    let (single, cluster, sentinels, service) = if flags {
        (
            args.redis.clone(),
            args.redis_cluster.clone(),
            args.redis_sentinels.clone(),
            args.redis_sentinel_service.clone(),
        )
    } else {
        (
            file.redis.clone(),
            file.redis_cluster.clone().unwrap_or_default(),
            file.redis_sentinels.clone().unwrap_or_default(),
            args.redis_sentinel_service
                .clone()
                .or(file.redis_sentinel_service.clone()),
        )
    };
    match (single, cluster.is_empty(), sentinels.is_empty()) {
        (None, true, true) => match service {
            Some(_) => Err(top.error(
                "redis_sentinel_service",
                "is for redis_sentinels, and none is set",
            )),
            None => Ok(Backend::Local),
        },
        (Some(url), true, true) => Ok(Backend::Single(url)),
        (None, false, true) => Ok(Backend::Cluster(cluster)),
        (None, true, false) => Ok(Backend::Sentinel {
            sentinels,
            service: service.ok_or_else(|| {
                top.error(
                    "redis_sentinel_service",
                    "is needed with redis_sentinels: the name they watch the primary under",
                )
            })?,
        }),
        _ => Err(top.error(
            "redis",
            "give one of redis, redis_cluster and redis_sentinels, not several",
        )),
    }
}
