//! Decoding whatever bytes sit at an entry's key never panics, and whatever decodes
//! encodes back to the same entry.

#![no_main]

use libfuzzer_sys::fuzz_target;
use stampede_guard::fuzzing::decode;

fuzz_target!(|data: &[u8]| {
    if let Ok(entry) = decode(data) {
        let again = decode(&entry.encode()).expect("a decoded entry re-encodes");
        assert_eq!(again, entry);
    }
});
