//! The files the config names for the gateway to write or to read secrets from: `[access_log]`,
//! and the checks that keep a secret's file its own.

use std::path::{Path, PathBuf};

use toml::Spanned;

use crate::config::error::Collector;
use crate::config::raw::RawConfig;
use crate::config::*;

/// `[access_log]`: where the lines go.
pub(super) fn access_log(
    c: &mut Collector,
    raw: &RawConfig,
    config: &Path,
) -> Option<AccessLogTarget> {
    let path = &raw.access_log.as_ref()?.get_ref().path;
    match path.get_ref().as_str() {
        "" => {
            c.push(
                Some(&path.span()),
                None,
                "access_log.path is empty: give a file, or \"-\" for stdout".into(),
            );
            None
        }
        "-" => Some(AccessLogTarget::Stdout),
        p => {
            let file = config
                .parent()
                .map_or_else(|| PathBuf::from(p), |dir| dir.join(p));
            // What `check` can tell without writing anything: the file is made at start if
            // missing, in a directory that must be there, and the process may write either
            // (a read-only file system, a directory of another user's: the start would fail).
            let dir = file.parent().filter(|d| !d.as_os_str().is_empty());
            let written = if file.exists() {
                file.clone()
            } else {
                dir.map_or_else(|| PathBuf::from("."), Path::to_path_buf)
            };
            let problem = if file.is_dir() {
                Some("is a directory: name a file in it".to_owned())
            } else if let Some(dir) = dir.filter(|d| !d.is_dir()) {
                let why = match dir.exists() {
                    true => "is not a directory",
                    false => "does not exist",
                };
                Some(format!("cannot be made: {} {why}", dir.display()))
            } else if let Err(e) = may_write(&written, file.exists()) {
                let said = format!(
                    "cannot be written by this process: {}: {e}",
                    written.display()
                );
                // A permission is this user's, and `check` may run as another (a CI job, an
                // operator's shell) than the gateway's: said, not refused (the start says it
                // again, and exits). Anything else (a read-only file system, a path too long
                // or looping) is the host's for everyone: refused.
                let permission = matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM));
                if !permission {
                    Some(said)
                } else {
                    // SAFETY: no arguments; reads the process's real user.
                    let uid = unsafe { libc::getuid() };
                    c.warn(Some(&path.span()), None, format!("access_log.path = \"{}\" {said} (user {uid}): a start as this user would exit 1", path.get_ref()));
                    None
                }
            } else if let Some((read, _)) = read_files(raw, config)
                .into_iter()
                .find(|(_, f)| same_file(f, &file))
            {
                Some(format!("is {read}, which the gateway reads: its lines would be written into it; name a file of its own"))
            } else {
                None
            };
            match problem {
                Some(problem) => {
                    c.push(
                        Some(&path.span()),
                        None,
                        format!("access_log.path = \"{}\" {problem}", path.get_ref()),
                    );
                    None
                }
                None => Some(AccessLogTarget::File(file)),
            }
        }
    }
}

/// A secret's file that is one the gateway reads for another end (the config, a
/// certificate, a JWKS, the key file) is refused: those are no secret (a certificate is sent
/// in every handshake, a JWKS published), and anyone holding one could sign tokens with it
/// as the HS* secret, or present it as the admin token.
pub(super) fn secrets_of_their_own(c: &mut Collector, raw: &RawConfig, config: &Path) {
    let others = read_for_other_ends(raw, config);
    for (field, p) in secret_files(raw) {
        let path = resolved(config, p.get_ref());
        if let Some((other, _)) = others.iter().find(|(_, o)| same_file(&path, o)) {
            c.push(Some(&p.span()), None, format!("{field} = \"{}\" is {other}, which the gateway reads for another end and others may read (a certificate is sent in every handshake): a secret needs a file of its own", p.get_ref()));
        }
    }
}

/// Whether this process may write `path` (a file, or a directory to make one in), as the
/// kernel says without writing: `EACCES` for another user's, `EROFS` on a read-only file
/// system.
fn may_write(path: &Path, is_file: bool) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // A file is made in a directory the process may write and enter.
    let mode = match is_file {
        true => libc::W_OK,
        false => libc::W_OK | libc::X_OK,
    };
    // SAFETY: `c_path` is a NUL-terminated string that outlives the call.
    match unsafe { libc::access(c_path.as_ptr(), mode) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// The files the config names for the gateway to read (and itself), each with what it is,
/// resolved as they are read.
fn read_files(raw: &RawConfig, config: &Path) -> Vec<(String, PathBuf)> {
    let mut files = read_for_other_ends(raw, config);
    files.extend((secret_files(raw)).map(|(field, p)| {
        let path = resolved(config, p.get_ref());
        (format!("{field} = \"{}\"", p.get_ref()), path)
    }));
    files
}

/// The secrets' files the config names, each with its field.
fn secret_files(raw: &RawConfig) -> impl Iterator<Item = (&'static str, &Spanned<String>)> {
    let server = raw.server.as_ref().map(|s| s.get_ref());
    let redis = raw.redis.as_ref().map(|r| r.get_ref());
    let jwt = (raw.auth.as_ref()).and_then(|a| a.get_ref().jwt.as_ref().map(|j| j.get_ref()));
    [
        (
            "server.admin_token_file",
            server.and_then(|s| s.admin_token_file.as_ref()),
        ),
        (
            "redis.password_file",
            redis.and_then(|r| r.password_file.as_ref()),
        ),
        (
            "redis.sentinel_password_file",
            redis.and_then(|r| r.sentinel_password_file.as_ref()),
        ),
        (
            "auth.jwt.secret_file",
            jwt.and_then(|j| j.secret_file.as_ref()),
        ),
    ]
    .into_iter()
    .filter_map(|(field, p)| p.map(|p| (field, p)))
}

/// `written`, relative to the config file's directory.
fn resolved(config: &Path, written: &str) -> PathBuf {
    config
        .parent()
        .map_or_else(|| PathBuf::from(written), |d| d.join(written))
}

/// The files the config names for the gateway to read but its secrets (and itself).
fn read_for_other_ends(raw: &RawConfig, config: &Path) -> Vec<(String, PathBuf)> {
    let at = |p: &str| resolved(config, p);
    let mut files = vec![("the config file itself".to_owned(), config.to_path_buf())];
    let mut add = |what: String, p: Option<&Spanned<String>>| {
        files.extend(p.map(|p| (format!("{what} = \"{}\"", p.get_ref()), at(p.get_ref()))));
    };
    if let Some(server) = &raw.server {
        for (i, t) in server.get_ref().tls.iter().enumerate() {
            let t = t.get_ref();
            add(format!("server.tls[{i}].cert_path"), Some(&t.cert_path));
            add(format!("server.tls[{i}].key_path"), Some(&t.key_path));
            for (j, n) in t.sni.iter().enumerate() {
                add(
                    format!("server.tls[{i}].sni[{j}].cert_path"),
                    Some(&n.get_ref().cert_path),
                );
                add(
                    format!("server.tls[{i}].sni[{j}].key_path"),
                    Some(&n.get_ref().key_path),
                );
            }
        }
    }
    if let Some(auth) = &raw.auth {
        let auth = auth.get_ref();
        add(
            "auth.api_keys.file".into(),
            auth.api_keys.as_ref().map(|k| &k.get_ref().file),
        );
        let jwks = auth
            .jwt
            .as_ref()
            .and_then(|j| j.get_ref().jwks_path.as_ref());
        add("auth.jwt.jwks_path".into(), jwks);
    }
    if let Some(redis) = &raw.redis {
        let r = redis.get_ref();
        add("redis.tls_ca_path".into(), r.tls_ca_path.as_ref());
        add("redis.tls_cert_path".into(), r.tls_cert_path.as_ref());
        add("redis.tls_key_path".into(), r.tls_key_path.as_ref());
    }
    for (name, u) in &raw.upstreams {
        add(
            format!("upstreams.{name}.ca_path"),
            u.get_ref().ca_path.as_ref(),
        );
    }
    files
}

/// Whether two paths name one file that exists (through symbolic or hard links, `..` or
/// another spelling): the same device and inode.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}
