//! Generates bindings to UCX's UCP API from the system headers (Debian: libucx-dev) with
//! bindgen; links the libraries pkg-config names. Needs libclang at build time.

fn main() {
    let ucx = pkg_config::Config::new()
        .atleast_version("1.10")
        .probe("ucx")
        .unwrap_or_else(|e| {
            panic!(
                "UCX not found by pkg-config ({e}); install it with .ci/install-deps (libucx-dev)"
            )
        });
    let mut builder = bindgen::Builder::default()
        .header_contents("wrapper.h", "#include <ucp/api/ucp.h>\n")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_.*")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .allowlist_var("UCP_API_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder
        .generate()
        .unwrap_or_else(|e| panic!("bindgen over ucp.h failed: {e}"));
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("ucp.rs"))
        .unwrap_or_else(|e| panic!("writing the bindings: {e}"));
}
