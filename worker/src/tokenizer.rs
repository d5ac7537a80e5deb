//! A byte-level tokenizer: ids 0..=255 are the bytes, then BOS and EOS. Enough for a
//! random-weight model and for prefix hashing; a Hugging Face tokenizer comes with real models.

use crate::error::{Result, WorkerError};

#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub const BOS: u32 = 256;
    pub const EOS: u32 = 257;
    pub const VOCAB_SIZE: usize = 258;

    /// UTF-8 bytes of `text`, after a BOS when `add_bos`.
    pub fn encode(&self, text: &str, add_bos: bool) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() + 1);
        if add_bos {
            ids.push(Self::BOS);
        }
        ids.extend(text.bytes().map(u32::from));
        ids
    }

    /// Text of `ids`, skipping BOS/EOS; byte sequences that are not UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            match u8::try_from(id) {
                Ok(b) => bytes.push(b),
                Err(_) if id == Self::BOS || id == Self::EOS => {}
                Err(_) => {
                    return Err(WorkerError::TokenOutOfVocab {
                        id,
                        vocab_size: Self::VOCAB_SIZE,
                    });
                }
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_text() {
        let t = ByteTokenizer;
        for text in ["", "hello", "naïve café 🦀", "line\nbreak\0nul"] {
            let ids = t.encode(text, true);
            assert_eq!(ids[0], ByteTokenizer::BOS);
            assert_eq!(ids.len(), text.len() + 1);
            assert_eq!(t.decode(&ids).unwrap(), text);
            assert_eq!(t.decode(&t.encode(text, false)).unwrap(), text);
        }
    }

    #[test]
    fn specials_are_skipped_and_unknown_ids_rejected() {
        let t = ByteTokenizer;
        assert_eq!(t.decode(&[104, 257, 105]).unwrap(), "hi");
        assert!(matches!(
            t.decode(&[104, 258]),
            Err(WorkerError::TokenOutOfVocab { id: 258, .. })
        ));
        // A split multi-byte character decodes lossily rather than failing.
        assert_eq!(t.decode(&[0xC3]).unwrap(), "\u{FFFD}");
    }
}
