//! The TLS settings of a store, for `rediss://` URLs (feature `tls`).
//!
//! Without the feature the settings can still be written (code that sets them compiles
//! either way), but building a store refuses them, and a `rediss://` URL, naming the
//! feature: a connection in clear where TLS was asked for is never made quietly.

use crate::error::ConfigError;

/// The certificates redis-rs is given besides a URL.
#[cfg(feature = "tls")]
pub(super) use redis::TlsCertificates;

/// Without the feature there are none: a type with no value, so that the code that
/// passes certificates on is the same in both builds and never runs in this one.
#[cfg(not(feature = "tls"))]
#[derive(Clone)]
pub(super) enum TlsCertificates {}

/// The TLS settings of a builder.
#[derive(Default)]
pub(super) struct Tls {
    /// PEM root certificates to trust instead of the system's.
    pub(super) root: Option<Vec<u8>>,
    /// A PEM client certificate and its key, for servers that ask for one.
    pub(super) client: Option<(Vec<u8>, Vec<u8>)>,
    /// Certificates are not checked at all.
    pub(super) insecure: bool,
}

impl Tls {
    /// Whether any setting was given.
    pub(super) fn is_set(&self) -> bool {
        self.root.is_some() || self.client.is_some() || self.insecure
    }

    /// Refuses, naming the setting, a certificate or key that is not PEM: met here, not
    /// at the first connection.
    #[cfg(feature = "tls")]
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certificates =
            |field: &'static str, pem: &[u8]| match CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
            {
                Ok(found) if !found.is_empty() => Ok(()),
                Ok(_) => Err(ConfigError::invalid(field, "no PEM certificate in it")),
                Err(e) => Err(ConfigError::invalid(field, format!("not PEM: {e}"))),
            };
        if let Some(root) = &self.root {
            certificates("tls_root_certificate", root)?;
        }
        if let Some((certificate, key)) = &self.client {
            certificates("tls_client_certificate", certificate)?;
            PrivateKeyDer::from_pem_slice(key).map_err(|e| {
                ConfigError::invalid(
                    "tls_client_certificate",
                    format!("its key is not a PEM private key: {e}"),
                )
            })?;
        }
        Ok(())
    }

    /// Refuses every setting, naming it and the feature that would take it.
    #[cfg(not(feature = "tls"))]
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        let given = [
            ("tls_root_certificate", self.root.is_some()),
            ("tls_client_certificate", self.client.is_some()),
            ("danger_accept_invalid_certificates", self.insecure),
        ];
        match given.into_iter().find(|(_, set)| *set) {
            Some((field, _)) => Err(ConfigError::invalid(field, NEEDS_FEATURE)),
            None => Ok(()),
        }
    }

    /// What redis-rs is given besides the URL, if anything.
    #[cfg(feature = "tls")]
    pub(super) fn certificates(&self) -> Option<TlsCertificates> {
        if self.root.is_none() && self.client.is_none() {
            return None;
        }
        Some(TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.root.clone(),
        })
    }

    /// Nothing: [`check`](Self::check) refused every setting.
    #[cfg(not(feature = "tls"))]
    #[allow(clippy::unused_self)] // the same call as with the feature
    pub(super) fn certificates(&self) -> Option<TlsCertificates> {
        None
    }
}

/// Why a TLS setting or a `rediss://` URL is refused by a build without TLS.
pub(super) const NEEDS_FEATURE: &str =
    "needs the `tls` feature of stampede-guard (a default feature), off in this build";

/// A client for `info`, with `certificates` if any.
pub(super) fn client(
    info: redis::ConnectionInfo,
    certificates: Option<TlsCertificates>,
) -> redis::RedisResult<redis::Client> {
    match certificates {
        #[cfg(feature = "tls")]
        Some(certificates) => redis::Client::build_with_tls(info, certificates),
        #[cfg(not(feature = "tls"))]
        Some(none) => match none {},
        None => redis::Client::open(info),
    }
}
