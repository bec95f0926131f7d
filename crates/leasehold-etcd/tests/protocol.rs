//! The checked-in protocol code is what `proto/etcd.proto` generates.
//!
//! The generator is pure Rust (protox compiles the file, tonic-prost-build writes the
//! messages and clients), so building leasehold needs no `protoc`. After changing the
//! proto file, run this test with `LEASEHOLD_REGENERATE=1` to write the new code.

use std::path::Path;

#[test]
fn the_checked_in_protocol_code_is_what_the_proto_file_generates() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let descriptors = protox::compile(["etcd.proto"], [crate_dir.join("proto")])
        .expect("proto/etcd.proto compiles");
    let out = tempfile::tempdir().expect("a temporary directory");
    tonic_prost_build::configure()
        .build_server(false)
        .build_transport(false)
        .out_dir(out.path())
        .compile_fds(descriptors)
        .expect("the code generates");
    let generated =
        std::fs::read_to_string(out.path().join("etcdserverpb.rs")).expect("generated code");
    let checked_in = crate_dir.join("src/rpc/etcdserverpb.rs");
    if std::env::var_os("LEASEHOLD_REGENERATE").is_some() {
        std::fs::write(&checked_in, &generated).expect("the checked-in code is writable");
        return;
    }
    let current = std::fs::read_to_string(&checked_in).unwrap_or_default();
    assert!(
        current == generated,
        "src/rpc/etcdserverpb.rs is not what proto/etcd.proto generates: run \
         `LEASEHOLD_REGENERATE=1 cargo test -p leasehold-etcd --test protocol` and commit it"
    );
}
