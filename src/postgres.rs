//! Fenced writes to PostgreSQL (feature `postgres`): the lease's fencing token, checked
//! by the database itself.
//!
//! A Redis lease cannot stop a holder whose lease expired from writing: it may have
//! paused (a stalled process, a slow call) past its TTL while a second holder took the
//! lease and wrote. What stops its write is the row: it carries the token of its last
//! writer, and an update whose token is lower is refused *by PostgreSQL*, inside the
//! same statement that would have written:
//!
//! ```sql
//! UPDATE quote_recalc_state
//!    SET status = $3, fencing_token = $2
//!  WHERE quote_id = $1 AND fencing_token <= $2
//! ```
//!
//! `<=`, not `<`: a holder may write its row more than once (progress, then the end)
//! under its one token, and a token is never issued to two acquires. Every lower token,
//! that is every earlier holder, is refused.
//!
//! An update count of zero means the caller is stale. That count is never left to the
//! caller to look at: [`FencedTable::update`], [`FencedTable::execute_fenced`] (a
//! statement of the caller's, fenced by a row's token) and [`execute_guarded`] turn it
//! into an error ([`FenceError::StaleOwner`], [`FenceError::GuardRefused`]), and a
//! count other than one into [`FenceError::NotOneRow`]. The `Ok` value, [`Written`], and the `Result`
//! are both `#[must_use]`; there is no `bool` to forget.
//!
//! ```no_run
//! use stampede_guard::lease::{AcquireOutcome, LeaseClient};
//! use stampede_guard::postgres::{FenceError, FencedTable};
//! # async fn run(
//! #     leases: LeaseClient,
//! #     name: stampede_guard::keys::LeaseName,
//! #     db: stampede_guard::postgres::tokio_postgres::Client,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! let table = FencedTable::new("quote_recalc_state", "quote_id", "fencing_token")?;
//! let AcquireOutcome::Acquired(lease) = leases
//!     .try_acquire(&name, std::time::Duration::from_secs(10))
//!     .await
//! else {
//!     return Ok(()); // someone else is at it
//! };
//! let quote_id = "q-123";
//! match table
//!     .update(&db, &quote_id, lease.fencing_token(), &[("status", &"DONE")])
//!     .await
//! {
//!     Ok(written) => println!("written with token {:?}", written.token()),
//!     // A newer holder wrote first: this holder's work is void. Do not retry with the
//!     // same token; give up (and do not report success).
//!     Err(FenceError::StaleOwner { current, .. }) => println!("stale: {current} wrote"),
//!     Err(other) => return Err(other.into()),
//! }
//! let _ = leases.release(lease).await;
//! # Ok(()) }
//! ```
//!
//! # Why tokio-postgres
//!
//! It is the asynchronous PostgreSQL client the rest of the stack is already built on
//! (tokio), it has no compile-time database access or macros, and its
//! `GenericClient` covers a plain connection and a
//! transaction alike, so a fenced update can be one statement of a larger transaction
//! (deadpool-postgres and bb8-postgres hand out the same client). The crate is
//! re-exported as [`tokio_postgres`] so that versions match.
//!
//! # Transactions
//!
//! Under `READ COMMITTED` (PostgreSQL's default), an update that waits for another
//! transaction's lock on the row checks its guard again against the row as that
//! transaction committed it. Of two holders updating at once, the row ends with the
//! higher token's write: if the higher one commits first, the lower one is refused; if
//! the lower one commits first, the higher one overwrites it (it is newer). Under
//! `REPEATABLE READ` or `SERIALIZABLE` the first case is an error of the database
//! (`serialization_failure`), reported as [`FenceError::Database`]. These helpers never commit, retry or roll back: inside a
//! transaction, returning the error and dropping the transaction rolls everything back.

use std::fmt;

use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

pub use tokio_postgres;

use crate::error::ConfigError;
use crate::lease::FencingToken;

/// One parameter of a statement.
pub type Param<'a> = &'a (dyn ToSql + Sync);

/// A table whose rows carry the fencing token of their last writer, in a `BIGINT`
/// column (`NOT NULL DEFAULT 0`: a row never written under a lease takes any token; a
/// `NULL` token matches no guard, and such a row is never updated).
///
/// Identifiers are checked when it is made (lowercase letters, digits and `_`, not
/// starting with a digit, at most 63 bytes; the table may be `schema.table`) and quoted
/// in every statement: no value is ever spliced into SQL, only these names.
#[derive(Clone)]
pub struct FencedTable {
    table: String,
    id: String,
    token: String,
    /// The `SELECT` that reads a row's token back after a refused update.
    select_token: String,
}

impl fmt::Debug for FencedTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FencedTable")
            .field("table", &self.table)
            .field("id", &self.id)
            .field("token", &self.token)
            .finish()
    }
}

impl FencedTable {
    /// The table `table`, whose rows are found by `id_column` and fenced by
    /// `token_column`. Refused, naming the argument, when a name is not a plain
    /// identifier.
    pub fn new(table: &str, id_column: &str, token_column: &str) -> Result<Self, ConfigError> {
        let table = match table.split_once('.') {
            Some((schema, name)) => {
                format!("{}.{}", quote("table", schema)?, quote("table", name)?)
            }
            None => quote("table", table)?,
        };
        let id = quote("id_column", id_column)?;
        let token = quote("token_column", token_column)?;
        if id == token {
            return Err(ConfigError::invalid(
                "token_column",
                "the token column cannot be the id column",
            ));
        }
        let select_token = format!("SELECT {token} FROM {table} WHERE {id} = $1");
        Ok(Self {
            table,
            id,
            token,
            select_token,
        })
    }

    /// Sets the columns `set` of the row `id`, and its token to `token`, unless the
    /// token it holds is higher: one `UPDATE … WHERE id = $1 AND token <= $2`, refused
    /// by PostgreSQL for a holder whose lease was taken over by a holder that wrote.
    ///
    /// * `Ok(Written)`: exactly one row was updated.
    /// * [`FenceError::StaleOwner`]: the row holds a higher token (read back after the
    ///   refusal): a newer holder wrote. Stop; the work of this lease is void.
    /// * [`FenceError::NoSuchRow`]: no row had this id when the update ran.
    /// * [`FenceError::NotOneRow`]: the id matched more than one row (it is not unique);
    ///   they were updated, so roll back the transaction around it.
    /// * [`FenceError::TokenOutOfRange`], [`FenceError::Invalid`] (a column name, an
    ///   empty `set`, or the token or id column in `set`), [`FenceError::Database`].
    pub async fn update<C: GenericClient>(
        &self,
        client: &C,
        id: Param<'_>,
        token: FencingToken,
        set: &[(&str, Param<'_>)],
    ) -> Result<Written, FenceError> {
        let bigint = to_bigint(token)?;
        let statement = self.update_statement(set)?;
        let mut params: Vec<Param<'_>> = Vec::with_capacity(set.len() + 2);
        params.push(id);
        params.push(&bigint);
        params.extend(set.iter().map(|(_, value)| *value));
        let rows = client
            .execute(statement.as_str(), &params)
            .await
            .map_err(FenceError::Database)?;
        match rows {
            1 => Ok(Written { token: Some(token) }),
            // Read back in a statement of its own (a new snapshot): a higher token is a
            // newer holder; no row, or one with a token the guard would have let
            // through, means there was no row when the update ran.
            0 => match self.current(client, id).await? {
                Some(current) if current > token => Err(FenceError::StaleOwner { token, current }),
                _ => Err(FenceError::NoSuchRow),
            },
            rows => Err(FenceError::NotOneRow { rows }),
        }
    }

    /// Runs a caller's own statement fenced by this table's row `id`: any statement
    /// (on this table or another) whose guard compares `token` with that row's token,
    /// with a state or version guard besides, such as an item of a batch fenced by the
    /// job's claim:
    ///
    /// ```sql
    /// UPDATE items SET status = 'done'
    ///  WHERE id = $1 AND status = 'pending'
    ///    AND EXISTS (SELECT 1 FROM job_state
    ///                 WHERE job = $3 AND fencing_token <= $2 FOR SHARE)
    /// ```
    ///
    /// Exactly one row changed is `Ok`; when none did, the row `id`'s token is read back
    /// to say which guard refused: a higher token is [`FenceError::StaleOwner`] (a newer
    /// holder wrote: stop), no row is [`FenceError::NoSuchRow`], and otherwise the
    /// caller's own guard said no, [`FenceError::GuardRefused`] (the item was done
    /// already: go on). More than one row is [`FenceError::NotOneRow`].
    pub async fn execute_fenced<C: GenericClient>(
        &self,
        client: &C,
        statement: &str,
        params: &[Param<'_>],
        id: Param<'_>,
        token: FencingToken,
    ) -> Result<Written, FenceError> {
        to_bigint(token)?;
        match execute_guarded(client, statement, params).await {
            Ok(_) => Ok(Written { token: Some(token) }),
            Err(FenceError::GuardRefused) => match self.current(client, id).await? {
                Some(current) if current > token => Err(FenceError::StaleOwner { token, current }),
                Some(_) => Err(FenceError::GuardRefused),
                None => Err(FenceError::NoSuchRow),
            },
            Err(other) => Err(other),
        }
    }

    /// The token the row `id` holds, or `None` when there is no such row.
    pub async fn current<C: GenericClient>(
        &self,
        client: &C,
        id: Param<'_>,
    ) -> Result<Option<FencingToken>, FenceError> {
        let row = client
            .query_opt(self.select_token.as_str(), &[id])
            .await
            .map_err(FenceError::Database)?;
        let Some(row) = row else {
            return Ok(None);
        };
        let stored: i64 = row.try_get(0).map_err(FenceError::Database)?;
        // A negative token was never issued by a lease: it is below every token.
        Ok(Some(FencingToken::new(u64::try_from(stored).unwrap_or(0))))
    }

    fn update_statement(&self, set: &[(&str, Param<'_>)]) -> Result<String, FenceError> {
        if set.is_empty() {
            return Err(FenceError::Invalid(ConfigError::invalid(
                "set",
                "nothing to set: name at least one column",
            )));
        }
        let mut assignments = format!("{} = $2", self.token);
        for (n, (column, _)) in set.iter().enumerate() {
            let column = quote("set", column).map_err(FenceError::Invalid)?;
            if column == self.token || column == self.id {
                return Err(FenceError::Invalid(ConfigError::invalid(
                    "set",
                    format!("{column} is set by the fence itself"),
                )));
            }
            assignments.push_str(&format!(", {column} = ${}", n + 3));
        }
        Ok(format!(
            "UPDATE {} SET {assignments} WHERE {} = $1 AND {} <= $2",
            self.table, self.id, self.token
        ))
    }
}

/// Runs a caller's own guarded statement (an `UPDATE … WHERE` with a state, version or
/// token guard, such as `WHERE id = $1 AND status = 'pending'`) and checks its count:
/// exactly one row, or an error.
///
/// * `Ok(Written)`: one row was changed.
/// * [`FenceError::GuardRefused`]: no row matched: the guard said no (the state moved
///   on, the version changed, a newer token wrote), or the row is gone.
/// * [`FenceError::NotOneRow`]: more than one row matched; they were changed, so roll
///   back the transaction around it.
/// * [`FenceError::Database`].
///
/// The guard is the caller's to write: this checks the count, not the SQL.
pub async fn execute_guarded<C: GenericClient>(
    client: &C,
    statement: &str,
    params: &[Param<'_>],
) -> Result<Written, FenceError> {
    let rows = client
        .execute(statement, params)
        .await
        .map_err(FenceError::Database)?;
    match rows {
        1 => Ok(Written { token: None }),
        0 => Err(FenceError::GuardRefused),
        rows => Err(FenceError::NotOneRow { rows }),
    }
}

/// A token as PostgreSQL's `BIGINT`.
pub fn to_bigint(token: FencingToken) -> Result<i64, FenceError> {
    i64::try_from(token.get()).map_err(|_| FenceError::TokenOutOfRange(token))
}

/// A fenced or guarded write that changed exactly one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a fenced write says whether this holder's work counts"]
pub struct Written {
    token: Option<FencingToken>,
}

impl Written {
    /// The token the row holds now (for [`FencedTable::update`]; `None` for
    /// [`execute_guarded`], whose guard is the caller's).
    pub fn token(&self) -> Option<FencingToken> {
        self.token
    }
}

/// Why a fenced or guarded write did not change exactly one row.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
#[must_use = "a refused write means this holder is stale: its work must not count"]
pub enum FenceError {
    /// The row holds a higher token than ours: a newer lease holder has written. This
    /// holder is stale; nothing was written.
    #[error("stale owner: token {token} refused, the row holds {current}")]
    StaleOwner {
        /// The token the write was made with.
        token: FencingToken,
        /// The token the row held when read back after the refusal.
        current: FencingToken,
    },
    /// No row has the id; nothing was written.
    #[error("no row has this id")]
    NoSuchRow,
    /// A caller's guarded statement matched no row: its guard refused the write.
    #[error("the guard matched no row: the state, version or token moved on")]
    GuardRefused,
    /// The statement changed more rows than one (the id is not unique). They were
    /// changed: roll back the transaction around it.
    #[error("{rows} rows changed where one was expected")]
    NotOneRow {
        /// How many.
        rows: u64,
    },
    /// The token does not fit a `BIGINT` (tokens are microseconds of the Redis clock
    /// and fit for some 290 000 years; a larger one was not issued by a lease).
    #[error("fencing token {0} does not fit a BIGINT")]
    TokenOutOfRange(FencingToken),
    /// A name or argument was refused before anything was sent.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    /// PostgreSQL failed, or refused the statement.
    #[error("postgres: {0}")]
    Database(#[source] tokio_postgres::Error),
}

/// `"name"`, if `name` is a plain lowercase identifier.
fn quote(field: &'static str, name: &str) -> Result<String, ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(format!("\"{name}\""))
    } else {
        Err(ConfigError::invalid(
            field,
            format!("`{name}` is not a plain identifier (a-z, 0-9, _)"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_update_is_one_fenced_statement_with_quoted_names() {
        let table = FencedTable::new("app.quote_state", "quote_id", "fencing_token").unwrap();
        let statement = table
            .update_statement(&[("status", &"DONE"), ("attempts", &1i32)])
            .unwrap();
        assert_eq!(
            statement,
            "UPDATE \"app\".\"quote_state\" SET \"fencing_token\" = $2, \"status\" = $3, \
             \"attempts\" = $4 WHERE \"quote_id\" = $1 AND \"fencing_token\" <= $2"
        );
    }

    #[test]
    fn names_that_are_not_plain_identifiers_are_refused_naming_the_argument() {
        for (table, id, token, field) in [
            ("quotes; drop table x", "id", "t", "table"),
            ("Quotes", "id", "t", "table"),
            ("a.b.c", "id", "t", "table"),
            ("quotes", "1d", "t", "id_column"),
            ("quotes", "id", "", "token_column"),
            ("quotes", "id", "id", "token_column"),
        ] {
            let error = FencedTable::new(table, id, token).unwrap_err();
            assert_eq!(error.field(), field, "{table} {id} {token}: {error}");
        }
        let table = FencedTable::new("quotes", "id", "t").unwrap();
        for set in [
            &[][..],
            &[("status\"", &1i32 as Param<'_>)][..],
            &[("t", &1i32 as Param<'_>)][..],
            &[("id", &1i32 as Param<'_>)][..],
        ] {
            assert!(matches!(
                table.update_statement(set),
                Err(FenceError::Invalid(e)) if e.field() == "set"
            ));
        }
    }

    #[test]
    fn tokens_past_bigint_are_refused() {
        assert_eq!(to_bigint(FencingToken::new(7)).unwrap(), 7);
        assert!(matches!(
            to_bigint(FencingToken::new(u64::MAX)),
            Err(FenceError::TokenOutOfRange(t)) if t.get() == u64::MAX
        ));
    }
}
