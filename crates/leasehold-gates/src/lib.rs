//! Gates: checks of the conventions that drift when nothing checks them.
//!
//! - `lib.rs`: this map.
//! - `deps.rs`: which crate may depend on which (product crates on no test crate), and
//!   what product crates need to build and publish.
//! - `crate_map.rs`: each backend crate's doc opens with a map of its files.
//! - `doc_lines.rs`: the first line of a doc comment ends a sentence.
//! - `commits.rs`: commit subjects of at most 72 characters.
//!
//! Each module states its rule and finds what breaks it in text it is given;
//! `tests/gates.rs` applies them to the workspace (`./scripts/test` runs it first). The
//! rules are in `CONVENTIONS.md`, marked **gated**.

pub mod commits;
pub mod crate_map;
pub mod deps;
pub mod doc_lines;
