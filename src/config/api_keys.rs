//! The API key file of `[auth.api_keys]`: `[[keys]]` entries of `sha256` (the hex SHA-256 of
//! a key: the key itself is never stored), `tenant` and an optional `tier`. Validated like
//! the config itself, every problem with the key file's own line and column.
//!
//! A lookup hashes the presented key and finds the hash in a map: its cost does not grow with
//! the number of keys, and what is compared is a hash, so timing says nothing about which
//! prefix of a real key a guess shared.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use toml::Spanned;

use super::error::{Collector, ConfigError};
use super::EndpointId;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKeyFile {
    #[serde(default)]
    keys: Vec<Spanned<RawKey>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    sha256: Spanned<String>,
    tenant: Spanned<String>,
    tier: Option<Spanned<String>>,
}

/// Whose a key is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyOwner {
    pub tenant: Arc<str>,
    pub tier: Option<Arc<str>>,
}

/// Every key of the file, by its SHA-256.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApiKeyTable {
    /// Each key's owner, beside the index of its entry in the file (kept from the reading,
    /// which names the first entry of a hash listed twice: a second map of a million keys
    /// at the end of a reading cost more than the index does).
    keys: HashMap<[u8; 32], (u32, KeyOwner)>,
}

impl ApiKeyTable {
    /// The owner of the key whose SHA-256 is `digest`.
    pub fn owner_of_digest(&self, digest: &[u8; 32]) -> Option<&KeyOwner> {
        self.keys.get(digest).map(|(_, o)| o)
    }

    /// The owner of `key` as a client presents it.
    pub fn owner(&self, key: &[u8]) -> Option<&KeyOwner> {
        self.owner_of_digest(&Sha256::digest(key).into())
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The tiers keys name, with how many keys name each.
    pub fn tiers(&self) -> std::collections::BTreeMap<&str, usize> {
        let mut tiers = std::collections::BTreeMap::new();
        for tier in self.keys.values().filter_map(|(_, o)| o.tier.as_deref()) {
            *tiers.entry(tier).or_insert(0) += 1;
        }
        tiers
    }

    /// Tenants whose keys fall in more than one tier as `tier_of` reads a key's `tier` (a
    /// route's plan: no tier, or one it does not list, is its default tier), each with those
    /// tiers in order: each tier has its own buckets.
    pub fn tenants_of_several_tiers<'a>(
        &'a self,
        tier_of: impl Fn(Option<&'a str>) -> &'a str,
    ) -> Vec<(&'a str, Vec<&'a str>)> {
        use std::collections::{BTreeMap, BTreeSet};
        let mut by_tenant: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for (_, o) in self.keys.values() {
            let tier = tier_of(o.tier.as_deref());
            by_tenant.entry(&o.tenant).or_default().insert(tier);
        }
        by_tenant
            .into_iter()
            .filter(|(_, tiers)| tiers.len() > 1)
            .map(|(tenant, tiers)| (tenant, tiers.into_iter().collect()))
            .collect()
    }

    /// Distinct tenants.
    pub fn tenants(&self) -> usize {
        let mut tenants: Vec<&str> = self.keys.values().map(|(_, o)| &*o.tenant).collect();
        tenants.sort_unstable();
        tenants.dedup();
        tenants.len()
    }
}

/// The `sha256 = "..."` line for `key`, as `sentinel-gateway hash-key` prints it.
pub fn key_line(key: &[u8]) -> String {
    format!("sha256 = \"{}\"", hex::encode(Sha256::digest(key)))
}

/// Reads and validates a key file.
pub fn load(path: &Path) -> Result<ApiKeyTable, Vec<ConfigError>> {
    match super::read_named_text(path) {
        Ok(source) => parse(path, &source),
        // Said at the key file's own line, as its other problems are.
        Err(super::NotRead::NotUtf8(at)) => Err(vec![ConfigError {
            file: path.to_path_buf(),
            position: Some(at),
            route: None,
            message: "the API key file is not UTF-8 here: TOML is UTF-8 (re-save it so)".into(),
        }]),
        Err(super::NotRead::Io(e)) => Err(vec![ConfigError {
            file: path.to_path_buf(),
            position: None,
            route: None,
            message: format!("cannot read the API key file: {e}"),
        }]),
    }
}

/// Validates a key file held in memory; `path` is only used in messages.
pub fn parse(path: &Path, source: &str) -> Result<ApiKeyTable, Vec<ConfigError>> {
    let mut c = Collector::new(path, source);
    if super::is_empty_toml(source) {
        c.push(None, None, "the API key file is empty (no table, no key: blank lines or comments only): a file truncated or not yet written is never loaded; for a file that holds no key on purpose, write `keys = []`".into());
        return Err(c.errors);
    }
    // A large file is read a piece at a time (each piece's TOML document dropped once its
    // keys are taken): a million keys read whole took 1.6 GB at their peak, 16 times the
    // file, where the keys themselves hold 200 MB.
    let mut keys: HashMap<[u8; 32], (u32, KeyOwner)> = HashMap::new();
    let mut next = 0;
    let pieces = pieces(source);
    let mut i = 0;
    while i < pieces.len() {
        let (offset, piece) = pieces[i];
        let (raw, read) = match toml::from_str::<RawKeyFile>(piece) {
            Ok(raw) => (raw, 1),
            // A piece cut inside a multi-line string (a `[[keys]]` line in its text) reads
            // with the next; any other mistake is said at its place, as the whole file's
            // reading would say it, without reading the rest (a file cut short by a deploy
            // is read at the same cost as a whole one).
            Err(e) => {
                let joined = pieces
                    .get(i + 1)
                    .map(|(_, next)| &source[offset..offset + piece.len() + next.len()]);
                match joined.map(toml::from_str::<RawKeyFile>) {
                    Some(Ok(raw)) => (raw, 2),
                    _ => {
                        said_unread(&mut c, source, &e, offset);
                        return Err(c.errors);
                    }
                }
            }
        };
        take(&mut c, &mut keys, &mut next, raw, offset);
        i += read;
    }
    finish(c, keys)
}

/// A TOML error of the piece at `offset`, said at its place in the file.
fn said_unread(c: &mut Collector, source: &str, e: &toml::de::Error, offset: usize) {
    // TOML gives no place for a key nested past its reader: the key of most parts.
    let deep = (e.span().is_none() && e.message().contains("recursion limit"))
        .then(|| super::validate::deepest_key(source))
        .flatten();
    match deep {
        Some((at, parts)) => c.push(Some(&at), None, format!("a key of {parts} parts (a dotted key or a table header) nests deeper than the TOML reader goes; a key file is [[keys]] tables of a few fields")),
        None => {
            let at = e.span().map(|s| s.start + offset..s.end + offset);
            c.push(at.as_ref(), None, unshown(e.message().trim()))
        }
    }
}

/// How many `[[keys]]` entries a piece of the file holds at most ([`pieces`]).
const ENTRIES_A_PIECE: usize = 4096;

/// The file cut before every [`ENTRIES_A_PIECE`]-th line that is a `[[keys]]` header alone,
/// with each piece's byte offset; what comes before the first header stays with it.
fn pieces(source: &str) -> Vec<(usize, &str)> {
    let mut cuts = vec![0];
    let (mut headers, mut at) = (0usize, 0usize);
    for line in source.split_inclusive('\n') {
        if line.trim_end() == "[[keys]]" {
            if headers > 0 && headers % ENTRIES_A_PIECE == 0 {
                cuts.push(at);
            }
            headers += 1;
        }
        at += line.len();
    }
    cuts.push(source.len());
    cuts.windows(2)
        .map(|w| (w[0], &source[w[0]..w[1]]))
        .collect()
}

/// Checks a piece's entries and adds its keys; `next` is the index of its first entry in the
/// file, and `offset` where the piece begins in it (the spans are the piece's own).
fn take(
    c: &mut Collector,
    keys: &mut HashMap<[u8; 32], (u32, KeyOwner)>,
    next: &mut usize,
    raw: RawKeyFile,
    offset: usize,
) {
    let at = |s: std::ops::Range<usize>| s.start + offset..s.end + offset;
    for entry in raw.keys {
        let i = *next;
        *next += 1;
        let k = entry.into_inner();
        let label = format!("keys[{i}]");
        let label = Some(label.as_str());
        let digest = hex_digest(k.sha256.get_ref());
        if digest.is_none() {
            c.push(Some(&at(k.sha256.span())), label, format!("sha256 is not a SHA-256 ({} characters, not shown: it may be the key itself): write its 64 hex digits, as `sentinel-gateway hash-key` prints them (never the key itself)", k.sha256.get_ref().chars().count()));
        }
        let tenant = name(c, label, "tenant", &k.tenant, offset);
        let tier = match &k.tier {
            Some(t) => name(c, label, "tier", t, offset).map(Some),
            None => Some(None),
        };
        let (Some(digest), Some(tenant), Some(tier)) = (digest, tenant, tier) else {
            continue;
        };
        let owner = KeyOwner { tenant, tier };
        if let Some((first, _)) = keys.get(&digest) {
            c.push(
                Some(&at(k.sha256.span())),
                label,
                format!("this sha256 is listed already, as keys[{first}]: a key has one tenant"),
            );
            continue;
        }
        keys.insert(digest, (i as u32, owner));
    }
}

fn finish(
    c: Collector,
    keys: HashMap<[u8; 32], (u32, KeyOwner)>,
) -> Result<ApiKeyTable, Vec<ConfigError>> {
    if !c.errors.is_empty() {
        return Err(c.errors);
    }
    Ok(ApiKeyTable { keys })
}

/// The file's own names, which a message may show.
const FIELDS: [&str; 4] = ["keys", "sha256", "tenant", "tier"];

/// A TOML error's message with what the file holds left out: a name or string it quotes
/// (`unknown field \`...\``, `duplicate key`, `invalid type: string "..."`) may be a key
/// written where its hash belongs, or as a table's name. The file's own field names stay.
/// A quoted name may hold the quote itself (a TOML quoted key): the known messages are cut
/// at their last quote, and anything else at its first quote left unmatched.
fn unshown(message: &str) -> String {
    const HIDDEN: &str = "(not shown: it may be a key)";
    for (lead, close) in [
        ("unknown field `", "`, expected"),
        ("duplicate key `", "`"),
        ("invalid type: string \"", "\", expected"),
    ] {
        if let Some(rest) = message.strip_prefix(lead) {
            let end = rest.rfind(close).unwrap_or(rest.len());
            if FIELDS.contains(&&rest[..end]) {
                return message.to_owned();
            }
            let after = rest.get(end + 1..).unwrap_or("");
            let kept = &lead[..lead.len() - 1];
            return format!("{kept}{HIDDEN}{after}");
        }
    }
    // What a message says was expected, outside a quote, is TOML's grammar or the field's
    // type, never the file's text ("missing escaped value, expected `b`, `f`, ..."):
    // kept as written.
    const EXPECTED: &str = ", expected ";
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    loop {
        let quote_at = rest.find(['`', '"']);
        if rest[..quote_at.unwrap_or(rest.len())].contains(EXPECTED) {
            out.push_str(rest);
            return out;
        }
        let Some(at) = quote_at else { break };
        let quote = rest[at..].chars().next().unwrap_or('`');
        out.push_str(&rest[..at]);
        // A quote a `\` escapes (as a Debug-written string holds one) does not end it.
        let inside = &rest[at + 1..];
        let closing = inside.char_indices().find(|&(i, c)| {
            let escapes = inside[..i]
                .bytes()
                .rev()
                .take_while(|b| *b == b'\\')
                .count();
            c == quote && escapes % 2 == 0
        });
        let Some((len, _)) = closing else {
            out.push_str(HIDDEN);
            return out;
        };
        let quoted = &rest[at + 1..at + 1 + len];
        match FIELDS.contains(&quoted) {
            true => out.push_str(&rest[at..at + len + 2]),
            false => out.push_str(HIDDEN),
        }
        rest = &rest[at + len + 2..];
    }
    out.push_str(rest);
    out
}

fn hex_digest(text: &str) -> Option<[u8; 32]> {
    let mut digest = [0u8; 32];
    (text.len() == 64)
        .then(|| hex::decode_to_slice(text.to_ascii_lowercase(), &mut digest).ok())
        .flatten()
        .map(|()| digest)
}

/// A tenant or tier name: the same alphabet as an endpoint id.
fn name(
    c: &mut Collector,
    label: Option<&str>,
    field: &str,
    value: &Spanned<String>,
    offset: usize,
) -> Option<Arc<str>> {
    let text = value.get_ref();
    if EndpointId::parse(text).is_none() {
        let span = value.span();
        c.push(
            Some(&(span.start + offset..span.end + offset)),
            label,
            format!("{field} is not valid ({} characters, not shown: it may be a key pasted in the wrong place): use 1 to 128 of a-z, 0-9, '.', '_', '-'", text.chars().count()),
        );
        return None;
    }
    Some(Arc::from(text.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(key: &str) -> String {
        hex::encode(Sha256::digest(key.as_bytes()))
    }

    /// A key nested past TOML's reader is said at the key file's own line (it was said at
    /// the config's, as "recursion limit").
    #[test]
    fn a_key_nested_too_deep_is_said_at_its_line() {
        let source = format!("keys = []\n\na{} = 1\n", ".b".repeat(150));
        let Err(errors) = parse(Path::new("keys.toml"), &source) else {
            panic!("refused");
        };
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].position, Some((3, 1)));
        assert!(
            errors[0].message.starts_with("a key of 151 parts"),
            "{}",
            errors[0].message
        );
    }

    #[test]
    fn keys_are_found_by_their_hash_and_tenants_may_hold_several() {
        let src = format!(
            "[[keys]]\nsha256 = \"{}\"\ntenant = \"acme\"\ntier = \"pro\"\n\n[[keys]]\nsha256 = \"{}\"\ntenant = \"acme\"\n\n[[keys]]\nsha256 = \"{}\"\ntenant = \"globex\"\n",
            sha("k1"),
            sha("k2").to_ascii_uppercase(),
            sha("k3")
        );
        let table = parse(Path::new("keys.toml"), &src).unwrap();
        assert_eq!((table.len(), table.tenants()), (3, 2));
        let acme = table.owner(b"k1").unwrap();
        assert_eq!((&*acme.tenant, acme.tier.as_deref()), ("acme", Some("pro")));
        assert_eq!(
            &*table.owner(b"k2").unwrap().tenant,
            "acme",
            "upper-case hex is read"
        );
        assert_eq!(&*table.owner(b"k3").unwrap().tenant, "globex");
        assert_eq!(table.owner(b"k4"), None);
        assert_eq!(
            table.owner(sha("k1").as_bytes()),
            None,
            "the hash is not a key"
        );
        assert!(parse(Path::new("k.toml"), "keys = []").unwrap().is_empty());
        assert_eq!(key_line(b"k1"), format!("sha256 = \"{}\"", sha("k1")));
    }

    #[test]
    fn an_empty_file_is_refused_and_no_keys_must_be_said() {
        for empty in ["", "\n  \n", "# keys come later\n"] {
            let errors = parse(Path::new("keys.toml"), empty).unwrap_err();
            assert!(
                errors[0].message.starts_with("the API key file is empty"),
                "{empty:?}"
            );
        }
        let none = parse(Path::new("keys.toml"), "keys = []\n").expect("no keys, on purpose");
        assert!(none.is_empty());
    }

    #[test]
    fn every_problem_is_named_with_its_line_and_column() {
        let src = format!(
            "[[keys]]\nsha256 = \"k1\"\ntenant = \"Acme Corp\"\n\n[[keys]]\nsha256 = \"{0}\"\ntenant = \"a\"\n\n[[keys]]\nsha256 = \"{0}\"\ntenant = \"b\"\ntier = \"\"\n",
            sha("k")
        );
        let errors = parse(Path::new("keys.toml"), &src).unwrap_err();
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            vec![
                "keys.toml:2:10: keys[0]: sha256 is not a SHA-256 (2 characters, not shown: it may be the key itself): write its 64 hex digits, as `sentinel-gateway hash-key` prints them (never the key itself)".to_owned(),
                "keys.toml:3:10: keys[0]: tenant is not valid (9 characters, not shown: it may be a key pasted in the wrong place): use 1 to 128 of a-z, 0-9, '.', '_', '-'".to_owned(),
                "keys.toml:12:8: keys[2]: tier is not valid (0 characters, not shown: it may be a key pasted in the wrong place): use 1 to 128 of a-z, 0-9, '.', '_', '-'".to_owned(),
            ]
        );
        let dup = format!(
            "[[keys]]\nsha256 = \"{0}\"\ntenant = \"a\"\n[[keys]]\nsha256 = \"{0}\"\ntenant = \"b\"\n",
            sha("k")
        );
        let errors = parse(Path::new("keys.toml"), &dup).unwrap_err();
        assert_eq!(
            errors[0].to_string(),
            "keys.toml:5:10: keys[1]: this sha256 is listed already, as keys[0]: a key has one tenant"
        );
        // A name or string the file holds may be a key: never shown, the file's own
        // names are.
        let unknown = parse(Path::new("keys.toml"), "[[keys]]\nkey = \"plain\"\n").unwrap_err();
        assert_eq!(
            unknown[0].to_string(),
            "keys.toml:2:1: unknown field (not shown: it may be a key), expected one of `sha256`, `tenant`, `tier`"
        );
        for (source, secret) in [
            ("live_9f8e7d6c5b4a = \"acme\"\n", "live_9f8e7d6c5b4a"),
            ("\"ab`cd-secret\" = 1\n", "cd-secret"),
            ("keys = \"live_9f8e7d6c5b4a\"\n", "live_9f8e7d6c5b4a"),
            (
                "[[keys]]\nsha256 = \"x\"\ntenant = \"a\"\nacme-secret-key-AAAA = 1\n",
                "acme-secret-key-AAAA",
            ),
        ] {
            let errors = parse(Path::new("keys.toml"), source).unwrap_err();
            let text = errors[0].to_string();
            assert!(!text.contains(secret), "{text}");
            assert!(text.contains("(not shown: it may be a key)"), "{text}");
        }
        // What TOML says it expected is its grammar, not the file's: written as it is, once.
        let escape = parse(Path::new("keys.toml"), "[keys.\"live_9f8e\\q\"]\n").unwrap_err();
        let text = escape[0].to_string();
        assert!(
            text.contains("missing escaped value, expected `b`, ")
                && !text.contains("not shown")
                && !text.contains("live_9f8e"),
            "{text}"
        );
        let escaped =
            unshown("invalid value: string \"a\\\", expected b-live_9f8e\", expected a tier");
        assert_eq!(
            escaped,
            "invalid value: string (not shown: it may be a key), expected a tier"
        );
        let value = unshown("invalid value: string \"live_9f8e\", expected a tier name");
        assert_eq!(
            value,
            "invalid value: string (not shown: it may be a key), expected a tier name"
        );
    }

    /// A file of many keys is read in pieces: what each piece holds is said at its place in
    /// the whole file and by its index among all the entries, a key listed in two pieces is
    /// found, and a piece cut inside a multi-line string (a `[[keys]]` line in its text) is
    /// read whole instead, as TOML reads it.
    #[test]
    fn a_file_read_in_pieces_says_each_problem_where_the_whole_file_has_it() {
        let n = 2 * ENTRIES_A_PIECE + 10;
        let mut src = String::from("# keys\n");
        for i in 0..n {
            src.push_str(&format!(
                "[[keys]]\nsha256 = \"{}\"\ntenant = \"t{i}\"\n",
                sha(&i.to_string())
            ));
        }
        assert_eq!(pieces(&src).len(), 3);
        let table = parse(Path::new("keys.toml"), &src).unwrap();
        assert_eq!(table.len(), n);
        assert_eq!(table.owner(b"8200").unwrap().tenant.as_ref(), "t8200");
        // The last entry's tenant made invalid, and its hash made the first's.
        let last = n - 1;
        let broken = src
            .replace(&format!("tenant = \"t{last}\""), "tenant = \"T!\"")
            .replace(&sha(&last.to_string()), &sha("0"));
        let errors: Vec<String> = parse(Path::new("keys.toml"), &broken)
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect();
        let line = 1 + 3 * last + 2;
        assert_eq!(
            errors,
            [
                format!("keys.toml:{}:10: keys[{last}]: tenant is not valid (2 characters, not shown: it may be a key pasted in the wrong place): use 1 to 128 of a-z, 0-9, '.', '_', '-'", line + 1),
            ],
            "a tenant in error is not looked up for duplicates"
        );
        let dup = src.replace(&sha(&last.to_string()), &sha("0"));
        let errors = parse(Path::new("keys.toml"), &dup).unwrap_err();
        assert_eq!(
            errors[0].to_string(),
            format!("keys.toml:{line}:10: keys[{last}]: this sha256 is listed already, as keys[0]: a key has one tenant")
        );
        // A TOML error in a later piece: at its line in the file.
        let bad = src.replace(&format!("tenant = \"t{last}\""), "tenant = ");
        let errors = parse(Path::new("keys.toml"), &bad).unwrap_err();
        assert!(
            errors[0]
                .to_string()
                .starts_with(&format!("keys.toml:{}:", line + 1)),
            "{}",
            errors[0]
        );
        // A multi-line string holding a `[[keys]]` line where a piece would be cut: the
        // whole file's reading decides (a tenant of several lines is no valid name).
        let cut = ENTRIES_A_PIECE;
        let inside = src.replace(
            &format!("[[keys]]\nsha256 = \"{}\"", sha(&cut.to_string())),
            &format!(
                "tier = \"\"\"\n[[keys]]\n\"\"\"\n[[keys]]\nsha256 = \"{}\"",
                sha(&cut.to_string())
            ),
        );
        let errors = parse(Path::new("keys.toml"), &inside).unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0]
                .to_string()
                .contains(&format!("keys[{}]: tier is not valid", cut - 1)),
            "{}",
            errors[0]
        );
    }
}
