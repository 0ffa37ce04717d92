//! The TLS listeners' certificates at handshake time: chosen by SNI name, swapped whole on
//! reload.
//!
//! Each listener has one [`Resolver`], which Pingora's rustls acceptor asks for a
//! certificate in every handshake, and an acceptor that speaks `min_version` and up (TLS 1.2
//! and 1.3, or 1.3 only). A reload stores a new [`CertSet`] into the resolver (and a new
//! acceptor when `min_version` changed): handshakes that start afterwards see the new
//! certificates, connections already open keep the ones they negotiated (TLS never asks
//! again).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use pingora_core::listeners::tls::Acceptor;
use rustls::server::{ClientHello, ResolvesServerCert, ServerConfig};
use rustls::sign::CertifiedKey;

use crate::config::{ServerName, TlsListener, TlsVersion};

/// What one listener serves.
#[derive(Debug)]
struct CertSet {
    default: Arc<CertifiedKey>,
    exact: HashMap<String, Arc<CertifiedKey>>,
    /// By the part after `*.`.
    wildcard: HashMap<String, Arc<CertifiedKey>>,
    /// Each certificate's file and expiry (Unix seconds), for the metric.
    expiries: Vec<(String, i64)>,
}

impl CertSet {
    fn new(listener: &TlsListener) -> Self {
        let mut exact = HashMap::new();
        let mut wildcard = HashMap::new();
        for sni in &listener.sni {
            for name in &sni.server_names {
                let key = Arc::clone(&sni.pair.key);
                match name {
                    ServerName::Exact(n) => exact.insert(n.clone(), key),
                    ServerName::Wildcard(n) => wildcard.insert(n.clone(), key),
                };
            }
        }
        Self {
            default: Arc::clone(&listener.default.key),
            exact,
            wildcard,
            expiries: listener
                .expiries()
                .map(|(path, t)| (path.to_owned(), t))
                .collect(),
        }
    }

    /// The certificate for a client's SNI name: an exact name first, then a `*.` name one
    /// label up, else the default.
    fn choose(&self, server_name: Option<&str>) -> &Arc<CertifiedKey> {
        let Some(name) = server_name else {
            return &self.default;
        };
        let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
        if let Some(key) = self.exact.get(&name) {
            return key;
        }
        name.split_once('.')
            .and_then(|(_, parent)| self.wildcard.get(parent))
            .unwrap_or(&self.default)
    }
}

/// One listener's certificates, as rustls asks for them.
#[derive(Debug)]
pub struct Resolver {
    set: ArcSwap<CertSet>,
}

impl ResolvesServerCert for Resolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(self.set.load().choose(hello.server_name())))
    }
}

/// One TLS listener: its certificates, and the acceptor that speaks its versions.
struct Listener {
    addr: SocketAddr,
    resolver: Arc<Resolver>,
    min_version: ArcSwap<TlsVersion>,
    acceptor: ArcSwap<Acceptor>,
}

/// Every TLS listener's certificates and acceptor, by address, for the connection watch to
/// handshake with and for reload to swap.
#[derive(Default)]
pub struct Certificates {
    listeners: Vec<Listener>,
}

impl std::fmt::Debug for Certificates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.listeners.iter().map(|l| l.addr))
            .finish()
    }
}

/// Session entries each listener keeps for resumption (a few hundred bytes each; a TLS 1.3
/// full handshake leaves two, a TLS 1.2 one one).
const SESSIONS_KEPT: usize = 8192;

/// A rustls acceptor for `min_version` and up, offering ALPN h2, http/1.1 and http/1.0,
/// asking `resolver` for the certificate.
fn acceptor(resolver: &Arc<Resolver>, min_version: TlsVersion) -> Acceptor {
    let versions: &[&'static rustls::SupportedProtocolVersion] = match min_version {
        TlsVersion::V1_2 => &[&rustls::version::TLS13, &rustls::version::TLS12],
        TlsVersion::V1_3 => &[&rustls::version::TLS13],
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .expect("ring supports TLS 1.2 and 1.3")
        .with_no_client_auth()
        .with_cert_resolver(Arc::clone(resolver) as Arc<dyn ResolvesServerCert>);
    // `http/1.0` too, as nginx offers it: a client that offers only it (`curl --http1.0`)
    // would otherwise be refused at the handshake (it is served as HTTP/1.x).
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec(), b"http/1.0".to_vec()];
    // Sessions a client may resume, kept in the process (no tickets: a session's secrets stay
    // here): rustls keeps 256, under a second of new connections on a busy edge.
    config.session_storage = rustls::server::ServerSessionMemoryCache::new(SESSIONS_KEPT);
    Acceptor::from_server_config(Arc::new(config))
}

impl Certificates {
    pub fn new(listeners: &[TlsListener]) -> Self {
        Self {
            listeners: listeners
                .iter()
                .map(|l| {
                    let resolver = Arc::new(Resolver {
                        set: ArcSwap::from_pointee(CertSet::new(l)),
                    });
                    Listener {
                        addr: l.listen,
                        acceptor: ArcSwap::from_pointee(acceptor(&resolver, l.min_version)),
                        min_version: ArcSwap::from_pointee(l.min_version),
                        resolver,
                    }
                })
                .collect(),
        }
    }

    /// The file and expiry of every certificate served now: a listener a reload removed
    /// serves its last ones until the restart.
    pub fn expiries(&self) -> Vec<(String, i64)> {
        self.listeners
            .iter()
            .flat_map(|l| l.resolver.set.load().expiries.clone())
            .collect()
    }

    /// The addresses of the TLS listeners.
    pub fn addrs(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.listeners.iter().map(|l| l.addr)
    }

    /// The acceptor for a connection accepted on `local`, when that is a TLS listener; a
    /// listener on an unspecified IP matches every local address of its port.
    pub fn acceptor(&self, local: SocketAddr) -> Option<Arc<Acceptor>> {
        self.listeners
            .iter()
            .find(|l| l.addr == local)
            .or_else(|| {
                self.listeners.iter().find(|l| {
                    l.addr.ip().is_unspecified()
                        && l.addr.port() == local.port()
                        && l.addr.is_ipv4() == local.is_ipv4()
                })
            })
            .map(|l| l.acceptor.load_full())
    }

    /// Serves `listeners`' certificates and versions from now on, on every listener that
    /// was started; returns whether the set of listeners differs from the started one (only
    /// a restart adds or removes listeners).
    pub fn install(&self, listeners: &[TlsListener]) -> bool {
        for started in &self.listeners {
            if let Some(l) = listeners.iter().find(|l| l.listen == started.addr) {
                started.resolver.set.store(Arc::new(CertSet::new(l)));
                if **started.min_version.load() != l.min_version {
                    started.min_version.store(Arc::new(l.min_version));
                    started
                        .acceptor
                        .store(Arc::new(acceptor(&started.resolver, l.min_version)));
                }
            }
        }
        let mut started: Vec<SocketAddr> = self.addrs().collect();
        let mut wanted: Vec<SocketAddr> = listeners.iter().map(|l| l.listen).collect();
        started.sort();
        wanted.sort();
        started != wanted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{CertPair, ServerName};

    fn key(marker: u8) -> Arc<CertifiedKey> {
        struct Never;
        impl std::fmt::Debug for Never {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("Never")
            }
        }
        impl rustls::sign::SigningKey for Never {
            fn choose_scheme(
                &self,
                _: &[rustls::SignatureScheme],
            ) -> Option<Box<dyn rustls::sign::Signer>> {
                None
            }
            fn algorithm(&self) -> rustls::SignatureAlgorithm {
                rustls::SignatureAlgorithm::ED25519
            }
        }
        let cert = rustls::pki_types::CertificateDer::from(vec![marker]);
        Arc::new(CertifiedKey::new(vec![cert], Arc::new(Never)))
    }

    fn pair(marker: u8) -> CertPair {
        CertPair {
            cert_path: format!("{marker}.pem").into(),
            cert_written: format!("{marker}.pem"),
            key_path: format!("{marker}.key").into(),
            key: key(marker),
            expires: String::new(),
            not_after: 0,
            out_of_date: None,
        }
    }

    fn served(set: &CertSet, name: Option<&str>) -> u8 {
        set.choose(name).cert[0].as_ref()[0]
    }

    #[test]
    fn exact_names_then_one_label_wildcards_then_the_default() {
        let listener = TlsListener {
            listen: "127.0.0.1:8443".parse().unwrap(),
            min_version: TlsVersion::V1_2,
            default: pair(0),
            sni: vec![
                crate::config::tls::SniCert {
                    server_names: vec![
                        ServerName::parse("api.pdftalk.example").unwrap(),
                        ServerName::parse("*.resumint.example").unwrap(),
                    ],
                    pair: pair(1),
                },
                crate::config::tls::SniCert {
                    server_names: vec![ServerName::parse("special.resumint.example").unwrap()],
                    pair: pair(2),
                },
            ],
        };
        let set = CertSet::new(&listener);
        assert_eq!(served(&set, None), 0);
        assert_eq!(served(&set, Some("api.pdftalk.example")), 1);
        assert_eq!(served(&set, Some("API.PDFtalk.Example.")), 1);
        assert_eq!(served(&set, Some("eu.resumint.example")), 1);
        assert_eq!(served(&set, Some("special.resumint.example")), 2);
        // `*.` is one label: neither the bare name nor two labels down.
        assert_eq!(served(&set, Some("resumint.example")), 0);
        assert_eq!(served(&set, Some("a.eu.resumint.example")), 0);
        assert_eq!(served(&set, Some("other.example")), 0);
    }
}
