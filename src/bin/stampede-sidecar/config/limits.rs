//! The limits section: the client side (connections, their timeouts, TLS termination)
//! and the origin's (its timeouts, HTTP/2, its authority, `Via`, the trusted proxies).
//! Each setting is the flag's value, else the file's, else the default.

use std::time::Duration;

use http::Uri;

use super::defaults;
use super::file::File;
use super::place::{Place, SettingError};
use crate::args::Args;
use crate::server::{Limits, Tls};
use crate::upstream::{Cidr, Origin};

/// A timeout: the flag's, else the file's, else `default`; never zero.
fn timeout(
    top: &Place<'_>,
    field: &str,
    flag: Option<Duration>,
    text: &Option<String>,
    default: Duration,
) -> Result<Duration, SettingError> {
    let value = match flag {
        Some(d) => d,
        None => top.duration(field, text)?.unwrap_or(default),
    };
    if value.is_zero() {
        return Err(top.error(field, "must be more than 0s"));
    }
    Ok(value)
}

/// The client side's limits.
pub(super) fn limits(args: &Args, file: &File, top: &Place<'_>) -> Result<Limits, SettingError> {
    let max_connections = args
        .max_connections
        .or(file.max_connections)
        .unwrap_or(defaults::MAX_CONNECTIONS);
    if max_connections == 0 {
        return Err(top.error("max_connections", "must be at least 1"));
    }
    let tls = match (
        args.tls_cert.clone().or(file.tls_cert.clone()),
        args.tls_key.clone().or(file.tls_key.clone()),
    ) {
        (Some(cert), Some(key)) => Some(Tls { cert, key }),
        (None, None) => None,
        (Some(_), None) => return Err(top.error("tls_key", "is needed with tls_cert")),
        (None, Some(_)) => return Err(top.error("tls_cert", "is needed with tls_key")),
    };
    Ok(Limits {
        max_connections,
        header_read: timeout(
            top,
            "header_read_timeout",
            args.header_read_timeout,
            &file.header_read_timeout,
            defaults::HEADER_READ_TIMEOUT,
        )?,
        keep_alive: timeout(
            top,
            "keep_alive_timeout",
            args.keep_alive_timeout,
            &file.keep_alive_timeout,
            defaults::KEEP_ALIVE_TIMEOUT,
        )?,
        body_read: timeout(
            top,
            "request_body_timeout",
            args.request_body_timeout,
            &file.request_body_timeout,
            defaults::REQUEST_BODY_TIMEOUT,
        )?,
        send: timeout(
            top,
            "send_timeout",
            args.send_timeout,
            &file.send_timeout,
            defaults::SEND_TIMEOUT,
        )?,
        tls,
    })
}

/// How the origin at `upstream` is spoken to.
pub(super) fn origin(
    args: &Args,
    file: &File,
    top: &Place<'_>,
    upstream: &Uri,
) -> Result<Origin, SettingError> {
    let trusted_proxies = if args.trusted_proxies.is_empty() {
        file.trusted_proxies.clone().unwrap_or_default()
    } else {
        args.trusted_proxies.clone()
    }
    .iter()
    .map(|text| Cidr::parse(text).map_err(|e| top.error("trusted_proxies", e)))
    .collect::<Result<Vec<_>, _>>()?;
    let ca = args.upstream_ca.clone().or(file.upstream_ca.clone());
    if ca.is_some() && upstream.scheme_str() != Some("https") {
        return Err(top.error("upstream_ca", "is for an https:// upstream"));
    }
    Ok(Origin {
        uri: upstream.clone(),
        connect: timeout(
            top,
            "connect_timeout",
            args.connect_timeout,
            &file.connect_timeout,
            defaults::CONNECT_TIMEOUT,
        )?,
        response: timeout(
            top,
            "response_timeout",
            args.response_timeout,
            &file.response_timeout,
            defaults::RESPONSE_TIMEOUT,
        )?,
        idle: timeout(
            top,
            "upstream_idle_timeout",
            args.upstream_idle_timeout,
            &file.upstream_idle_timeout,
            defaults::UPSTREAM_IDLE_TIMEOUT,
        )?,
        http2: args.upstream_http2.or(file.upstream_http2).unwrap_or(false),
        ca,
        via: via(args, file, top)?,
        trusted_proxies,
    })
}

/// The name in `Via`: the flag's, else the file's, else the default; `""` for none.
fn via(args: &Args, file: &File, top: &Place<'_>) -> Result<Option<String>, SettingError> {
    match args.via.clone().or(file.via.clone()) {
        None => Ok(Some(defaults::VIA.to_owned())),
        Some(name) if name.is_empty() => Ok(None),
        Some(name) if name.bytes().all(is_tchar) => Ok(Some(name)),
        Some(name) => Err(top.error(
            "via",
            format!("`{name}` is not a token (letters, digits and !#$%&'*+-.^_`|~)"),
        )),
    }
}

/// A character of an HTTP token (RFC 9110 §5.6.2): what `Via` takes as a proxy's name.
fn is_tchar(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}
