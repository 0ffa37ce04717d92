//! The certificates of the TLS listeners (`[[server.tls]]`): read, checked and held ready
//! for the handshake.
//!
//! A pair is read whole at validation, so `check`, start and reload all refuse the same
//! files, and a reload that fails keeps the pairs already serving.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

/// One TLS listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsListener {
    pub listen: SocketAddr,
    pub min_version: TlsVersion,
    /// Served when no SNI name matches, or the client sends none.
    pub default: CertPair,
    /// Further certificates, chosen by the client's SNI name.
    pub sni: Vec<SniCert>,
}

impl TlsListener {
    /// Each certificate this listener serves, by file, with the end of its validity (Unix
    /// seconds).
    pub fn expiries(&self) -> impl Iterator<Item = (&str, i64)> {
        std::iter::once(&self.default)
            .chain(self.sni.iter().map(|s| &s.pair))
            .map(|p| (p.cert_written.as_str(), p.not_after))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsVersion {
    V1_2,
    V1_3,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SniCert {
    pub server_names: Vec<ServerName>,
    pub pair: CertPair,
}

/// A name a certificate is served for: exact, or `*.` and one label.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ServerName {
    Exact(String),
    /// `*.example.com`, held as `example.com`.
    Wildcard(String),
}

impl ServerName {
    /// Parses a `server_names` entry; names are case-insensitive and kept in lower case, and
    /// a fully qualified name's trailing dot is dropped (as a route's `host` and the client's
    /// SNI name are read).
    pub fn parse(text: &str) -> Result<Self, String> {
        let lower = text.to_ascii_lowercase();
        let lower = lower.strip_suffix('.').unwrap_or(&lower).to_owned();
        let (wildcard, host) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, lower.as_str()),
        };
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        // A name's last label is never all digits (RFC 1123, 2.1): such an entry is an IPv4
        // address, which no client sends as its server name (RFC 6066, 3).
        if host
            .rsplit('.')
            .next()
            .is_some_and(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()))
        {
            return Err(format!(
                "\"{text}\" is an IP address, and an IP address is never a TLS server name (RFC 6066): a client connecting by address sends none and is served the listener's own `cert_path`"
            ));
        }
        if host.is_empty() || host.len() > 253 || !host.split('.').all(label_ok) {
            return Err(format!(
                "\"{text}\" is not a host name: write a name such as \"api.example.com\", or \"*.example.com\" for every name one label below it"
            ));
        }
        Ok(if wildcard {
            Self::Wildcard(host.to_owned())
        } else {
            Self::Exact(host.to_owned())
        })
    }
}

impl ServerName {
    /// Whether a certificate naming `names` (its DNS names, lower case; `*.` and one label
    /// for a wildcard) answers for this name as a client checks it: a name by itself or by
    /// the wildcard one label above it, a wildcard by the same wildcard.
    pub fn covered_by(&self, names: &[String]) -> bool {
        names.iter().any(|n| {
            let n = n.strip_suffix('.').unwrap_or(n);
            match (self, n.strip_prefix("*.")) {
                (Self::Exact(h), None) => n == h,
                (Self::Exact(h), Some(parent)) => {
                    h.split_once('.').is_some_and(|(_, rest)| rest == parent)
                }
                (Self::Wildcard(h), Some(parent)) => parent == h,
                (Self::Wildcard(_), None) => false,
            }
        })
    }
}

impl fmt::Display for ServerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exact(n) => f.write_str(n),
            Self::Wildcard(n) => write!(f, "*.{n}"),
        }
    }
}

/// A certificate chain and its private key, read from their files and checked to match.
#[derive(Clone)]
pub struct CertPair {
    pub cert_path: PathBuf,
    /// `cert_path` as the config writes it (the validator's; [`CertPair::load`] puts the
    /// path read): the label of its expiry's series, the same however the config file was
    /// named at start.
    pub cert_written: String,
    pub key_path: PathBuf,
    pub key: Arc<CertifiedKey>,
    /// The end of the certificate's validity, as written in it.
    pub expires: String,
    /// The same, in Unix seconds.
    pub not_after: i64,
    /// Why the certificate is outside its validity now (expired, or not yet valid): it is
    /// served all the same, and the config warns of it.
    pub out_of_date: Option<String>,
}

impl CertPair {
    /// The DNS names the served certificate is for (its subject alternative names, lower
    /// case; clients ignore the subject's common name), or `None` when it cannot be read.
    pub fn dns_names(&self) -> Option<Vec<String>> {
        use x509_parser::extensions::GeneralName;
        let leaf = self.key.cert.first()?;
        let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref()).ok()?;
        let names = match cert.subject_alternative_name().ok()? {
            None => Vec::new(),
            Some(san) => (san.value.general_names.iter())
                .filter_map(|g| match g {
                    GeneralName::DNSName(n) => Some(n.to_ascii_lowercase()),
                    _ => None,
                })
                .collect(),
        };
        Some(names)
    }

    /// Reads both files. The error names which file is wrong and why; `field` prefixes say
    /// which field named it (the caller adds them).
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Self, PairError> {
        let cert_pem = super::read_named(cert_path)
            .map_err(|e| PairError::Cert(format!("cannot be read: {e}")))?;
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<_, _>>()
            .map_err(|e| {
                PairError::Cert(format!("is not a PEM certificate chain: {}", pem_error(&e)))
            })?;
        if chain.is_empty() {
            return Err(PairError::Cert(
                "holds no certificate: give a PEM chain, the server's certificate first".into(),
            ));
        }
        let (expires, not_after, out_of_date) = chain_validity(&chain)?;
        let key_pem = super::read_named(key_path)
            .map_err(|e| PairError::Key(format!("cannot be read: {e}")))?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
            PairError::Key(encrypted(&key_pem).unwrap_or_else(|| {
                format!(
                    "holds no usable private key (PKCS#8, PKCS#1 or SEC1 PEM): {}",
                    pem_error(&e)
                )
            }))
        })?;
        let signing = signing_key(key).map_err(PairError::Key)?;
        let certified = CertifiedKey::new(chain, signing);
        certified.keys_match().map_err(|_| {
            PairError::Key(format!(
                "does not belong to the certificate in {}",
                cert_path.display()
            ))
        })?;
        Ok(Self {
            cert_path: cert_path.to_owned(),
            cert_written: cert_path.display().to_string(),
            key_path: key_path.to_owned(),
            key: Arc::new(certified),
            expires,
            not_after,
            out_of_date,
        })
    }
}

/// The key rustls signs with, or why the key cannot be one.
fn signing_key(key: PrivateKeyDer<'static>) -> Result<Arc<dyn rustls::sign::SigningKey>, String> {
    rustls::crypto::ring::default_provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| format!("is not a key TLS can sign with (RSA of 2048 to 8192 bits, ECDSA on P-256 or P-384, or Ed25519: not P-521): {e}"))
}

/// Which file of a pair is wrong, and why.
#[derive(Debug, PartialEq, Eq)]
pub enum PairError {
    Cert(String),
    Key(String),
}

/// Why a key file that holds no key TLS can read is refused, when it is encrypted (a PEM
/// `ENCRYPTED PRIVATE KEY`, or an OpenSSL `Proc-Type: 4,ENCRYPTED` key): the library's own
/// word is only that it found no key.
fn encrypted(pem: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(pem);
    (text.contains("-----BEGIN ENCRYPTED PRIVATE KEY-----") || text.contains("Proc-Type: 4,ENCRYPTED"))
        .then(|| "holds an encrypted private key, and TLS here reads unencrypted keys only: decrypt it (`openssl pkey -in <file> -out <new file>` asks for the passphrase) and keep the file readable by the gateway alone".to_owned())
}

/// A PEM file's error in words: the library writes a missing or broken marker line as a
/// list of byte values.
pub fn pem_error(e: &rustls::pki_types::pem::Error) -> String {
    use rustls::pki_types::pem::Error;
    match e {
        Error::MissingSectionEnd { end_marker } => {
            let label = String::from_utf8_lossy(end_marker);
            format!(
                "its {label} section has no `-----END {label}-----` line (is the file cut short?)"
            )
        }
        Error::IllegalSectionStart { line } => format!(
            "a section starts with an unreadable line `{}`",
            String::from_utf8_lossy(line).trim()
        ),
        other => other.to_string(),
    }
}

/// Why a certificate is of an X.509 version TLS here cannot use: rustls (through webpki)
/// takes v3 only, and `openssl x509 -req` without extensions signs a v1 one, which OpenSSL's
/// own tools take. It would otherwise be refused as a key that does not fit.
fn not_v3(cert: &x509_parser::certificate::X509Certificate<'_>) -> Option<String> {
    (cert.version() != x509_parser::x509::X509Version::V3).then(|| {
        format!(
            "holds an X.509 v{} certificate, and TLS here takes v3 only: sign it with extensions (`openssl x509 -req ... -extfile ext.cnf`, or `-copy_extensions copy`)",
            cert.version().0 + 1
        )
    })
}

/// [`check_validity`] of a whole chain: the leaf first, then the intermediates the listener
/// sends with it (clients check each, so an intermediate that expires before the leaf ends
/// the chain's validity then): the earliest end of any, and the first out of date.
fn chain_validity(
    chain: &[CertificateDer<'_>],
) -> Result<(String, i64, Option<String>), PairError> {
    let mut found = check_validity(&chain[0])?;
    for (i, cert) in chain.iter().enumerate().skip(1) {
        let Ok((_, parsed)) = x509_parser::parse_x509_certificate(cert.as_ref()) else {
            return Err(PairError::Cert(format!(
                "holds a certificate that cannot be parsed at place {} of its chain",
                i + 1
            )));
        };
        let (expires, not_after, out_of_date) = validity_of(&parsed);
        let subject = parsed.subject().to_string();
        if found.2.is_none() {
            found.2 = out_of_date.map(|why| {
                why.replacen(
                    "holds a certificate",
                    &format!("holds, after the server's certificate, one ({subject})"),
                    1,
                )
            });
        }
        if not_after < found.1 {
            found = (format!("{expires}, by {subject}"), not_after, found.2);
        }
    }
    Ok(found)
}

/// The certificate's end of validity, and why it is outside its validity now, if it is.
/// An expired or not yet valid certificate is not refused: a gateway that would not start (or
/// reload) with it would turn an outage of the clients that check it into one of every
/// client, the plain listeners' included, as nginx and Envoy do not.
fn check_validity(cert: &CertificateDer<'_>) -> Result<(String, i64, Option<String>), PairError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| PairError::Cert(format!("holds a certificate that cannot be parsed: {e}")))?;
    if let Some(why) = not_v3(&parsed) {
        return Err(PairError::Cert(why));
    }
    Ok(validity_of(&parsed))
}

/// When `cert`'s validity ends (in words and in Unix seconds), and why it is out of date, if
/// it is.
fn validity_of(
    parsed: &x509_parser::certificate::X509Certificate<'_>,
) -> (String, i64, Option<String>) {
    let validity = parsed.validity();
    let now = x509_parser::time::ASN1Time::now();
    let out_of_date = if validity.not_after < now {
        Some(format!(
            "holds a certificate that expired on {} (renew it and reload)",
            validity.not_after
        ))
    } else if validity.not_before > now {
        Some(format!(
            "holds a certificate that is not valid before {} (is this host's clock right?)",
            validity.not_before
        ))
    } else {
        None
    };
    (
        validity.not_after.to_string(),
        validity.not_after.timestamp(),
        out_of_date,
    )
}

impl PartialEq for CertPair {
    fn eq(&self, other: &Self) -> bool {
        self.cert_path == other.cert_path
            && self.key_path == other.key_path
            && self.key.cert == other.key.cert
    }
}

impl Eq for CertPair {}

impl fmt::Debug for CertPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertPair")
            .field("cert_path", &self.cert_path)
            .field("key_path", &self.key_path)
            .finish_non_exhaustive()
    }
}

/// TLS towards Redis: whom to trust, and the client certificate for mutual TLS.
#[derive(Clone)]
pub struct RedisTls {
    pub ca_path: Option<PathBuf>,
    pub cert_path: Option<PathBuf>,
    /// `cert_path` as the config writes it (the validator's; [`RedisTls::load`] puts the path
    /// read): the label of its expiry's series.
    pub cert_written: Option<String>,
    pub key_path: Option<PathBuf>,
    /// The bytes of the files, as read: what a reload compares.
    source: Vec<Vec<u8>>,
    /// The rustls client settings built from them.
    pub client: Arc<rustls::ClientConfig>,
    /// When the client certificate's validity ends (Unix seconds), when there is one and it
    /// parses: Redis refuses it from then on, so it is shown beside the listeners'.
    pub not_after: Option<i64>,
}

impl RedisTls {
    /// Reads the files and builds the client settings: the CA file's certificates as the only
    /// roots when given, else the system's; the client certificate when both files are given.
    pub fn load(
        ca_path: Option<&Path>,
        client: Option<(&Path, &Path)>,
    ) -> Result<Self, RedisTlsError> {
        let read = |p: &Path, which: RedisTlsError| {
            super::read_unwatched(p).map_err(|e| which.with(format!("cannot be read: {e}")))
        };
        let mut source = Vec::new();
        let mut roots = rustls::RootCertStore::empty();
        match ca_path {
            Some(path) => {
                let pem = read(path, RedisTlsError::Ca(String::new()))?;
                for cert in CertificateDer::pem_slice_iter(&pem) {
                    let cert = cert.map_err(|e| {
                        RedisTlsError::Ca(format!(
                            "is not a PEM certificate file: {}",
                            pem_error(&e)
                        ))
                    })?;
                    roots.add(cert).map_err(|e| {
                        RedisTlsError::Ca(format!("holds a certificate that cannot be a root: {e}"))
                    })?;
                }
                if roots.is_empty() {
                    return Err(RedisTlsError::Ca("holds no certificate".into()));
                }
                source.push(pem);
            }
            None => {
                for cert in rustls_native_certs::load_native_certs().certs {
                    let _ = roots.add(cert);
                }
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports the default versions")
            .with_root_certificates(roots);
        let mut not_after = None;
        let config = match client {
            None => builder.with_no_client_auth(),
            Some((cert_path, key_path)) => {
                let cert_pem = read(cert_path, RedisTlsError::Cert(String::new()))?;
                let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
                    .collect::<Result<_, _>>()
                    .map_err(|e| {
                        RedisTlsError::Cert(format!(
                            "is not a PEM certificate chain: {}",
                            pem_error(&e)
                        ))
                    })?;
                if chain.is_empty() {
                    return Err(RedisTlsError::Cert("holds no certificate".into()));
                }
                let parsed = x509_parser::parse_x509_certificate(chain[0].as_ref()).ok();
                if let Some(why) = parsed.as_ref().and_then(|(_, c)| not_v3(c)) {
                    return Err(RedisTlsError::Cert(why));
                }
                not_after = parsed.map(|(_, c)| c.validity().not_after.timestamp());
                let key_pem = read(key_path, RedisTlsError::Key(String::new()))?;
                let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
                    RedisTlsError::Key(encrypted(&key_pem).unwrap_or_else(|| {
                        format!("holds no usable private key: {}", pem_error(&e))
                    }))
                })?;
                // A key file in PEM form may still hold no key rustls can sign with: that is
                // the key's fault, not the certificate's (the certificate was named for it).
                signing_key(key.clone_key()).map_err(RedisTlsError::Key)?;
                source.push(cert_pem);
                source.push(key_pem);
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| match e {
                        rustls::Error::InconsistentKeys(_) => {
                            RedisTlsError::Key(format!("does not fit the certificate: {e}"))
                        }
                        other => RedisTlsError::Cert(format!("is not usable: {other}")),
                    })?
            }
        };
        Ok(Self {
            ca_path: ca_path.map(Path::to_owned),
            cert_path: client.map(|(c, _)| c.to_owned()),
            cert_written: client.map(|(c, _)| c.display().to_string()),
            key_path: client.map(|(_, k)| k.to_owned()),
            source,
            client: Arc::new(config),
            not_after,
        })
    }
}

/// Which of the Redis TLS files is wrong, and why.
#[derive(Debug, PartialEq, Eq)]
pub enum RedisTlsError {
    Ca(String),
    Cert(String),
    Key(String),
}

impl RedisTlsError {
    fn with(&self, why: String) -> Self {
        match self {
            Self::Ca(_) => Self::Ca(why),
            Self::Cert(_) => Self::Cert(why),
            Self::Key(_) => Self::Key(why),
        }
    }
}

impl PartialEq for RedisTls {
    fn eq(&self, other: &Self) -> bool {
        self.ca_path == other.ca_path
            && self.cert_path == other.cert_path
            && self.key_path == other.key_path
            && self.source == other.source
    }
}

impl Eq for RedisTls {}

impl fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTls")
            .field("ca_path", &self.ca_path)
            .field("cert_path", &self.cert_path)
            .field("key_path", &self.key_path)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_covered_by_itself_or_the_wildcard_one_label_above() {
        let certs = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let name = |n: &str| ServerName::parse(n).unwrap();
        let wild = certs(&["*.resumint.example", "api.pdftalk.example."]);
        assert!(name("eu.resumint.example").covered_by(&wild));
        assert!(name("*.resumint.example").covered_by(&wild));
        assert!(name("API.pdftalk.example").covered_by(&wild));
        // Two labels below a wildcard, the wildcard's own parent, a wildcard by a name.
        assert!(!name("a.eu.resumint.example").covered_by(&wild));
        assert!(!name("resumint.example").covered_by(&wild));
        assert!(!name("*.pdftalk.example").covered_by(&wild));
        assert!(!name("x.pdftalk.example").covered_by(&wild));
        assert!(!name("api.pdftalk.example").covered_by(&[]));
    }

    #[test]
    fn the_names_of_the_examples_certificates_are_read() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/tls");
        let pair = |n: &str| {
            CertPair::load(&dir.join(format!("{n}.pem")), &dir.join(format!("{n}.key"))).unwrap()
        };
        assert_eq!(
            pair("pdftalk").dns_names().unwrap(),
            ["api.pdftalk.example"]
        );
        assert_eq!(
            pair("resumint").dns_names().unwrap(),
            ["*.resumint.example"]
        );
    }

    #[test]
    fn server_names() {
        assert_eq!(
            ServerName::parse("API.Example.com"),
            Ok(ServerName::Exact("api.example.com".into()))
        );
        assert_eq!(
            ServerName::parse("*.resumint.example"),
            Ok(ServerName::Wildcard("resumint.example".into()))
        );
        // Fully qualified, as a route's host may be written.
        assert_eq!(
            ServerName::parse("api.example.com."),
            Ok(ServerName::Exact("api.example.com".into()))
        );
        assert_eq!(
            ServerName::parse("*.resumint.example."),
            Ok(ServerName::Wildcard("resumint.example".into()))
        );
        for bad in [
            "", ".", "*.", "a..b", "a.b..", "*.*.a", "a.*.b", "-a.b", "a_b.c", "a b",
        ] {
            assert!(ServerName::parse(bad).is_err(), "{bad:?}");
        }
        // No client sends an address as its server name (RFC 6066, 3): such an entry would
        // never be served.
        for address in ["127.0.0.1", "10.0.0.1.", "*.0.0.1"] {
            let e = ServerName::parse(address).unwrap_err();
            assert!(
                e.contains("an IP address is never a TLS server name"),
                "{e}"
            );
        }
    }

    /// An encrypted key is named as such: the library says only that it found no key.
    #[test]
    fn an_encrypted_key_is_named_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("k.pem");
        let cert = dir.path().join("c.pem");
        std::fs::write(
            &key,
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIBvTBXBgkqhkiG9w0BBQ0wSjAp\n-----END ENCRYPTED PRIVATE KEY-----\n",
        )
        .unwrap();
        let leaf = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        std::fs::write(&cert, leaf.cert.pem()).unwrap();
        let Err(PairError::Key(why)) = CertPair::load(&cert, &key) else {
            panic!("an encrypted key was taken");
        };
        assert!(why.contains("encrypted private key"), "{why}");
    }

    /// A Redis client key in PEM form that holds no key rustls can sign with is the key's
    /// fault: it was named as the certificate's (`tls_cert_path ... is not usable`).
    #[test]
    fn a_redis_client_key_that_cannot_sign_is_named_as_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("k.pem");
        let cert = dir.path().join("c.pem");
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nU3VwZXJTZWNyZXRLZXlNYXRlcmlhbDQ1Ng==\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        let leaf = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        std::fs::write(&cert, leaf.cert.pem()).unwrap();
        let Err(RedisTlsError::Key(why)) = RedisTls::load(None, Some((&cert, &key))) else {
            panic!("not refused as the key");
        };
        assert!(why.starts_with("is not a key TLS can sign with"), "{why}");
    }
}
