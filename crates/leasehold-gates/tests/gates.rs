//! The gates, applied to this workspace: `./scripts/test` runs them before everything else.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::path::{Path, PathBuf};
use std::process::Command;

use leasehold_gates::{commits, crate_map, deps, doc_lines};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `.rs` files under `dir`, relative to it, `/`-separated, sorted.
fn rust_files(dir: &Path) -> Vec<String> {
    fn walk(dir: &Path, base: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, base, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path.strip_prefix(base).unwrap();
                out.push(relative.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

fn fail_with(what: &str, found: &[String]) {
    assert!(found.is_empty(), "{what}:\n  {}", found.join("\n  "));
}

#[test]
fn product_crates_are_publishable_and_depend_on_no_test_crate_nor_test_double() {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    fail_with(
        "product crates must be publishable and must not depend on test crates or turn on test doubles \
         (docs/architecture.md, \"Which crate may depend on which\")",
        &deps::violations(&metadata),
    );
}

#[test]
fn product_crates_build_without_protoc() {
    let mut args = vec![
        "tree",
        "--workspace",
        "--edges",
        "normal,build",
        "--prefix",
        "none",
        "--offline",
    ];
    for test in deps::TEST_CRATES {
        args.extend(["--exclude", test]);
    }
    let out = Command::new(env!("CARGO"))
        .args(&args)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8(out.stdout).unwrap();
    assert!(
        tree.contains("leasehold-etcd"),
        "the tree holds the product crates"
    );
    fail_with(
        "product crates must build without `protoc` (check generated code in instead)",
        &deps::protoc_builds(&tree),
    );
}

#[test]
fn each_backend_crate_doc_opens_with_a_map_of_its_files() {
    let mut found = Vec::new();
    for name in crate_map::BACKENDS {
        let src = root().join("crates").join(name).join("src");
        let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
        for why in crate_map::violations(&lib, &rust_files(&src)) {
            found.push(format!("crates/{name}/src/lib.rs: {why}"));
        }
    }
    fail_with("crate maps (CONVENTIONS.md, Docs)", &found);
}

#[test]
fn the_first_line_of_every_doc_comment_ends_a_sentence() {
    let crates = root().join("crates");
    let mut found = Vec::new();
    let mut pending: Vec<&str> = doc_lines::PENDING.iter().map(|(path, _)| *path).collect();
    for file in rust_files(&crates) {
        let path = format!("crates/{file}");
        let source = std::fs::read_to_string(crates.join(&file)).unwrap();
        let breaches = doc_lines::violations(&source);
        if let Some(i) = pending.iter().position(|p| *p == path) {
            pending.remove(i);
            if breaches.is_empty() {
                found.push(format!("{path} keeps the rule now: take it off PENDING"));
            }
            continue;
        }
        for (line, text) in breaches {
            found.push(format!("{path}:{line}: {text}"));
        }
    }
    for gone in pending {
        found.push(format!("{gone} is in PENDING but not in the workspace"));
    }
    fail_with(
        "doc comments whose first line does not end a sentence (CONVENTIONS.md, Docs)",
        &found,
    );
}

/// Runs git in the workspace; its output if it succeeded.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root())
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn commit_subjects_fit_in_72_characters() {
    let base = commits::BASE;
    let skip = |why: &str| eprintln!("commit subjects not checked: {why}");
    if git(&["rev-parse", "--is-inside-work-tree"]).is_none() {
        return skip("not a git checkout");
    }
    if git(&["cat-file", "-e", &format!("{base}^{{commit}}")]).is_none() {
        return skip(&format!("{base} is not in this clone's history (shallow?)"));
    }
    if git(&["merge-base", "--is-ancestor", base, "HEAD"]).is_none() {
        return skip(&format!("HEAD does not descend from {base}"));
    }
    let log = git(&["log", "--format=%h %s", &format!("{base}..HEAD")]).unwrap();
    fail_with(
        &format!("commit subjects over {} characters", commits::MAX),
        &commits::violations(&log),
    );
}
