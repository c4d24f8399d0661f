//! A real `redis-server` that speaks TLS, with certificates made for the test by
//! `openssl`: a certificate authority, a server certificate for 127.0.0.1 signed by it,
//! a client certificate signed by it, and a second, unrelated authority.

use std::path::Path;
use std::process::Command;

use tempfile::TempDir;

use super::server::{RedisServer, free_port};

pub(crate) struct TlsServer {
    /// The server; its plain port stays open for the test's own commands.
    pub(crate) server: RedisServer,
    pub(crate) tls_port: u16,
    /// The authority that signed the server's and the client's certificates (PEM).
    pub(crate) ca: Vec<u8>,
    /// An authority that signed nothing here (PEM).
    pub(crate) other_ca: Vec<u8>,
    pub(crate) client_cert: Vec<u8>,
    pub(crate) client_key: Vec<u8>,
    _dir: TempDir,
}

impl TlsServer {
    /// A server that asks every TLS client for a certificate signed by [`Self::ca`].
    pub(crate) fn start() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("stampede-guard-tls-")
            .tempdir()
            .expect("temporary directory for certificates");
        let d = dir.path();
        authority(d, "ca");
        authority(d, "other-ca");
        signed(
            d,
            "server",
            "127.0.0.1",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        );
        signed(
            d,
            "client",
            "stampede-guard-test-client",
            "extendedKeyUsage=clientAuth",
        );
        let path = |name: &str| d.join(name).to_str().unwrap().to_owned();
        let tls_port = free_port();
        let server = RedisServer::start_with(&[
            "--tls-port",
            &tls_port.to_string(),
            "--tls-cert-file",
            &path("server.crt"),
            "--tls-key-file",
            &path("server.key"),
            "--tls-ca-cert-file",
            &path("ca.crt"),
            "--tls-auth-clients",
            "yes",
        ]);
        let read = |name: &str| std::fs::read(d.join(name)).expect("a certificate file");
        Self {
            server,
            tls_port,
            ca: read("ca.crt"),
            other_ca: read("other-ca.crt"),
            client_cert: read("client.crt"),
            client_key: read("client.key"),
            _dir: dir,
        }
    }

    /// The server's `rediss://` URL.
    pub(crate) fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.tls_port)
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl: the TLS tests make their certificates with it");
    assert!(
        output.status.success(),
        "openssl {args:?} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A self-signed certificate authority, `{name}.crt` and `{name}.key`.
pub(crate) fn authority(dir: &Path, name: &str) {
    let (crt, key) = (format!("{name}.crt"), format!("{name}.key"));
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &key,
            "-out",
            &crt,
        ],
    );
}

/// `{name}.crt` and `{name}.key`, for `cn`, signed by `ca`, with the extension `ext`.
pub(crate) fn signed(dir: &Path, name: &str, cn: &str, ext: &str) {
    let (crt, key, csr, cnf) = (
        format!("{name}.crt"),
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.cnf"),
    );
    std::fs::write(dir.join(&cnf), format!("{ext}\n")).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            &format!("/CN={cn}"),
            "-keyout",
            &key,
            "-out",
            &csr,
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &cnf,
            "-out",
            &crt,
        ],
    );
}
