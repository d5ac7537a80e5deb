//! Feeds arbitrary bytes to the frame decoder as a stream of frames, with default and tight
//! limits. Any panic, hang or unbounded allocation is a bug.
#![no_main]

use kvtier_core::protocol::{FrameBody, HEADER_BYTES, Limits, decode_frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let tight = Limits {
        max_meta_bytes: 256,
        max_keys: 8,
        max_payload_bytes: 4096,
    };
    for limits in [Limits::default(), tight] {
        let mut rest = data;
        while let Ok((frame, used)) = decode_frame(rest, &limits) {
            let (h, body, payload) = frame;
            assert_eq!(payload.len() as u64, h.payload_len);
            // The encoding is canonical: what decoded re-encodes to the same bytes.
            let meta = &rest[HEADER_BYTES..HEADER_BYTES + h.meta_len as usize];
            let again = match &body {
                FrameBody::Request(r) => r.encode_meta(),
                FrameBody::Response(r) => r.encode_meta().1,
            };
            assert_eq!(again, meta);
            if used == 0 {
                break;
            }
            rest = &rest[used..];
        }
    }
});
