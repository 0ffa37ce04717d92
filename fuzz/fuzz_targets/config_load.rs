//! The config loader on arbitrary files: every input is a config or a list of errors, never a
//! panic; every error names the file; a loaded config's routes can all be described.

#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use sentinel_gateway::config::Config;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match Config::from_source(Path::new("fuzz.toml"), &text, None) {
        Ok(config) => {
            for route in &config.routes {
                let line = sentinel_gateway::cli::describe(route);
                assert!(line.starts_with(route.policy.endpoint_id.as_str()));
            }
        }
        Err(errors) => {
            assert!(!errors.0.is_empty(), "an invalid config says why");
            for e in &errors.0 {
                assert_eq!(e.file, Path::new("fuzz.toml"));
            }
        }
    }
});
