//! The TLS listeners' certificates at handshake time: chosen by SNI name, swapped whole on
//! reload.
//!
//! Each listener has one [`Resolver`]; Pingora's rustls acceptor asks it for a certificate
//! in every handshake. A reload stores a new [`CertSet`] into it: handshakes that start
//! afterwards see the new certificates, connections already open keep the ones they
//! negotiated (TLS never asks again).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use pingora_core::listeners::tls::TlsSettings;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::config::{ServerName, TlsListener, TlsVersion};

/// What one listener serves.
#[derive(Debug)]
struct CertSet {
    default: Arc<CertifiedKey>,
    exact: HashMap<String, Arc<CertifiedKey>>,
    /// By the part after `*.`.
    wildcard: HashMap<String, Arc<CertifiedKey>>,
    min_version: TlsVersion,
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
            min_version: listener.min_version,
        }
    }

    /// The certificate for a client's SNI name: an exact name first, then a `*.` name one
    /// label up, else the default.
    fn choose(&self, server_name: Option<&str>) -> &Arc<CertifiedKey> {
        let Some(name) = server_name else {
            return &self.default;
        };
        let name = name.trim_end_matches('.').to_ascii_lowercase();
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
        let set = self.set.load();
        // rustls speaks 1.2 and 1.3 on every listener and negotiates 1.3 whenever the client
        // can; a client that offers no TLS 1.3 cipher suite cannot, so with min_version 1.3
        // it gets no certificate and the handshake ends with an alert.
        if set.min_version == TlsVersion::V1_3
            && !hello
                .cipher_suites()
                .iter()
                .any(|s| u16::from(*s) >> 8 == 0x13)
        {
            return None;
        }
        Some(Arc::clone(set.choose(hello.server_name())))
    }
}

/// The resolvers of every TLS listener, by address, for reload to swap.
#[derive(Debug, Default)]
pub struct Certificates {
    listeners: Vec<(SocketAddr, Arc<Resolver>)>,
}

impl Certificates {
    pub fn new(listeners: &[TlsListener]) -> Self {
        Self {
            listeners: listeners
                .iter()
                .map(|l| {
                    let set = ArcSwap::from_pointee(CertSet::new(l));
                    (l.listen, Arc::new(Resolver { set }))
                })
                .collect(),
        }
    }

    /// Pingora's settings for the listener at `addr`: this resolver, ALPN h2 and http/1.1.
    pub fn settings(&self, addr: SocketAddr) -> Option<TlsSettings> {
        let (_, resolver) = self.listeners.iter().find(|(a, _)| *a == addr)?;
        let mut settings = TlsSettings::with_callbacks(Box::new(NoCallbacks)).ok()?;
        settings.set_cert_resolver(Arc::clone(resolver) as Arc<dyn ResolvesServerCert>);
        settings.enable_h2();
        Some(settings)
    }

    /// Serves `listeners`' certificates from now on, for every listener that was started;
    /// returns whether the set of listeners differs from the started one (a restart adds or
    /// removes listeners).
    pub fn install(&self, listeners: &[TlsListener]) -> bool {
        for (addr, resolver) in &self.listeners {
            if let Some(l) = listeners.iter().find(|l| l.listen == *addr) {
                resolver.set.store(Arc::new(CertSet::new(l)));
            }
        }
        let mut started: Vec<SocketAddr> = self.listeners.iter().map(|(a, _)| *a).collect();
        let mut wanted: Vec<SocketAddr> = listeners.iter().map(|l| l.listen).collect();
        started.sort();
        wanted.sort();
        started != wanted
    }
}

struct NoCallbacks;

#[async_trait::async_trait]
impl pingora_core::listeners::TlsAccept for NoCallbacks {}

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
            key_path: format!("{marker}.key").into(),
            key: key(marker),
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
