//! Why the sidecar stopped other than cleanly, and its exit code.

use std::fmt;

use crate::config::SettingError;

/// Why the sidecar stopped other than cleanly.
pub(crate) enum Failure {
    /// A setting was refused (exit code 2).
    Setting(SettingError),
    /// Anything else (exit code 1).
    Runtime(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Setting(error) => error.fmt(f),
            Self::Runtime(error) => f.write_str(error),
        }
    }
}

impl From<SettingError> for Failure {
    fn from(error: SettingError) -> Self {
        Self::Setting(error)
    }
}
