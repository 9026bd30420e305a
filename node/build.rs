//! Generates the replica-to-replica gossip code from `proto/gossip.proto`.
//!
//! `protoc` comes from the `protoc-bin-vendored` build-dependency (no system package needed); an
//! explicit `PROTOC` environment variable still wins.

use std::error::Error;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn Error>> {
    let protoc: PathBuf = match std::env::var_os("PROTOC") {
        Some(path) => PathBuf::from(path),
        None => protoc_bin_vendored::protoc_bin_path()?,
    };
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_with_config(config, &["proto/gossip.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/gossip.proto");
    println!("cargo:rerun-if-env-changed=PROTOC");
    Ok(())
}
