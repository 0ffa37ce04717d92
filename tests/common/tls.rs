//! Certificates made for a test, and TLS clients that trust them.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, ServerName};

/// A test certificate authority.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pub pem: String,
    pub der: CertificateDer<'static>,
}

/// A leaf certificate and its key, as PEM.
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
    pub der: CertificateDer<'static>,
}

impl Ca {
    pub fn new() -> Ca {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "sentinel test CA");
        let cert = params.self_signed(&key).expect("CA certificate");
        Ca {
            pem: cert.pem(),
            der: cert.der().clone(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A certificate for these DNS names, signed by this CA.
    pub fn leaf(&self, names: &[&str]) -> Leaf {
        self.leaf_until(names, None)
    }

    /// [`Ca::leaf`], valid until the end of `year` (rcgen's default end without).
    pub fn leaf_until(&self, names: &[&str], year: Option<i32>) -> Leaf {
        let key = KeyPair::generate().expect("leaf key");
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("leaf params");
        if let Some(year) = year {
            params.not_after = rcgen::date_time_ymd(year, 12, 31);
        }
        params
            .distinguished_name
            .push(DnType::CommonName, names.first().copied().unwrap_or("leaf"));
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("leaf certificate");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
        }
    }

    /// A rustls client config trusting this CA, offering h2 and http/1.1.
    pub fn client_config(
        &self,
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> rustls::ClientConfig {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.der.clone()).expect("CA into the roots");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        config
    }

    /// A reqwest client that trusts this CA and sends `names` to `port` on loopback.
    pub fn http_client(&self, port: u16, names: &[&str], http1_only: bool) -> reqwest::Client {
        let mut config = self.client_config(rustls::ALL_VERSIONS);
        if http1_only {
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
        }
        let mut builder = super::client_builder()
            .tls_backend_preconfigured(config)
            .timeout(std::time::Duration::from_secs(10));
        for n in names {
            builder = builder.resolve(n, ([127, 0, 0, 1], port).into());
        }
        builder.build().expect("TLS client")
    }
}

impl Leaf {
    /// Writes `<stem>.pem` and `<stem>.key` into `dir`; returns their paths.
    pub fn write(&self, dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{stem}.pem"));
        let key = dir.join(format!("{stem}.key"));
        std::fs::write(&cert, &self.cert_pem).expect("write cert");
        std::fs::write(&key, &self.key_pem).expect("write key");
        (cert, key)
    }
}

/// One TLS connection held open by the test, speaking HTTP/1.1.
pub struct Conn {
    tls: rustls::StreamOwned<rustls::ClientConnection, TcpStream>,
}

impl Conn {
    /// Connects to `port` on loopback sending `sni`; `Err` when the handshake fails.
    pub fn open(config: rustls::ClientConfig, port: u16, sni: &str) -> Result<Conn, String> {
        let name = ServerName::try_from(sni.to_owned()).map_err(|e| e.to_string())?;
        let conn =
            rustls::ClientConnection::new(Arc::new(config), name).map_err(|e| e.to_string())?;
        let tcp = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
        tcp.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .ok();
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        while tls.conn.is_handshaking() {
            tls.conn
                .complete_io(&mut tls.sock)
                .map_err(|e| e.to_string())?;
        }
        Ok(Conn { tls })
    }

    /// The certificate the gateway served.
    pub fn served(&self) -> CertificateDer<'static> {
        self.tls.conn.peer_certificates().expect("a certificate")[0].clone()
    }

    /// Sends `bytes` as they are and reads the answer to the connection's end.
    pub fn raw(&mut self, bytes: &[u8]) -> String {
        self.tls.write_all(bytes).expect("send");
        let mut answer = Vec::new();
        let _ = self.tls.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    }

    /// Whether the handshake resumed a session the client kept.
    pub fn resumed(&self) -> bool {
        self.tls.conn.handshake_kind() == Some(rustls::HandshakeKind::Resumed)
    }

    pub fn alpn(&self) -> Option<Vec<u8>> {
        self.tls.conn.alpn_protocol().map(<[u8]>::to_vec)
    }

    pub fn version(&self) -> Option<rustls::ProtocolVersion> {
        self.tls.conn.protocol_version()
    }

    /// How long until the gateway closes this connection, sending nothing meanwhile
    /// (whatever it writes is read and dropped).
    pub fn closed_after(&mut self) -> std::time::Duration {
        let start = std::time::Instant::now();
        let mut buf = [0u8; 512];
        while let Ok(n) = self.tls.read(&mut buf) {
            if n == 0 {
                break;
            }
        }
        start.elapsed()
    }

    /// `GET path` on this connection (keep-alive); the status.
    pub fn get(&mut self, host: &str, path: &str) -> u16 {
        let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n");
        self.tls.write_all(request.as_bytes()).expect("send");
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            let n = self.tls.read(&mut byte).expect("read the answer");
            assert!(n > 0, "connection closed before the answer");
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).to_string();
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .unwrap_or(0);
        let mut body = vec![0u8; length];
        self.tls.read_exact(&mut body).expect("read the body");
        head.split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("a status")
    }
}
