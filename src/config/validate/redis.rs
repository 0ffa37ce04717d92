//! `[redis]` (one Redis, Sentinel or a cluster; credentials and TLS) and `[breaker]`.

use std::num::NonZeroU32;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use toml::Spanned;

use super::int_in;
use crate::config::error::Collector;
use crate::config::raw::RawConfig;
use crate::config::*;

pub(super) fn redis(
    c: &mut Collector,
    raw: &RawConfig,
    url_override: Option<&str>,
    config: &Path,
) -> Option<RedisConfig> {
    let r = raw.redis.as_ref().map(|r| r.get_ref());
    let url = r.and_then(|r| r.url.as_ref());
    let cluster = r.and_then(|r| r.cluster_urls.as_ref());
    let sentinel = r.and_then(|r| r.sentinel_urls.as_ref());
    if let (Some(s), true) = (sentinel, url.is_some() || cluster.is_some()) {
        c.push(Some(&s.span()), None, "redis.sentinel_urls is set beside redis.url or redis.cluster_urls: keep exactly one of the three".into());
        return None;
    }
    if let (None, Some(m)) = (sentinel, r.and_then(|r| r.sentinel_master.as_ref())) {
        c.push(
            Some(&m.span()),
            None,
            "redis.sentinel_master is set without redis.sentinel_urls: list the sentinels to ask"
                .into(),
        );
        return None;
    }
    let target = match (url_override, url, cluster) {
        (None, None, None) if sentinel.is_some() => {
            sentinel_target(c, r.expect("a [redis] section"), config)
        }
        (Some(env), file_url, file_seeds) => {
            // The environment's URL is used; the file's are checked all the same (no password
            // in them, and each as it would be read without the variable), so that a file
            // that passes now still loads once the variable is gone.
            if let Some(u) = file_url {
                check_redis_url(
                    c,
                    Some(&u.span()),
                    u.get_ref(),
                    &format!("redis.url \"{}\"", redact_url(u.get_ref())),
                    Some("redis.password"),
                    SINGLE_FORM,
                );
            }
            if let Some(seeds) = file_seeds {
                let _ = cluster_urls(c, seeds);
            }
            if let (Some(_), Some(r)) = (sentinel, r) {
                let _ = sentinel_target(c, r, config);
            }
            check_redis_url(
                c,
                None,
                env,
                &format!("{REDIS_URL_ENV} = \"{}\"", env_url_shown(env)),
                None,
                SINGLE_FORM,
            )
            .map(RedisTarget::Single)
        }
        (None, Some(u), Some(_)) => {
            c.push(
                Some(&u.span()),
                None,
                "redis.url and redis.cluster_urls are both set: keep exactly one (url for one Redis, cluster_urls for Redis Cluster)".into(),
            );
            None
        }
        (None, Some(u), None) => check_redis_url(
            c,
            Some(&u.span()),
            u.get_ref(),
            &format!("redis.url = \"{}\"", redact_url(u.get_ref())),
            Some("redis.password"),
            SINGLE_FORM,
        )
        .map(RedisTarget::Single),
        (None, None, Some(seeds)) => cluster_urls(c, seeds),
        (None, None, None) => Some(RedisTarget::Single("redis://127.0.0.1:6379/0".to_owned())),
    };
    let timeout = int_in(
        c,
        None,
        "redis.timeout_ms",
        r.and_then(|r| r.timeout_ms.as_ref()),
        20,
        (1, 10_000),
        " ms",
    );
    let key_prefix = match r.and_then(|r| r.key_prefix.as_ref()) {
        None => Some("sentinel".to_owned()),
        Some(p) => {
            let v = p.get_ref();
            let valid = !v.is_empty()
                && v.len() <= 64
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
            if !valid {
                c.push(Some(&p.span()), None, format!("redis.key_prefix = \"{}\" is not usable: use 1 to 64 of a-z, A-Z, 0-9, '.', '_', '-'", super::cut(v)));
            }
            valid.then(|| v.clone())
        }
    };
    let require_noeviction = r.and_then(|r| r.require_noeviction).unwrap_or(true);
    let dedicated_io_thread = r.and_then(|r| r.dedicated_io_thread).unwrap_or(true);
    let batch_max = int_in(
        c,
        None,
        "redis.batch_max",
        r.and_then(|r| r.batch_max.as_ref()),
        256,
        (1, crate::config::BATCH_MAX_LARGEST),
        " decisions per call (1 sends each decision alone)",
    )
    .map(|n| n as usize);
    let access = target
        .as_ref()
        .and_then(|t| redis_access(c, r, t, url_override, config));
    // Said by `check`, and logged at every start and reload with the file's other warnings.
    let overridden = match (url_override, cluster, sentinel) {
        (Some(_), Some(_), _) => Some("redis.cluster_urls"),
        (Some(_), None, Some(_)) => Some("redis.sentinel_urls"),
        _ => None,
    };
    if let Some(field) = overridden {
        c.warn(
            None,
            None,
            format!(
                "{REDIS_URL_ENV} is set: it overrides {field}, and the gateway uses that one Redis"
            ),
        );
    }
    Some(RedisConfig {
        target: target?,
        timeout: Duration::from_millis(timeout?),
        key_prefix: key_prefix?,
        require_noeviction,
        dedicated_io_thread,
        batch_max: batch_max?,
        access: access?,
    })
}

/// A password Redis (or a sentinel) is given, from `<field>_env` or `<field>_file`: `Ok(None)`
/// when neither is written, `Err` once a problem is said (not set, empty, not UTF-8).
fn redis_password(
    c: &mut Collector,
    field: &str,
    what: &str,
    env: Option<&Spanned<String>>,
    file: Option<&Spanned<String>>,
    config: &Path,
) -> Result<Option<Secret>, ()> {
    let Some(read) = super::secret(c, field, env, file, None, config)? else {
        return Ok(None);
    };
    let unset = read.unset();
    let super::SecretRead {
        field,
        from,
        span,
        value,
        ..
    } = read;
    match value.map(String::from_utf8) {
        // A line break or a NUL left in (a file ending in two line breaks) is no password
        // anyone meant: every connection would be refused. (Redis takes any other byte.)
        Some(Ok(v)) if v.contains(['\r', '\n', '\0']) => {
            c.push(Some(&span), None, format!("{field}: {from} holds a line break or a NUL (one last line break is not part of it): write the password alone"));
            Err(())
        }
        Some(Ok(v)) if !v.is_empty() => Ok(Some(Secret(Arc::from(v.as_bytes())))),
        Some(Err(_)) => {
            c.push(Some(&span), None, format!("{field}: {from} is not UTF-8"));
            Err(())
        }
        _ => {
            c.push(
                Some(&span),
                None,
                format!("{field}: {from} {unset}: set it to {what}"),
            );
            Err(())
        }
    }
}

/// `username`, `password_env` and the TLS files of `[redis]`, checked against the URLs: TLS
/// settings without a `rediss://` URL, or a mix of `redis://` and `rediss://` seeds, are
/// errors rather than a silent plain-text connection.
fn redis_access(
    c: &mut Collector,
    r: Option<&crate::config::raw::RawRedis>,
    target: &RedisTarget,
    url_override: Option<&str>,
    config: &Path,
) -> Option<RedisAccess> {
    let urls = match target {
        RedisTarget::Single(u) => std::slice::from_ref(u),
        RedisTarget::Cluster(seeds) => seeds.as_slice(),
        // `rediss://` sentinels: the sentinels and the master they name are reached over TLS.
        RedisTarget::Sentinel(s) => s.sentinels.as_slice(),
    };
    let tls_urls = urls.iter().filter(|u| u.starts_with("rediss://")).count();
    let mut ok = true;
    if tls_urls != 0 && tls_urls != urls.len() {
        let (field, what) = match target {
            RedisTarget::Sentinel(_) => ("sentinel_urls", "sentinels"),
            _ => ("cluster_urls", "seeds"),
        };
        let span = r
            .and_then(|r| match target {
                RedisTarget::Sentinel(_) => r.sentinel_urls.as_ref(),
                _ => r.cluster_urls.as_ref(),
            })
            .map(|s| s.span());
        c.push(span.as_ref(), None, format!("redis.{field} mixes redis:// and rediss:// {what}: they are reached one way, write every one with the same scheme"));
        ok = false;
    }
    let username = match r.and_then(|r| r.username.as_ref()) {
        None => None,
        Some(u)
            if u.get_ref().is_empty()
                || u.get_ref().chars().any(char::is_whitespace)
                || super::unprintable(u.get_ref()) =>
        {
            c.push(Some(&u.span()), None, format!("redis.username = \"{}\" is not an ACL user name: write one word, such as \"gateway\"", u.get_ref().escape_debug()));
            ok = false;
            None
        }
        Some(u) => Some(u.get_ref().clone()),
    };
    let password = redis_password(
        c,
        "redis.password",
        "the Redis password",
        r.and_then(|r| r.password_env.as_ref()),
        r.and_then(|r| r.password_file.as_ref()),
        config,
    )
    .unwrap_or_else(|()| {
        ok = false;
        None
    });
    let resolve = |p: &Spanned<String>| {
        let written = p.get_ref();
        config
            .parent()
            .map_or_else(|| PathBuf::from(written), |dir| dir.join(written))
    };
    let ca = r.and_then(|r| r.tls_ca_path.as_ref());
    let cert = r.and_then(|r| r.tls_cert_path.as_ref());
    let key = r.and_then(|r| r.tls_key_path.as_ref());
    if tls_urls == 0 {
        for (field, value) in [
            ("tls_ca_path", ca),
            ("tls_cert_path", cert),
            ("tls_key_path", key),
        ] {
            if let Some(v) = value {
                let url = match url_override {
                    Some(_) => format!("{REDIS_URL_ENV}, which overrides the file's Redis,"),
                    None => "the Redis URL".to_owned(),
                };
                c.push(Some(&v.span()), None, format!("redis.{field} is set but {url} is not rediss://: write rediss://host:port to use TLS, or remove {field}"));
                ok = false;
            }
        }
        return ok.then_some(RedisAccess {
            username,
            password,
            tls: None,
        });
    }
    let client = match (cert, key) {
        (Some(c), Some(k)) => Some((resolve(c), resolve(k))),
        (None, None) => None,
        (Some(one), None) | (None, Some(one)) => {
            c.push(Some(&one.span()), None, "redis.tls_cert_path and redis.tls_key_path go together: give both for a client certificate (mutual TLS), or neither".into());
            return None;
        }
    };
    let ca_path = ca.map(resolve);
    let tls = match crate::config::tls::RedisTls::load(
        ca_path.as_deref(),
        client.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
    ) {
        Ok(mut tls) => {
            tls.cert_written = cert
                .filter(|_| client.is_some())
                .map(|c| c.get_ref().clone());
            Some(tls)
        }
        Err(e) => {
            let (field, value, why) = match e {
                crate::config::tls::RedisTlsError::Ca(why) => ("tls_ca_path", ca, why),
                crate::config::tls::RedisTlsError::Cert(why) => ("tls_cert_path", cert, why),
                crate::config::tls::RedisTlsError::Key(why) => ("tls_key_path", key, why),
            };
            let written = value.map(|v| v.get_ref().as_str()).unwrap_or_default();
            c.push(
                value.map(|v| v.span()).as_ref(),
                None,
                format!("redis.{field} = \"{written}\" {why}"),
            );
            None
        }
    };
    (ok && tls.is_some()).then_some(RedisAccess {
        username,
        password,
        tls,
    })
}

/// Whether a URL says more than where to connect: a database (`/3`) or options (`?...`).
fn beyond_the_address(url: &str) -> bool {
    // Userinfo holds none of `/`, `?`, `#` unencoded: the first of them ends the address.
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    match rest.find(['/', '?', '#']) {
        None => false,
        Some(at) => !matches!(&rest[at..], "/" | "/0"),
    }
}

/// Whether the URL's address names no port (`redis://host`): `redis` has no port of its
/// own to the URL parser, so one is named exactly when it is written.
fn without_port(url: &str) -> bool {
    reqwest::Url::parse(url).is_ok_and(|u| u.port().is_none())
}

/// `SENTINEL_REDIS_URL`'s value as messages show it: a URL without its password, and
/// anything else not at all (a password pasted into the variable by mistake, say).
fn env_url_shown(value: &str) -> std::borrow::Cow<'_, str> {
    if crate::config::scheme_end(value).is_some() {
        redact_url(value)
    } else {
        "***".into()
    }
}

/// The form of a URL of one Redis, said when one is not a URL.
const SINGLE_FORM: &str =
    "redis://host:port/db (rediss:// for TLS; an IPv6 address in brackets: redis://[::1]:6379/0)";

/// `sentinel_urls`, `sentinel_master` and `sentinel_password_env`.
fn sentinel_target(
    c: &mut Collector,
    r: &crate::config::raw::RawRedis,
    config: &Path,
) -> Option<RedisTarget> {
    let urls = r.sentinel_urls.as_ref()?;
    let mut ok = true;
    if urls.get_ref().is_empty() || urls.get_ref().len() > 16 {
        c.push(
            Some(&urls.span()),
            None,
            "redis.sentinel_urls must list 1 to 16 sentinels, such as [\"redis://10.0.1.1:26379\"]"
                .into(),
        );
        ok = false;
    }
    repeated(c, "redis.sentinel_urls", urls.get_ref());
    let mut sentinels = Vec::new();
    for u in urls.get_ref() {
        let what = format!("redis.sentinel_urls entry \"{}\"", redact_url(u.get_ref()));
        match check_redis_url(
            c,
            Some(&u.span()),
            u.get_ref(),
            &what,
            Some("redis.sentinel_password"),
            "redis://host:port (rediss:// for TLS)",
        ) {
            Some(url) => {
                let why = if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
                    Some("a sentinel is reached as redis://host:port (rediss:// for TLS)")
                } else if beyond_the_address(&url) {
                    Some("a sentinel is reached as redis://host:port, with no database but 0 and no options (the master's database 0 holds the limits)")
                } else if without_port(&url) {
                    Some("name the sentinel's port, redis://host:26379 as a rule (without one, the URL means Redis's 6379)")
                } else {
                    None
                };
                match why {
                    None => sentinels.push(url),
                    Some(why) => {
                        c.push(Some(&u.span()), None, format!("{what}: {why}"));
                        ok = false;
                    }
                }
            }
            None => ok = false,
        }
    }
    let master = match &r.sentinel_master {
        None => {
            c.push(Some(&urls.span()), None, "redis.sentinel_urls needs redis.sentinel_master: the name the sentinels monitor the master under".into());
            None
        }
        Some(m)
            if m.get_ref().is_empty()
                || m.get_ref().chars().any(char::is_whitespace)
                || super::unprintable(m.get_ref()) =>
        {
            c.push(
                Some(&m.span()),
                None,
                format!(
                    "redis.sentinel_master = \"{}\" is not a master name",
                    m.get_ref().escape_debug()
                ),
            );
            None
        }
        Some(m) => Some(m.get_ref().clone()),
    };
    let password = redis_password(
        c,
        "redis.sentinel_password",
        "the sentinels' password",
        r.sentinel_password_env.as_ref(),
        r.sentinel_password_file.as_ref(),
        config,
    )
    .ok();
    let target = RedisTarget::Sentinel(crate::config::SentinelTarget {
        sentinels,
        master: master?,
        password: password?,
    });
    ok.then_some(target)
}

/// Warns of each URL of `list` written as an earlier one (letters' case aside): listed
/// twice, it is still one node asked (said by index: a URL may hold a user name).
fn repeated(c: &mut Collector, field: &str, list: &[Spanned<String>]) {
    for (i, j) in super::listed_again(list, |u| u.get_ref().trim().to_ascii_lowercase()) {
        c.warn(
            Some(&list[i].span()),
            None,
            format!(
                "{field}[{i}] is {field}[{j}] again: a node listed twice is still one; keep one"
            ),
        );
    }
}

/// Seed nodes of a Redis Cluster: 1 to 64 `redis://host:port` URLs, database 0 (a cluster
/// has no other).
fn cluster_urls(c: &mut Collector, seeds: &Spanned<Vec<Spanned<String>>>) -> Option<RedisTarget> {
    let list = seeds.get_ref();
    if list.is_empty() || list.len() > 64 {
        c.push(
            Some(&seeds.span()),
            None,
            format!(
                "redis.cluster_urls has {} entries: list 1 to 64 seed nodes, such as [\"redis://10.0.0.1:6379\"]",
                list.len()
            ),
        );
        return None;
    }
    repeated(c, "redis.cluster_urls", list);
    let mut ok = true;
    let mut urls = Vec::with_capacity(list.len());
    for seed in list {
        let text = seed.get_ref();
        let what = format!("redis.cluster_urls entry \"{}\"", redact_url(text));
        let Some(url) = check_redis_url(
            c,
            Some(&seed.span()),
            text,
            &what,
            Some("redis.password"),
            "redis://host:port (rediss:// for TLS)",
        ) else {
            ok = false;
            continue;
        };
        let info = redis::IntoConnectionInfo::into_connection_info(
            url.replacen("rediss://", "redis://", 1).as_str(),
        );
        match info {
            Ok(info) if !matches!(info.addr(), redis::ConnectionAddr::Tcp(..)) => {
                c.push(Some(&seed.span()), None, format!("{what} is not a TCP address: cluster nodes are reached as redis://host:port"));
                ok = false;
            }
            Ok(info) if info.redis_settings().db() != 0 => {
                c.push(
                    Some(&seed.span()),
                    None,
                    format!(
                        "{what} selects database {}: Redis Cluster has only database 0",
                        info.redis_settings().db()
                    ),
                );
                ok = false;
            }
            _ => urls.push(url),
        }
    }
    ok.then_some(RedisTarget::Cluster(urls))
}

/// A Redis URL named `what` (the URL in it already without its password). `in_file`: the
/// URL was written in the file, which must not hold a password (contract section 11): the
/// field to name instead. `form`: the URL's form, said when it is not one.
fn check_redis_url(
    c: &mut Collector,
    span: Option<&Range<usize>>,
    url: &str,
    what: &str,
    in_file: Option<&str>,
    form: &str,
) -> Option<String> {
    // rediss:// is parsed as its redis:// twin: the store makes the TLS handshake itself.
    let plain = match url.strip_prefix("rediss://") {
        Some(rest) => format!("redis://{rest}"),
        None => url.to_owned(),
    };
    // A password in the query (`?password=`, `?pass=`; the name percent-decoded, as the
    // client reads it): redis-rs reads one there only as a socket's `?pass=`, but it is a
    // secret written in the file all the same.
    let named = |wanted: &[&str]| {
        url.split_once('?').is_some_and(|(_, query)| {
            query.split('&').any(|pair| {
                let key = pair.split('=').next().unwrap_or_default();
                let key = percent_encoding::percent_decode_str(key).decode_utf8_lossy();
                wanted.iter().any(|w| key.eq_ignore_ascii_case(w))
            })
        })
    };
    let in_query = named(&["password", "pass"]);
    let socket = url.starts_with("unix://") || url.starts_with("redis+unix://");
    // What the client would not read: `?password=` anywhere, `?pass=` but in a socket's.
    let unread = named(&["password"]) || (!socket && named(&["pass"]));
    match redis::Client::open(plain.as_str()) {
        Ok(client)
            if in_file.is_some()
                && (in_query
                    || client
                        .get_connection_info()
                        .redis_settings()
                        .password()
                        .is_some()) =>
        {
            c.push(
                span,
                None,
                format!(
                    "{what} holds a password, which the file must not: put it in an environment variable named in {field}_env, or in a file of its own named in {field}_file (the user name may stay in the URL)",
                    field = in_file.unwrap_or_default()
                ),
            );
            None
        }
        // `SENTINEL_REDIS_URL` may carry a password, but one the client does not read in
        // the query would have Redis answer every call `NOAUTH`: said now, not at the first.
        // Redis numbers its databases from 0, and takes an index that fits 32 bits: another
        // is refused at every decision.
        Ok(client)
            if i32::try_from(client.get_connection_info().redis_settings().db())
                .map_or(true, |db| db < 0) =>
        {
            c.push(
                span,
                None,
                format!(
                    "{what} selects database {}: Redis numbers its databases from 0 (the path's /0, /1, ... up to the server's `databases` less one)",
                    client.get_connection_info().redis_settings().db()
                ),
            );
            None
        }
        // The client reads a database in the query of a socket's URL only: in a TCP one it
        // would be passed over, and the buckets kept in database 0.
        Ok(_) if !socket && named(&["db"]) => {
            c.push(
                span,
                None,
                format!(
                    "{what}: a database in the query is not read by the Redis client (only a unix:// URL's ?db= is); write it as the path, redis://host:port/2"
                ),
            );
            None
        }
        Ok(_) if unread => {
            c.push(
                span,
                None,
                format!(
                    "{what}: a password in the query is not read by the Redis client (only ?pass= in a unix:// URL is); write it before the host, redis://user:password@host:port"
                ),
            );
            None
        }
        Ok(_)
            if url.starts_with("redis://")
                || url.starts_with("rediss://")
                || url.starts_with("redis+unix://")
                || url.starts_with("unix://") =>
        {
            Some(url.to_owned())
        }
        Ok(_) => {
            c.push(
                span,
                None,
                format!("{what} is not supported: use a redis://, rediss:// or unix:// URL"),
            );
            None
        }
        Err(e) => {
            c.push(
                span,
                None,
                format!("{what} is not a Redis URL ({e}): write {form}"),
            );
            None
        }
    }
}

pub(super) fn breaker(c: &mut Collector, raw: &RawConfig) -> Option<BreakerConfig> {
    let b = raw.breaker.as_ref().map(|b| b.get_ref());
    let threshold = int_in(
        c,
        None,
        "breaker.failure_threshold",
        b.and_then(|b| b.failure_threshold.as_ref()),
        5,
        (1, 1_000_000),
        "",
    );
    let open = int_in(
        c,
        None,
        "breaker.open_seconds",
        b.and_then(|b| b.open_seconds.as_ref()),
        30,
        (1, 3600),
        " seconds",
    );
    Some(BreakerConfig {
        failure_threshold: NonZeroU32::new(threshold? as u32)?,
        open_for: Duration::from_secs(open?),
    })
}
