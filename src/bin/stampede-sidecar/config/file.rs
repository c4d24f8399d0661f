//! The config file (TOML) as it is written: its top level, its `[[routes]]` tables, and
//! the errors serde reports, with the route they fall in.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::place::SettingError;
use crate::access::Format;

/// Declares a struct of the file with its own fields and the policy fields that both the
/// top level and each route take (serde's `flatten` would lose `deny_unknown_fields`).
macro_rules! with_policy_fields {
    ($(#[$meta:meta])* struct $name:ident { $($(#[$fmeta:meta])* $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        pub(super) struct $name {
            $($(#[$fmeta])* pub(super) $field: $ty,)*
            fresh: Option<String>,
            grace: Option<String>,
            lease: Option<String>,
            cold_wait: Option<String>,
            cold_miss: Option<ColdMissFile>,
            key_query: Option<KeyQueryFile>,
            key_headers: Option<Vec<String>>,
            stale_if_error: Option<String>,
            max_body: Option<SizeFile>,
            follow_origin: Option<bool>,
            invalidate_on_unsafe: Option<bool>,
            min_fresh: Option<String>,
            max_fresh: Option<String>,
            keep: Option<String>,
            eager_refresh: Option<f64>,
            xfetch: Option<f64>,
        }

        impl $name {
            pub(super) fn policy_text(&self) -> PolicyText {
                PolicyText {
                    fresh: self.fresh.clone(),
                    grace: self.grace.clone(),
                    lease: self.lease.clone(),
                    cold_wait: self.cold_wait.clone(),
                    cold_miss: self.cold_miss.clone(),
                    key_query: self.key_query.clone(),
                    key_headers: self.key_headers.clone(),
                    stale_if_error: self.stale_if_error.clone(),
                    max_body: self.max_body.clone(),
                    follow_origin: self.follow_origin,
                    invalidate_on_unsafe: self.invalidate_on_unsafe,
                    min_fresh: self.min_fresh.clone(),
                    max_fresh: self.max_fresh.clone(),
                    keep: self.keep.clone(),
                    eager_refresh: self.eager_refresh,
                    xfetch: self.xfetch,
                }
            }
        }
    };
}

with_policy_fields! {
    /// The file's top level: the sidecar's settings and the policy of requests that
    /// match no route (which routes start from).
    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    struct File {
        listen: Option<SocketAddr>,
        upstream: Option<String>,
        redis: Option<String>,
        redis_cluster: Option<Vec<String>>,
        redis_sentinels: Option<Vec<String>>,
        redis_sentinel_service: Option<String>,
        redis_ca: Option<PathBuf>,
        redis_client_cert: Option<PathBuf>,
        redis_client_key: Option<PathBuf>,
        redis_username: Option<String>,
        metrics: Option<SocketAddr>,
        admin: Option<SocketAddr>,
        admin_token: Option<String>,
        via: Option<String>,
        trusted_proxies: Option<Vec<String>>,
        drain_timeout: Option<String>,
        workers: Option<usize>,
        max_connections: Option<usize>,
        header_read_timeout: Option<String>,
        keep_alive_timeout: Option<String>,
        request_body_timeout: Option<String>,
        send_timeout: Option<String>,
        connect_timeout: Option<String>,
        response_timeout: Option<String>,
        upstream_idle_timeout: Option<String>,
        upstream_http2: Option<bool>,
        upstream_ca: Option<PathBuf>,
        access_log: Option<Format>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        env: Option<String>,
        service: Option<String>,
        secret_file: Option<PathBuf>,
        l1_capacity: Option<u64>,
        refresh_budget: Option<usize>,
        fill_memory: Option<SizeFile>,
        default: Option<Unrouted>,
        #[serde(default)]
        routes: Vec<RouteFile>,
    }
}

with_policy_fields! {
    /// One `[[routes]]` table.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct RouteFile {
        name: String,
        prefix: String,
    }
}

/// The policy fields as the file spells them, each unset where the file leaves it out.
#[derive(Clone, Default)]
pub(super) struct PolicyText {
    pub(super) fresh: Option<String>,
    pub(super) grace: Option<String>,
    pub(super) lease: Option<String>,
    pub(super) cold_wait: Option<String>,
    pub(super) cold_miss: Option<ColdMissFile>,
    pub(super) key_query: Option<KeyQueryFile>,
    pub(super) key_headers: Option<Vec<String>>,
    pub(super) stale_if_error: Option<String>,
    pub(super) max_body: Option<SizeFile>,
    pub(super) follow_origin: Option<bool>,
    pub(super) invalidate_on_unsafe: Option<bool>,
    pub(super) min_fresh: Option<String>,
    pub(super) max_fresh: Option<String>,
    pub(super) keep: Option<String>,
    pub(super) eager_refresh: Option<f64>,
    pub(super) xfetch: Option<f64>,
}

/// A size in the file: a number of bytes (`max_body = 1048576`), or text with its unit
/// (`max_body = "16MiB"`), as durations take `"1s"`.
#[derive(Deserialize, Clone)]
#[serde(untagged)]
pub(super) enum SizeFile {
    Bytes(u64),
    Text(String),
}

impl SizeFile {
    /// The bytes it says, or why it says none.
    pub(super) fn bytes(&self) -> Result<u64, String> {
        match self {
            Self::Bytes(bytes) => Ok(*bytes),
            Self::Text(text) => crate::args::size(text),
        }
    }
}

/// `cold_miss = "passthrough"` or `cold_miss = { reject = { retry_after = "2s" } }`.
#[derive(Deserialize, Clone)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub(super) enum ColdMissFile {
    Passthrough,
    Reject { retry_after: String },
}

/// `key_query = ["page", "sort"]`, `"all"`, `"ignore"` or `{ drop = ["utm_*"] }`.
#[derive(Deserialize, Clone)]
#[serde(untagged)]
pub(super) enum KeyQueryFile {
    Only(Vec<String>),
    Mode(String),
    Drop(DropQueryFile),
}

/// `key_query = { drop = ["utm_*", "fbclid"] }`: parameters left out of the key.
#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub(super) struct DropQueryFile {
    pub(super) drop: Vec<String>,
}

/// What requests that match no route get: `default = "cache"` (the top-level policy) or
/// `default = "pass"` (forwarded uncached).
#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Unrouted {
    Cache,
    Pass,
}

/// Reads and parses the file at `path`.
pub(super) fn read(path: &Path) -> Result<File, SettingError> {
    let text = std::fs::read_to_string(path).map_err(|e| SettingError {
        file: Some(path.to_path_buf()),
        route: None,
        field: None,
        message: format!("cannot be read: {e}"),
    })?;
    parse(&text, path)
}

/// Parses the file, naming the route an error is in when it is in one.
pub(super) fn parse(text: &str, path: &Path) -> Result<File, SettingError> {
    toml::from_str(text).map_err(|error| {
        let route = error.span().and_then(|span| route_at(text, span.start));
        SettingError {
            file: Some(path.to_path_buf()),
            route,
            field: None,
            message: error.to_string().trim_end().to_owned(),
        }
    })
}

/// The `[[routes]]` table that byte `at` of `text` falls in (by name where the table
/// has a plain `name = "…"` line), for errors that serde reports without one.
fn route_at(text: &str, at: usize) -> Option<String> {
    let before = &text[..at.min(text.len())];
    let mut seen = 0;
    // The route the line is in: its place in the list and where its table starts.
    let mut current = None;
    let mut offset = 0;
    for line in before.split_inclusive('\n') {
        let header = line.trim();
        if header == "[[routes]]" {
            current = Some((seen, offset));
            seen += 1;
        } else if header.starts_with('[') && !header.starts_with("[routes.") {
            current = None;
        }
        offset += line.len();
    }
    let (i, start) = current?;
    let name = text[start..]
        .lines()
        .skip(1)
        .take_while(|l| !l.trim().starts_with("[["))
        .find_map(|l| {
            let (key, value) = l.split_once('=')?;
            (key.trim() == "name").then(|| value.trim().trim_matches('"').to_owned())
        });
    Some(match name {
        Some(name) => format!("\"{name}\" (routes[{i}])"),
        None => format!("routes[{i}]"),
    })
}
