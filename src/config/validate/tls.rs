//! `[[server.tls]]` and its `[[server.tls.sni]]` entries: addresses, versions, names and the
//! certificate files themselves.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use toml::Spanned;

use crate::config::error::Collector;
use crate::config::raw::RawTls;
use crate::config::tls::{CertPair, PairError, ServerName, SniCert, TlsListener, TlsVersion};

/// Every TLS listener, or `None` when one of them has a problem (each one reported).
pub(super) fn listeners(
    c: &mut Collector,
    raw: &[Spanned<RawTls>],
    plain: &[SocketAddr],
    config: &Path,
) -> Option<Vec<TlsListener>> {
    let mut ok = true;
    let mut out = Vec::new();
    let mut seen: Vec<SocketAddr> = Vec::new();
    for (i, t) in raw.iter().enumerate() {
        let t = t.get_ref();
        let at = format!("server.tls[{i}]");
        let listen = match t.listen.get_ref().parse::<SocketAddr>() {
            Ok(a) if a.port() == 0 => {
                let zero = super::sections::PORT_ZERO;
                c.push(
                    Some(&t.listen.span()),
                    None,
                    format!("{at}.listen = \"{a}\" {zero}"),
                );
                None
            }
            Ok(a) if plain.iter().chain(&seen).any(|o| *o == a) => {
                c.push(Some(&t.listen.span()), None, format!("{at}.listen = \"{a}\" is already a listener: every listener needs an address of its own"));
                None
            }
            Ok(a)
                if plain
                    .iter()
                    .chain(&seen)
                    .any(|o| super::sections::overlap(*o, a)) =>
            {
                let other = plain
                    .iter()
                    .chain(&seen)
                    .find(|o| super::sections::overlap(**o, a))
                    .expect("found");
                c.push(Some(&t.listen.span()), None, format!("{at}.listen = \"{a}\" and the listener \"{other}\" {}: every listener needs an address of its own", super::sections::SHARED));
                None
            }
            Ok(a) => {
                seen.push(a);
                Some(a)
            }
            Err(_) => {
                c.push(Some(&t.listen.span()), None, format!("{at}.listen = \"{}\" is not an address: write IP:port, such as \"0.0.0.0:8443\"", t.listen.get_ref()));
                None
            }
        };
        let min_version = match t.min_version.as_ref().map(|v| (v, v.get_ref().as_str())) {
            None | Some((_, "1.2")) => Some(TlsVersion::V1_2),
            Some((_, "1.3")) => Some(TlsVersion::V1_3),
            Some((v, other)) => {
                c.push(
                    Some(&v.span()),
                    None,
                    format!("{at}.min_version = \"{other}\": write \"1.2\" or \"1.3\""),
                );
                None
            }
        };
        let default = pair(c, &at, &t.cert_path, &t.key_path, config);
        let mut sni = Vec::new();
        let mut names: HashMap<ServerName, usize> = HashMap::new();
        for (j, s) in t.sni.iter().enumerate() {
            let s = s.get_ref();
            let sat = format!("{at}.sni[{j}]");
            if s.server_names.get_ref().is_empty() {
                c.push(
                    Some(&s.server_names.span()),
                    None,
                    format!("{sat}.server_names is empty: name at least one host"),
                );
                ok = false;
            }
            let mut server_names = Vec::new();
            for n in s.server_names.get_ref() {
                match ServerName::parse(n.get_ref()) {
                    Ok(name) => {
                        if let Some(before) = names.insert(name.clone(), j) {
                            c.push(Some(&n.span()), None, format!("{sat}.server_names: \"{name}\" is also in {at}.sni[{before}]: each name chooses one certificate"));
                            ok = false;
                        }
                        server_names.push(name);
                    }
                    Err(e) => {
                        c.push(Some(&n.span()), None, format!("{sat}.server_names: {e}"));
                        ok = false;
                    }
                }
            }
            match pair(c, &sat, &s.cert_path, &s.key_path, config) {
                Some(pair) => {
                    not_named(c, &sat, s, &server_names, &pair);
                    sni.push(SniCert { server_names, pair });
                }
                None => ok = false,
            }
        }
        if let (Some(listen), Some(min_version), Some(default)) = (listen, min_version, default) {
            out.push(TlsListener {
                listen,
                min_version,
                default,
                sni,
            });
        } else {
            ok = false;
        }
    }
    ok.then_some(out)
}

/// An SNI name its certificate is not for: served all the same (a file that loads keeps
/// loading), and said, as every client that checks the certificate refuses the handshake.
fn not_named(
    c: &mut Collector,
    sat: &str,
    raw: &crate::config::raw::RawSni,
    names: &[ServerName],
    pair: &CertPair,
) {
    let Some(theirs) = pair.dns_names() else {
        return;
    };
    let written = raw.server_names.get_ref();
    if written.len() != names.len() {
        return;
    }
    for (name, at) in names.iter().zip(written) {
        if !name.covered_by(&theirs) {
            let listed = match theirs.is_empty() {
                true => "none: it has no subject alternative name".to_owned(),
                false => theirs.join(", "),
            };
            c.warn(Some(&at.span()), None, format!("{sat}.server_names: \"{name}\" is not among the names of its certificate (cert_path = \"{}\" names {listed}): a client that checks the certificate refuses the handshake", raw.cert_path.get_ref()));
        }
    }
}

/// Reads one certificate and key; a problem names the field and the file.
fn pair(
    c: &mut Collector,
    at: &str,
    cert: &Spanned<String>,
    key: &Spanned<String>,
    config: &Path,
) -> Option<CertPair> {
    let mut named = true;
    for (field, value) in [("cert_path", cert), ("key_path", key)] {
        if value.get_ref().is_empty() {
            c.push(
                Some(&value.span()),
                None,
                format!("{at}.{field} is empty: name a PEM file"),
            );
            named = false;
        }
    }
    if !named {
        return None;
    }
    let resolve = |p: &str| {
        config
            .parent()
            .map_or_else(|| PathBuf::from(p), |dir| dir.join(p))
    };
    let (cert_path, key_path) = (resolve(cert.get_ref()), resolve(key.get_ref()));
    match CertPair::load(&cert_path, &key_path) {
        // Out of its validity, it is served: said by `check` and logged at ERROR at every
        // start and reload (`Config::out_of_date_certificates`).
        Ok(pair) => Some(CertPair {
            cert_written: cert.get_ref().clone(),
            ..pair
        }),
        Err(PairError::Cert(why)) => {
            c.push(
                Some(&cert.span()),
                None,
                format!("{at}.cert_path = \"{}\" {why}", cert.get_ref()),
            );
            None
        }
        Err(PairError::Key(why)) => {
            c.push(
                Some(&key.span()),
                None,
                format!("{at}.key_path = \"{}\" {why}", key.get_ref()),
            );
            None
        }
    }
}
