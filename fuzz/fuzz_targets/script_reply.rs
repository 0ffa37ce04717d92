//! The limiter scripts' reply parser, read on every limited request, on arbitrary bytes:
//! never a panic; what it accepts is six space-separated integers.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sentinel_gateway::decision::ScriptReply;

fuzz_target!(|data: &[u8]| {
    if let Some(reply) = ScriptReply::parse(data) {
        assert_eq!(data.split(|b| *b == b' ').count(), 6);
        assert!(data.iter().all(|b| b.is_ascii_digit() || *b == b' ' || *b == b'-'));
        let _ = reply.allowed;
    }
});
