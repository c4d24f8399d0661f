//! A route's policy: its fields read once into their types (from the file, or from the
//! flags over the top level), merged by type (a route's own over the top level's), and
//! built into the guard's [`Policy`].

use std::time::Duration;

use stampede_guard::policy::PolicyBuilder;
use stampede_guard::{ColdMiss, KeyQuery, Policy};

use super::defaults;
use super::file::{ColdMissFile, KeyQueryFile, PolicyText, SizeFile};
use super::place::{Place, SettingError};
use crate::args::{self, Args};
use crate::upstream::KEYED_FORWARDING;

/// The per-route settings, once: each one's name in the file (and the flag's, with
/// dashes, where there is one) and the builder method of [`Policy`] it sets. The file's
/// fields, the refusals' field names and the guide's table come from this list.
pub(crate) const ROUTE_SETTINGS: [(&str, &str); 16] = [
    ("fresh", "fresh_ttl"),
    ("grace", "grace"),
    ("lease", "lease_ttl"),
    ("cold_wait", "cold_wait"),
    ("cold_miss", "cold_miss"),
    ("key_query", "key_query"),
    ("key_headers", "key_headers"),
    ("stale_if_error", "stale_if_error"),
    ("max_body", "max_body"),
    ("follow_origin", "follow_origin"),
    ("invalidate_on_unsafe", "invalidate_on_unsafe"),
    ("min_fresh", "min_fresh"),
    ("max_fresh", "max_fresh"),
    ("keep", "keep"),
    ("eager_refresh", "eager_refresh"),
    ("xfetch", "xfetch"),
];

/// A policy's fields, each unset where neither the file nor a flag sets it.
#[derive(Clone, Default)]
pub(super) struct PolicyFields {
    pub(super) fresh: Option<Duration>,
    grace: Option<Duration>,
    lease: Option<Duration>,
    cold_wait: Option<Duration>,
    cold_miss: Option<ColdMiss>,
    key_query: Option<KeyQuery>,
    key_headers: Option<Vec<String>>,
    stale_if_error: Option<Duration>,
    max_body: Option<usize>,
    follow_origin: Option<bool>,
    invalidate_on_unsafe: Option<bool>,
    min_fresh: Option<Duration>,
    max_fresh: Option<Duration>,
    keep: Option<Duration>,
    eager_refresh: Option<f64>,
    xfetch: Option<f64>,
}

impl PolicyFields {
    /// The fields the file sets at `place`, each checked as it is read.
    pub(super) fn read(text: &PolicyText, place: &Place<'_>) -> Result<Self, SettingError> {
        let duration = |field, text: &Option<String>| place.duration(field, text);
        Ok(Self {
            fresh: duration("fresh", &text.fresh)?,
            grace: duration("grace", &text.grace)?,
            lease: duration("lease", &text.lease)?,
            cold_wait: duration("cold_wait", &text.cold_wait)?,
            cold_miss: text
                .cold_miss
                .as_ref()
                .map(|c| cold_miss(c, place))
                .transpose()?,
            key_query: text
                .key_query
                .as_ref()
                .map(|k| key_query(k, place))
                .transpose()?,
            key_headers: text.key_headers.clone(),
            stale_if_error: duration("stale_if_error", &text.stale_if_error)?,
            max_body: text
                .max_body
                .as_ref()
                .map(|s| max_body(s, place))
                .transpose()?,
            follow_origin: text.follow_origin,
            invalidate_on_unsafe: text.invalidate_on_unsafe,
            min_fresh: duration("min_fresh", &text.min_fresh)?,
            max_fresh: duration("max_fresh", &text.max_fresh)?,
            keep: duration("keep", &text.keep)?,
            eager_refresh: text.eager_refresh,
            xfetch: text.xfetch,
        })
    }

    /// The fields the flags set (each parsed by the command line, once).
    pub(super) fn flags(args: &Args) -> Result<Self, SettingError> {
        let max_body = args
            .max_body
            .map(usize::try_from)
            .transpose()
            .map_err(|e| Place::top(None).error("max_body", e.to_string()))?;
        Ok(Self {
            fresh: args.fresh,
            grace: args.grace,
            lease: args.lease,
            cold_wait: args.cold_wait,
            max_body,
            follow_origin: args.follow_origin,
            ..Self::default()
        })
    }

    /// These fields, with `base`'s where these leave one unset.
    pub(super) fn or(self, base: &Self) -> Self {
        Self {
            fresh: self.fresh.or(base.fresh),
            grace: self.grace.or(base.grace),
            lease: self.lease.or(base.lease),
            cold_wait: self.cold_wait.or(base.cold_wait),
            cold_miss: self.cold_miss.or(base.cold_miss),
            key_query: self.key_query.or_else(|| base.key_query.clone()),
            key_headers: self.key_headers.or_else(|| base.key_headers.clone()),
            stale_if_error: self.stale_if_error.or(base.stale_if_error),
            max_body: self.max_body.or(base.max_body),
            follow_origin: self.follow_origin.or(base.follow_origin),
            invalidate_on_unsafe: self.invalidate_on_unsafe.or(base.invalidate_on_unsafe),
            min_fresh: self.min_fresh.or(base.min_fresh),
            max_fresh: self.max_fresh.or(base.max_fresh),
            keep: self.keep.or(base.keep),
            eager_refresh: self.eager_refresh.or(base.eager_refresh),
            xfetch: self.xfetch.or(base.xfetch),
        }
    }

    /// Whether a policy of these fields follows the origin (the sidecar's default).
    pub(super) fn follows(&self) -> bool {
        self.follow_origin.unwrap_or(true)
    }

    /// Whether the one-way `field` (`fresh`, `min_fresh`, `max_fresh`) is set here.
    pub(super) fn is_set(&self, field: &str) -> bool {
        match field {
            "fresh" => self.fresh.is_some(),
            "min_fresh" => self.min_fresh.is_some(),
            "max_fresh" => self.max_fresh.is_some(),
            _ => false,
        }
    }

    /// The policy of route `name`, refused at `place`.
    pub(super) fn build(&self, place: &Place<'_>, name: &str) -> Result<Policy, SettingError> {
        // An HTTP cache serves stale only when allowed: following the origin, that is
        // what its `stale-while-revalidate` says, unless a grace is set here (RFC 9111
        // §4.2.4's "configuration"); with a policy of its own, the stampede guard's grace.
        let grace = self.grace.unwrap_or(if self.follows() {
            Duration::ZERO
        } else {
            defaults::GRACE
        });
        let lease = self.lease.unwrap_or(defaults::LEASE);
        let mut builder = Policy::builder(name)
            .fresh_ttl(self.fresh.unwrap_or(defaults::FRESH))
            .grace(grace)
            .lease_ttl(lease)
            .refresh_timeout(lease)
            .cold_wait(self.cold_wait.unwrap_or(defaults::COLD_WAIT))
            .error_backoff(lease.min(Duration::from_secs(1)))
            // Every sidecar of the fleet fronts the same origin, under whatever host
            // name it is reached.
            .key_host(false)
            // An HTTP cache: it follows what the origin says unless told not to.
            .follow_origin(self.follows());
        if let Some(cold_miss) = self.cold_miss {
            builder = builder.cold_miss(cold_miss);
        }
        builder = match &self.key_query {
            None | Some(KeyQuery::All) => builder,
            Some(KeyQuery::Only(names)) => builder.key_query(names),
            Some(KeyQuery::Drop(patterns)) => builder.drop_query(patterns),
            Some(KeyQuery::Ignore) => builder.ignore_query(),
            Some(_) => builder,
        };
        // The scheme and host the client used, as vouched for, besides the route's own.
        let keyed = self.key_headers.iter().flatten().map(String::as_str);
        builder = builder.key_headers(keyed.chain(KEYED_FORWARDING));
        builder = self.optional(builder);
        builder
            .build()
            .map_err(|e| place.error(file_field(e.field()), e.to_string()))
    }

    /// The fields with no default of the sidecar's own: the guard's stands where unset.
    fn optional(&self, mut builder: PolicyBuilder) -> PolicyBuilder {
        if let Some(window) = self.stale_if_error {
            builder = builder.stale_if_error(window);
        }
        if let Some(bytes) = self.max_body {
            builder = builder.max_body(bytes);
        }
        // A successful unsafe request invalidates what it changed (RFC 9111 §4.4),
        // unless the route says not to: any client whose POST succeeds evicts its URI
        // for the fleet.
        if let Some(invalidate) = self.invalidate_on_unsafe {
            builder = builder.invalidate_on_unsafe(invalidate);
        }
        if let Some(floor) = self.min_fresh {
            builder = builder.min_fresh(floor);
        }
        if let Some(ceiling) = self.max_fresh {
            builder = builder.max_fresh(ceiling);
        }
        if let Some(window) = self.keep {
            builder = builder.keep(window);
        }
        if let Some(fraction) = self.eager_refresh {
            builder = builder.eager_refresh(fraction);
        }
        if let Some(beta) = self.xfetch {
            builder = builder.xfetch(beta);
        }
        builder
    }
}

/// `cold_miss`, as the file gives it.
fn cold_miss(file: &ColdMissFile, place: &Place<'_>) -> Result<ColdMiss, SettingError> {
    match file {
        ColdMissFile::Passthrough => Ok(ColdMiss::Passthrough),
        ColdMissFile::Reject { retry_after } => {
            let retry_after = args::duration(retry_after)
                .map_err(|e| place.error("cold_miss.reject.retry_after", e))?;
            Ok(ColdMiss::Reject { retry_after })
        }
    }
}

/// `key_query`, as the file gives it: a list of names, `"all"`, `"ignore"`, or the
/// parameters to drop (`{ drop = [...] }`).
fn key_query(file: &KeyQueryFile, place: &Place<'_>) -> Result<KeyQuery, SettingError> {
    match file {
        KeyQueryFile::Only(names) => Ok(KeyQuery::Only(names.clone())),
        KeyQueryFile::Drop(drop) => Ok(KeyQuery::Drop(drop.drop.clone())),
        KeyQueryFile::Mode(mode) => match mode.as_str() {
            "all" => Ok(KeyQuery::All),
            "ignore" => Ok(KeyQuery::Ignore),
            other => Err(place.error(
                "key_query",
                format!(
                    "`{other}`: write a list of names, \"all\", \"ignore\" or \
                     {{ drop = [\"utm_*\"] }}"
                ),
            )),
        },
    }
}

/// `max_body`, as the file gives it: bytes, or a size with its unit.
fn max_body(file: &SizeFile, place: &Place<'_>) -> Result<usize, SettingError> {
    file.bytes()
        .and_then(|bytes| usize::try_from(bytes).map_err(|e| e.to_string()))
        .map_err(|e| place.error("max_body", e))
}

/// The file's name for a field the crate names as its builder method does.
pub(super) fn file_field(field: &str) -> &str {
    match field {
        // The lease bounds the refresh and the back-off after an error.
        "refresh_timeout" | "error_backoff" | "watchdog" => "lease",
        "route" => "name",
        "drop_query" => "key_query",
        method => ROUTE_SETTINGS
            .iter()
            .find_map(|(file, m)| (*m == method).then_some(*file))
            .unwrap_or(method),
    }
}
