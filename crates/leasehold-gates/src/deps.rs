//! Which crate may depend on which: a product crate never on a test crate or test double.
//!
//! The product crates are what users link: core, the backends, the facade, the checker
//! behind `leasehold chaos`, the fault proxy, the CLI. Every workspace crate not named in
//! [`TEST_CRATES`] is one. A product crate may have the test crates as dev-dependencies
//! only, and never turns on another crate's `test-util` feature (core's test doubles,
//! `Faulty` and `ManualClock`) outside of them — except through a feature of its own
//! called `test-util`, which forwards the opt-in to its users' dev-dependencies.
//! A product crate is publishable: not `publish = false`, and every workspace crate it
//! depends on is named with a version as well as a path (a path alone cannot be published).

use serde_json::Value;

/// The test and development crates; every other workspace crate is a product crate.
pub const TEST_CRATES: &[&str] = &[
    "leasehold-bench",
    "leasehold-chaos-harness",
    "leasehold-gates",
    "leasehold-testkit",
];

/// The feature that turns on test doubles.
pub const TEST_FEATURE: &str = "test-util";

/// Build-time code generators that run `protoc`: none may be in a product crate's build.
pub const RUN_PROTOC: &[&str] = &[
    "prost-build",
    "tonic-build",
    "tonic-prost-build",
    "protobuf-codegen",
];

/// The crates of `tree` that run `protoc` at build time, one message each.
///
/// `tree` is the output of `cargo tree --edges normal,build --prefix none` over the product
/// crates: one package per line, its name first.
pub fn protoc_builds(tree: &str) -> Vec<String> {
    let mut found: Vec<String> = tree
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| RUN_PROTOC.contains(name))
        .map(|name| format!("{name} is built for a product crate: building it needs `protoc`"))
        .collect();
    found.dedup();
    found
}

/// Breaches of the rule in `metadata`, one message each.
///
/// `metadata` is the output of `cargo metadata --no-deps --format-version 1`: the
/// workspace's packages with the dependencies and features their manifests declare.
pub fn violations(metadata: &Value) -> Vec<String> {
    let mut found = Vec::new();
    let packages = metadata["packages"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    let names: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    for test in TEST_CRATES {
        if !names.contains(test) {
            found.push(format!(
                "TEST_CRATES names {test}, which is not a crate of the workspace"
            ));
        }
    }
    for package in packages {
        let Some(name) = package["name"].as_str() else {
            continue;
        };
        if TEST_CRATES.contains(&name) {
            continue;
        }
        if package["publish"].as_array().is_some_and(Vec::is_empty) {
            found.push(format!(
                "{name} is `publish = false`, but a product crate must be publishable"
            ));
        }
        let dependencies = package["dependencies"]
            .as_array()
            .map_or(&[][..], Vec::as_slice);
        for dependency in dependencies {
            let kind = dependency["kind"].as_str().unwrap_or("normal");
            if kind == "dev" {
                continue;
            }
            let on = dependency["name"].as_str().unwrap_or("?");
            if dependency["path"].is_string() && dependency["req"].as_str() == Some("*") {
                found.push(format!(
                    "{name} depends on {on} by path alone: give it a version too, or it \
                     cannot be published"
                ));
            }
            if TEST_CRATES.contains(&on) {
                found.push(format!(
                    "{name} has a {kind} dependency on {on}, a test crate (a dev-dependency at most)"
                ));
            }
            let features = dependency["features"]
                .as_array()
                .map_or(&[][..], Vec::as_slice);
            if features.iter().any(|f| f.as_str() == Some(TEST_FEATURE)) {
                found.push(format!(
                    "{name} turns on {on}'s `{TEST_FEATURE}` feature (test doubles) in a {kind} dependency"
                ));
            }
        }
        let Some(own) = package["features"].as_object() else {
            continue;
        };
        for (feature, enables) in own {
            if feature == TEST_FEATURE {
                continue;
            }
            let enables = enables.as_array().map_or(&[][..], Vec::as_slice);
            for enabled in enables.iter().filter_map(Value::as_str) {
                let target = enabled.rsplit('/').next().unwrap_or(enabled);
                if target == TEST_FEATURE {
                    found.push(format!(
                        "{name}'s feature `{feature}` turns on `{enabled}` (test doubles)"
                    ));
                }
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workspace(extra: Value) -> Value {
        let mut packages: Vec<Value> = TEST_CRATES
            .iter()
            .map(|t| serde_json::json!({"name": t, "dependencies": [], "features": {}}))
            .collect();
        packages.push(extra);
        serde_json::json!({ "packages": packages })
    }

    fn dependency(name: &str, kind: Option<&str>, features: &[&str]) -> Value {
        serde_json::json!({"name": name, "kind": kind, "features": features, "optional": false})
    }

    #[test]
    fn dev_dependencies_on_test_crates_and_doubles_are_allowed() {
        let cli = serde_json::json!({
            "name": "leasehold-cli",
            "dependencies": [
                dependency("leasehold", None, &[]),
                dependency("leasehold-testkit", Some("dev"), &[]),
                dependency("leasehold", Some("dev"), &["etcd", "test-util"]),
            ],
            "features": {"etcd": ["leasehold/etcd"]},
        });
        assert_eq!(violations(&workspace(cli)), Vec::<String>::new());
    }

    #[test]
    fn a_normal_or_build_dependency_on_a_test_crate_is_found() {
        for kind in [None, Some("build")] {
            let cli = serde_json::json!({
                "name": "leasehold-cli",
                "dependencies": [dependency("leasehold-testkit", kind, &[])],
                "features": {},
            });
            let found = violations(&workspace(cli));
            assert_eq!(found.len(), 1, "{found:?}");
            assert!(found[0].contains("leasehold-testkit"), "{found:?}");
        }
    }

    #[test]
    fn test_doubles_turned_on_outside_dev_dependencies_are_found() {
        let chaos = serde_json::json!({
            "name": "leasehold-chaos",
            "dependencies": [dependency("leasehold-core", None, &["test-util"])],
            "features": {
                "default": ["leasehold/test-util"],
                "test-util": ["leasehold/test-util"],
            },
        });
        let found = violations(&workspace(chaos));
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[0].contains("leasehold-core's `test-util`"),
            "{found:?}"
        );
        assert!(found[1].contains("feature `default`"), "{found:?}");
    }

    #[test]
    fn an_unpublishable_product_crate_is_found() {
        let mut on_chaos = dependency("leasehold-chaos", None, &[]);
        on_chaos["path"] = "/work/crates/leasehold-chaos".into();
        on_chaos["req"] = "*".into();
        let cli = serde_json::json!({
            "name": "leasehold-cli",
            "publish": [],
            "dependencies": [on_chaos],
            "features": {},
        });
        let found = violations(&workspace(cli.clone()));
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].contains("publish = false"), "{found:?}");
        assert!(
            found[1].contains("leasehold-chaos by path alone"),
            "{found:?}"
        );
        let mut fixed = cli;
        fixed["publish"] = Value::Null;
        fixed["dependencies"][0]["req"] = "^0.1.0".into();
        assert_eq!(violations(&workspace(fixed)), Vec::<String>::new());
    }

    #[test]
    fn a_protobuf_compiler_in_the_build_is_found() {
        let tree = "leasehold-etcd v0.1.0 (/w/crates/leasehold-etcd)\nprost v0.14.4\n\
                    etcd-client v0.21.1\ntonic-prost-build v0.14.5\nprost-build v0.14.4\n";
        let found = protoc_builds(tree);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].starts_with("tonic-prost-build"), "{found:?}");
        assert!(protoc_builds("leasehold v0.1.0\nprost v0.14.4 (*)\n").is_empty());
    }

    #[test]
    fn a_test_crate_missing_from_the_workspace_is_found() {
        let metadata = serde_json::json!({"packages": []});
        assert_eq!(violations(&metadata).len(), TEST_CRATES.len());
    }
}
