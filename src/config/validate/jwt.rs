//! `[auth.jwt]`: the algorithms, the secret or keys, and the claims a token must hold.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use toml::Spanned;

use super::int_in;
use crate::config::error::Collector;
use crate::config::raw::{RawConfig, RawIdentity};
use crate::config::*;

/// Whether `value`, written for `auth.jwt.<field>`, is one a token's claim can hold: not
/// empty, no control character nor one that turns the text's direction (said when not).
/// `alone`: the field's whole value, not one of a list's.
fn claim_value(
    c: &mut Collector,
    field: &str,
    value: &str,
    at: &Range<usize>,
    alone: bool,
) -> bool {
    let problem = if value.is_empty() {
        match alone {
            true => "is empty: leave it out, or give a value".to_owned(),
            false => "holds an empty value: leave it out, or give a value".to_owned(),
        }
    } else if super::unprintable(value) {
        format!("= \"{}\" holds a control character or one that turns the text's direction: no token's claim is written so", value.escape_debug())
    } else {
        return true;
    };
    c.push(Some(at), None, format!("auth.jwt.{field} {problem}"));
    false
}

/// `auth.jwt.<field>` written as a string or a list of them, each a claim's possible value
/// (a claim's may be a boolean, `email_verified = true`, kept as its text; an issuer's not).
fn claim_values(c: &mut Collector, field: &str, v: &Spanned<toml::Value>) -> Option<Vec<String>> {
    let (example, booleans) = match field {
        "issuer" => (
            "\"https://idp.example/\" or [\"https://idp.example/\", \"idp.example\"]",
            "",
        ),
        _ => ("\"access\" or [\"app-a\", \"app-b\"]", ", a boolean"),
    };
    let one = |v: &toml::Value| match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Boolean(b) if field != "issuer" => Some(b.to_string()),
        _ => None,
    };
    let (values, alone) = match v.get_ref() {
        toml::Value::Array(a) if !a.is_empty() => (a.iter().map(one).collect(), false),
        toml::Value::Array(_) => (None, false),
        single => (one(single).map(|s| vec![s]), true),
    };
    let Some(values) = values else {
        c.push(Some(&v.span()), None, format!("auth.jwt.{field} must be a string{booleans} or a non-empty list of them, such as {example}"));
        return None;
    };
    let mut ok = true;
    for value in &values {
        ok &= claim_value(c, field, value, &v.span(), alone);
    }
    ok.then_some(values)
}

/// A shared JWT secret holds at least this many different bytes.
const MIN_JWT_SECRET_DISTINCT: usize = 8;

/// How many different byte values `bytes` holds.
fn distinct_bytes(bytes: &[u8]) -> usize {
    let mut seen = [false; 256];
    bytes.iter().for_each(|b| seen[*b as usize] = true);
    seen.iter().filter(|s| **s).count()
}

/// `auth.jwt.required_claims`, in the file's order (the table is read sorted by name): each
/// claim with its values. The claims other fields check (`iss`, `aud`) or the clock does are
/// refused here.
fn required_claims(
    c: &mut Collector,
    j: &crate::config::raw::RawJwt,
) -> Vec<(String, Vec<String>)> {
    let mut written: Vec<_> = j.required_claims.iter().flat_map(|t| t.get_ref()).collect();
    written.sort_by_key(|(_, v)| v.span().start);
    let mut required = Vec::new();
    for (name, value) in written {
        let field = format!("required_claims.{}", super::shape::key_shown(name));
        let own = match name.as_str() {
            "iss" => Some("by auth.jwt.issuer"),
            "aud" => Some("by auth.jwt.audiences"),
            "exp" | "nbf" | "iat" => Some("against the clock, with auth.jwt.leeway_seconds"),
            _ => None,
        };
        if let Some(own) = own {
            c.push(
                Some(&value.span()),
                None,
                format!("auth.jwt.{field} is checked {own}, not here"),
            );
        } else if name.is_empty() {
            c.push(
                Some(&value.span()),
                None,
                "auth.jwt.required_claims names an empty claim".into(),
            );
        } else if let Some(values) = claim_values(c, &field, value) {
            required.push((name.clone(), values));
        }
    }
    required
}

pub(super) fn jwt(c: &mut Collector, raw: &RawConfig, config: &Path) -> Option<JwtConfig> {
    let spanned = raw.auth.as_ref()?.get_ref().jwt.as_ref()?;
    let j = spanned.get_ref();
    let secret_env = j
        .secret_env
        .as_ref()
        .map_or("SENTINEL_JWT_SECRET".to_owned(), |s| s.get_ref().clone());
    let accepted = JWT_ALGORITHMS.join(", ");
    let mut algorithms = vec!["HS256".to_owned()];
    if let Some(a) = j.algorithms.as_ref() {
        for alg in a.get_ref() {
            if !JWT_ALGORITHMS.contains(&alg.as_str()) {
                c.push(Some(&a.span()), None, format!("auth.jwt.algorithms: \"{alg}\" is not accepted: use a subset of {accepted}"));
            }
        }
        if a.get_ref().is_empty() {
            c.push(
                Some(&a.span()),
                None,
                format!("auth.jwt.algorithms is empty: use a subset of {accepted}"),
            );
        }
        for (i, j) in super::listed_again(a.get_ref(), String::clone) {
            let alg = &a.get_ref()[i];
            c.warn(Some(&a.span()), None, format!("auth.jwt.algorithms[{i}] = \"{alg}\" is listed already as auth.jwt.algorithms[{j}]: keep one"));
        }
        // Those not accepted are said above, once: the checks below look at the rest.
        algorithms = (a.get_ref().iter())
            .filter(|alg| JWT_ALGORITHMS.contains(&alg.as_str()))
            .cloned()
            .collect();
    }
    let symmetric = algorithms.iter().any(|a| a.starts_with("HS"));
    let asymmetric = algorithms.iter().any(|a| !a.starts_with("HS"));
    let used = raw.routes.iter().any(|r| {
        matches!(r.get_ref().identity.as_ref().map(|i| i.get_ref()), Some(RawIdentity::Named(n)) if n == "jwt")
    });
    if !used {
        c.warn(Some(&spanned.span()), None, "[auth.jwt] is set but no route has identity = \"jwt\": its secret and keys are not checked until one does".into());
    }
    // Said whether or not the secret is read now (no HS* algorithm, no jwt route yet).
    let both = j.secret_env.is_some() && j.secret_file.is_some();
    if both && !(used && symmetric) {
        let _ = super::secret(
            c,
            "auth.jwt.secret",
            j.secret_env.as_ref(),
            j.secret_file.as_ref(),
            None,
            config,
        );
    }
    let secret = if used && symmetric {
        let read = super::secret(
            c,
            "auth.jwt.secret",
            j.secret_env.as_ref(),
            j.secret_file.as_ref(),
            Some((secret_env.as_str(), spanned.span())),
            config,
        );
        match read {
            Err(()) | Ok(None) => None,
            Ok(Some(read)) => {
                let (field, from, span) = (&read.field, &read.from, Some(&read.span));
                match read.value {
                    None => {
                        c.push(span, None, format!("{field}: {from} is not set: set it to a shared secret of at least {MIN_JWT_SECRET_BYTES} bytes"));
                        None
                    }
                    Some(v) if v.len() < MIN_JWT_SECRET_BYTES => {
                        c.push(span, None, format!("{field}: {from} holds {} bytes: the secret must be at least {MIN_JWT_SECRET_BYTES} bytes", v.len()));
                        None
                    }
                    // 32 spaces or zeros are 32 bytes, and no secret: anyone guesses them.
                    Some(v) if distinct_bytes(&v) < MIN_JWT_SECRET_DISTINCT => {
                        c.push(span, None, format!("{field}: {from} holds {} different bytes: a secret of so few is guessed; write a random one (`openssl rand -base64 48`)", distinct_bytes(&v)));
                        None
                    }
                    Some(v) => Some(Secret(Arc::from(v.as_slice()))),
                }
            }
        }
    } else {
        None
    };
    let jwks_path = j.jwks_path.as_ref().map(|p| {
        config
            .parent()
            .map_or_else(|| PathBuf::from(p.get_ref()), |dir| dir.join(p.get_ref()))
    });
    let jwks_url = match (&j.jwks_url, &j.jwks_path) {
        (Some(u), Some(_)) => {
            c.push(Some(&u.span()), None, "auth.jwt.jwks_url and auth.jwt.jwks_path are both set: keep one (a file, or the identity provider's URL)".into());
            None
        }
        (Some(u), None) => {
            let text = u.get_ref();
            let usable = reqwest::Url::parse(text)
                .ok()
                .is_some_and(|url| crate::remote_jwks::usable_url(&url));
            if !usable {
                c.push(Some(&u.span()), None, format!("auth.jwt.jwks_url = \"{}\" is not usable: give an https:// URL (http:// only to a loopback address)", crate::remote_jwks::shown(text)));
                None
            } else {
                Some(text.clone())
            }
        }
        (None, _) => None,
    };
    let jwks_refresh = int_in(
        c,
        None,
        "auth.jwt.jwks_refresh_seconds",
        j.jwks_refresh_seconds.as_ref(),
        300,
        (10, 86_400),
        " seconds",
    );
    let jwks = match (&j.jwks_path, &jwks_path) {
        _ if j.jwks_url.is_some() => None,
        (Some(p), Some(file)) => match super::super::jwks::load(file, &algorithms) {
            Ok((set, warnings)) => {
                c.warnings.extend(warnings);
                Some(Arc::new(set))
            }
            Err(errors) => {
                if errors
                    .iter()
                    .all(|e| e.position.is_none() && e.route.is_none())
                {
                    c.push(
                        Some(&p.span()),
                        None,
                        format!(
                            "auth.jwt.jwks_path = \"{}\": {}",
                            p.get_ref(),
                            errors[0].message
                        ),
                    );
                } else {
                    c.errors.extend(errors);
                }
                None
            }
        },
        _ if asymmetric => {
            let at = j.algorithms.as_ref().map_or(spanned.span(), |a| a.span());
            c.push(
                Some(&at),
                None,
                format!(
                    "auth.jwt.algorithms lists {} but neither jwks_path nor jwks_url gives their public keys",
                    algorithms
                        .iter()
                        .filter(|a| !a.starts_with("HS"))
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
            None
        }
        _ => None,
    };
    let text = |field: &str, v: &Spanned<String>, c: &mut Collector| {
        claim_value(c, field, v.get_ref(), &v.span(), true).then(|| v.get_ref().clone())
    };
    let issuer = match &j.issuer {
        None => Some(Vec::new()),
        Some(i) => claim_values(c, "issuer", i),
    };
    let required_claims = required_claims(c, j);
    let mut audiences = Vec::new();
    if let Some(a) = &j.audiences {
        if a.get_ref().is_empty()
            || a.get_ref()
                .iter()
                .any(|a| a.is_empty() || super::unprintable(a))
        {
            c.push(
                Some(&a.span()),
                None,
                "auth.jwt.audiences must list non-empty audiences without control characters: leave it out to accept any"
                    .into(),
            );
        }
        for (i, j) in super::listed_again(a.get_ref(), String::clone) {
            c.warn(Some(&a.span()), None, format!("auth.jwt.audiences[{i}] is listed already as auth.jwt.audiences[{j}]: keep one"));
        }
        audiences = a.get_ref().clone();
    }
    let leeway = int_in(
        c,
        None,
        "auth.jwt.leeway_seconds",
        j.leeway_seconds.as_ref(),
        30,
        (0, 3600),
        " seconds",
    );
    let identity_claim = match &j.identity_claim {
        None => Some("sub".to_owned()),
        Some(claim) => text("identity_claim", claim, c),
    };
    Some(JwtConfig {
        secret_env,
        algorithms,
        secret,
        jwks,
        jwks_path,
        jwks_url,
        jwks_refresh: Duration::from_secs(jwks_refresh?),
        issuer: issuer?,
        audiences,
        required_claims,
        leeway_secs: leeway?,
        identity_claim: identity_claim?,
    })
}
