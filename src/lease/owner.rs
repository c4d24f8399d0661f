//! Lease owner values.
//!
//! The owner value is what makes release and renewal safe: the Lua scripts change a lease
//! only when the value stored in it is the caller's. It must therefore be unique per
//! acquire attempt, never per process or per key: a holder that paused past its TTL and
//! comes back must not be mistaken for the holder that took the lease after it.
//!
//! A value is `{service}:{instance}:{ulid}`. The service and instance say who holds a
//! lease when someone looks at Redis during an incident; the ULID, 80 random bits after a
//! millisecond timestamp, makes it unique. The random part is what an attacker would need
//! to release someone else's lease, so it is kept out of `Debug` output and logs.

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};

use ulid::Ulid;

use crate::error::ConfigError;

/// The owner value of one acquire attempt.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Owner {
    value: String,
    /// Where the random part starts.
    random_at: usize,
}

impl Owner {
    /// The whole value, as stored in Redis. Do not log it at info level.
    pub fn as_str(&self) -> &str {
        &self.value
    }

    /// `{service}:{instance}`: who holds the lease, without the random part.
    pub fn holder(&self) -> &str {
        &self.value[..self.random_at - 1]
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Owner({}:…)", self.holder())
    }
}

/// Makes owner values for one service instance.
#[derive(Debug, Clone)]
pub(crate) struct OwnerFactory {
    /// `{service}:{instance}:`
    head: String,
}

impl OwnerFactory {
    pub(crate) fn new(service: &str, instance: &str) -> Result<Self, ConfigError> {
        check_instance(instance)?;
        Ok(Self {
            head: format!("{service}:{instance}:"),
        })
    }

    /// A fresh, unique owner value.
    pub(crate) fn next(&self) -> Owner {
        let mut value = String::with_capacity(self.head.len() + 26);
        value.push_str(&self.head);
        value.push_str(&Ulid::generate().to_string());
        Owner {
            value,
            random_at: self.head.len(),
        }
    }
}

/// The default instance id: the process id and a random suffix, so that two processes
/// on two hosts with the same pid still differ. Set your own (a pod or host name) to make
/// leases easier to trace back.
pub(crate) fn default_instance_id() -> String {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let random = Ulid::generate().random() as u32;
    format!(
        "p{}-{:08x}{}",
        std::process::id(),
        random,
        match SEQ.fetch_add(1, Ordering::Relaxed) {
            0 => String::new(),
            n => format!("-{n}"),
        }
    )
}

fn check_instance(instance: &str) -> Result<(), ConfigError> {
    if instance.is_empty() || instance.len() > 64 {
        return Err(ConfigError::invalid(
            "instance_id",
            "must be 1 to 64 characters long",
        ));
    }
    if let Some(bad) = instance
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(ConfigError::invalid(
            "instance_id",
            format!("contains {bad:?}; allowed are A-Z, a-z, 0-9, '.', '_' and '-'"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn values_are_unique_per_attempt_and_say_who_holds() {
        let owners = OwnerFactory::new("quote-api", "pod-7f8c").unwrap();
        let values: HashSet<String> = (0..10_000)
            .map(|_| owners.next().as_str().to_owned())
            .collect();
        assert_eq!(values.len(), 10_000);
        let one = owners.next();
        assert_eq!(one.holder(), "quote-api:pod-7f8c");
        assert_eq!(one.as_str().len(), "quote-api:pod-7f8c:".len() + 26);
    }

    #[test]
    fn debug_hides_the_random_part() {
        let one = OwnerFactory::new("svc", "i1").unwrap().next();
        let shown = format!("{one:?}");
        assert!(shown.contains("svc:i1"));
        assert!(!shown.contains(&one.as_str()["svc:i1:".len()..]));
    }

    #[test]
    fn instance_ids_are_checked() {
        assert_eq!(
            OwnerFactory::new("svc", "").unwrap_err().field(),
            "instance_id"
        );
        assert_eq!(
            OwnerFactory::new("svc", "a:b").unwrap_err().field(),
            "instance_id"
        );
        let a = default_instance_id();
        let b = default_instance_id();
        assert_ne!(a, b);
        assert!(OwnerFactory::new("svc", &a).is_ok());
    }
}
