//! A route's `path` or `path_prefix`, held to the normal form requests are matched in.

use super::*;

pub(crate) fn route_path(
    c: &mut Collector,
    label: Option<&str>,
    spanned: &Spanned<RawRoute>,
) -> Option<PathMatch> {
    let r = spanned.get_ref();
    let (field, value, exact) = match (&r.path, &r.path_prefix) {
        (Some(p), None) => ("path", p, true),
        (None, Some(p)) => ("path_prefix", p, false),
        (Some(p), Some(_)) => {
            c.push(
                Some(&p.span()),
                label,
                "path and path_prefix are both set: keep exactly one".into(),
            );
            return None;
        }
        (None, None) => {
            c.push(
                Some(&spanned.span()),
                label,
                "neither path nor path_prefix is set: give exactly one".into(),
            );
            return None;
        }
    };
    let text = value.get_ref();
    if text.contains(';') {
        c.push(
            Some(&value.span()),
            label,
            format!("{field} = \"{text}\" holds a ';': a request reaching it would carry path parameters (from a ';' to the segment's end), which Java backends drop, and a request whose route depends on them is refused, so the route could never serve; write the path without them (a literal ';' in a path is %3B)"),
        );
        return None;
    }
    match routing::normalize_path(text) {
        // What a request reaching it would be refused for: a segment Windows servers read
        // otherwise (checked on the normal form, which `check` would have written next).
        Ok(n) if !matches!(routing::without_trailing_dots(&n), Ok(None)) => {
            c.push(
                Some(&value.span()),
                label,
                format!("{field} = \"{text}\" has a segment ending in a dot or a space: Windows servers trim those, and a request whose route depends on it is refused, so the route could never serve; write the path without them"),
            );
            None
        }
        Ok(n) if n.as_str() == text.as_str() && (text == "/" || !text.ends_with('/')) => {
            Some(if exact {
                PathMatch::Exact(n)
            } else {
                PathMatch::Prefix(n)
            })
        }
        // A query or fragment written into the path: the route would match neither what
        // was meant (routes match the path alone) nor, written `%3F`, any usual request.
        Ok(_) if text.contains(['?', '#']) => {
            c.push(
                Some(&value.span()),
                label,
                format!("{field} = \"{text}\" holds a '?' or '#': routes match a request's path alone, never its query or fragment, so write the path without them (a literal one in the path is %3F or %23)"),
            );
            None
        }
        Ok(n) => {
            let suggestion = if n.len() > 1 {
                n.trim_end_matches('/')
            } else {
                n.as_str()
            };
            c.push(
                Some(&value.span()),
                label,
                format!("{field} = \"{text}\" is not in normal form: write \"{suggestion}\""),
            );
            None
        }
        Err(e) => {
            let valid = match e {
                PathError::NotAbsolute => "it must start with '/'".to_owned(),
                PathError::TooLong => {
                    format!("it must be at most {} bytes", routing::MAX_PATH_BYTES)
                }
                PathError::BadEscape => "write '%25' for a '%'".to_owned(),
                PathError::EscapesRoot => "write the path without them".to_owned(),
                PathError::EncodedSeparator
                | PathError::Backslash
                | PathError::ControlCharacter
                | PathError::NotUtf8
                | PathError::AmbiguousParameter => "a request holding that is answered 400 and never routed, so no request could match: write the path without it".to_owned(),
            };
            c.push(
                Some(&value.span()),
                label,
                format!("{field} = \"{text}\" is not usable: {e}; {valid}"),
            );
            None
        }
    }
}
