//! Configuration problems, each pinned to a file position, a route and a field.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// One problem found in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    /// 1-based line and column, when the problem has a place in the file.
    pub position: Option<(usize, usize)>,
    /// `routes[i] (endpoint_id)` when the problem belongs to a route.
    pub route: Option<String>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some((line, col)) = self.position {
            write!(f, ":{line}:{col}")?;
        }
        write!(f, ": ")?;
        if let Some(route) = &self.route {
            write!(f, "{}: ", one_line(route))?;
        }
        write!(f, "{}", one_line(&self.message))
    }
}

/// A message on one line: a control character a name carried (`endpoint_id = "x\ny"`) is
/// written escaped, never as a line of its own that reads as another error.
fn one_line(text: &str) -> std::borrow::Cow<'_, str> {
    match text.chars().any(char::is_control) {
        false => text.into(),
        true => (text.chars())
            .map(|c| match c.is_control() {
                true => c.escape_default().to_string(),
                false => c.to_string(),
            })
            .collect::<String>()
            .into(),
    }
}

/// Every problem found in one file; a config is loaded only when this list is empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Collects problems while a file is validated, turning byte spans into line and column.
/// Errors refuse the file; warnings (something written that works, but perhaps not as meant)
/// are printed by `check` and logged (INFO) at start and on reload.
pub struct Collector<'a> {
    file: &'a Path,
    source: &'a str,
    pub errors: Vec<ConfigError>,
    pub warnings: Vec<ConfigError>,
    /// The files secrets were read from (`*_file`): watched as the files a config names.
    pub secret_files: Vec<std::path::PathBuf>,
}

impl<'a> Collector<'a> {
    pub fn new(file: &'a Path, source: &'a str) -> Self {
        Self {
            file,
            source,
            errors: Vec::new(),
            warnings: Vec::new(),
            secret_files: Vec::new(),
        }
    }

    pub fn position(&self, span: &Range<usize>) -> (usize, usize) {
        line_col(self.source, span.start)
    }

    pub fn push(&mut self, span: Option<&Range<usize>>, route: Option<&str>, message: String) {
        let error = self.at(span, route, message);
        self.errors.push(error);
    }

    /// A warning: the file still loads.
    pub fn warn(&mut self, span: Option<&Range<usize>>, route: Option<&str>, message: String) {
        let warning = self.at(span, route, message);
        self.warnings.push(warning);
    }

    fn at(&self, span: Option<&Range<usize>>, route: Option<&str>, message: String) -> ConfigError {
        ConfigError {
            file: self.file.to_path_buf(),
            position: span.map(|s| self.position(s)),
            route: route.map(str::to_owned),
            message,
        }
    }
}

/// 1-based line and column (in characters) of a byte offset.
pub fn line_col(source: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(source.len());
    let before = &source[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    // A byte order mark is no column an editor shows.
    let col = before[line_start..]
        .trim_start_matches('\u{feff}')
        .chars()
        .count()
        + 1;
    (line, col)
}
