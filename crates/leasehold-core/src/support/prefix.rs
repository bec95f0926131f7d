//! The key prefix a backend puts before every key it writes.

use crate::error::{Error, Result};

/// Checks a backend's key prefix.
/// It is 1–64 of `A-Z a-z 0-9 _ - . :` — no `/` and no hash-tag braces, so that names under
/// it cannot reach into other prefixes.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for any other prefix.
pub fn check_key_prefix(prefix: &str) -> Result<()> {
    let valid = !prefix.is_empty()
        && prefix.len() <= 64
        && prefix
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c));
    if valid {
        Ok(())
    } else {
        Err(Error::invalid(
            "key prefix",
            format!("{prefix:?} is not 1-64 of A-Z a-z 0-9 _ - . :"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_prefixes_are_checked() {
        assert!(check_key_prefix("leasehold").is_ok());
        assert!(check_key_prefix("app:v2.locks_x-1").is_ok());
        for bad in ["", "a/b", "a{b}", "a b", &"x".repeat(65)] {
            assert!(
                matches!(check_key_prefix(bad), Err(Error::InvalidArgument { .. })),
                "{bad:?}"
            );
        }
    }
}
