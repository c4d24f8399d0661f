//! Where a setting sits (the file, the route), and the refusal that names it.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::args;

/// A refused setting: where it is, and why.
#[derive(Debug)]
pub(crate) struct SettingError {
    /// The config file, if the setting came from one.
    pub(super) file: Option<PathBuf>,
    /// The route, by name or else by its place (`routes[2]`); none for the top level.
    pub(super) route: Option<String>,
    /// The field, as the file spells it.
    pub(super) field: Option<String>,
    pub(super) message: String,
}

impl fmt::Display for SettingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.file {
            Some(file) => write!(f, "config file {}", file.display())?,
            None => write!(f, "settings")?,
        }
        if let Some(route) = &self.route {
            write!(f, ", route {route}")?;
        }
        if let Some(field) = &self.field {
            write!(f, ", field `{field}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for SettingError {}

/// Where the setting being checked sits, for its errors.
#[derive(Clone)]
pub(super) struct Place<'a> {
    pub(super) file: Option<&'a Path>,
    pub(super) route: Option<String>,
}

impl<'a> Place<'a> {
    /// The top level of `file` (or of the flags alone).
    pub(super) fn top(file: Option<&'a Path>) -> Self {
        Self { file, route: None }
    }

    pub(super) fn error(&self, field: &str, message: impl Into<String>) -> SettingError {
        SettingError {
            file: self.file.map(Path::to_path_buf),
            route: self.route.clone(),
            field: Some(field.to_owned()),
            message: message.into(),
        }
    }

    /// The duration `text` of `field`, if set.
    pub(super) fn duration(
        &self,
        field: &str,
        text: &Option<String>,
    ) -> Result<Option<Duration>, SettingError> {
        text.as_deref()
            .map(args::duration)
            .transpose()
            .map_err(|e| self.error(field, e))
    }
}
