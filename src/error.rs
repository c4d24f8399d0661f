//! The crate's configuration error.
//!
//! Every builder in the crate checks what it is given before it builds anything, and a
//! refusal names the field, so that a bad setting is found when the service starts and
//! not under load.

use std::time::Duration;

/// A setting was refused when a client, key space or layer was built.
///
/// Every variant names the field it is about ([`ConfigError::field`]), spelled as the
/// builder method that sets it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A field that has no default was not set.
    #[error("`{field}` is required")]
    Missing {
        /// The field's name.
        field: &'static str,
    },
    /// A duration or count that must be positive is zero.
    #[error("`{field}` must be greater than zero")]
    Zero {
        /// The field's name.
        field: &'static str,
    },
    /// A duration is too short for another one it must leave room for.
    #[error("`{field}` is {value:?} but must be at least {min:?}: {why}")]
    TooShort {
        /// The field's name.
        field: &'static str,
        /// The value given.
        value: Duration,
        /// The smallest value accepted.
        min: Duration,
        /// Which rule asks for it.
        why: &'static str,
    },
    /// A value is malformed, out of range or of the wrong shape.
    #[error("`{field}` is invalid: {reason}")]
    Invalid {
        /// The field's name.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

impl ConfigError {
    /// The name of the field that was refused.
    ///
    /// ```
    /// use std::time::Duration;
    /// use stampede_guard::Policy;
    ///
    /// let refused = Policy::builder("items").fresh_ttl(Duration::ZERO).build().unwrap_err();
    /// assert_eq!(refused.field(), "fresh_ttl");
    /// ```
    pub fn field(&self) -> &'static str {
        match self {
            Self::Missing { field }
            | Self::Zero { field }
            | Self::TooShort { field, .. }
            | Self::Invalid { field, .. } => field,
        }
    }

    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::Invalid {
            field,
            reason: reason.into(),
        }
    }

    /// Refuses a zero duration.
    pub(crate) fn nonzero(field: &'static str, value: Duration) -> Result<Duration, Self> {
        if value.is_zero() {
            Err(Self::Zero { field })
        } else {
            Ok(value)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_names_its_field_in_the_message() {
        let errors = [
            ConfigError::Missing { field: "secret" },
            ConfigError::Zero {
                field: "command_timeout",
            },
            ConfigError::TooShort {
                field: "lease_ttl",
                value: Duration::from_millis(10),
                min: Duration::from_millis(400),
                why: "the lease must outlive several Redis round trips",
            },
            ConfigError::invalid("service", "must not be empty"),
        ];
        for error in errors {
            let field = error.field();
            assert!(
                error.to_string().contains(&format!("`{field}`")),
                "{error} does not name {field}"
            );
        }
    }
}
