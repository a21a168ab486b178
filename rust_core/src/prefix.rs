//! Tokenised prefix indexing: tokenise a rendered transcript once and find the
//! token index of the last token of each of its prefixes.
//!
//! Input per sequence: the full rendered text `F` and the (character) end
//! offsets `e_k` of the prefix renders `P_k = F[..e_k]` (the Python layer
//! renders the chat template and checks that every prefix render is a prefix
//! of the full render). Output per prefix: `len(encode(P_k)) - 1`, the slow
//! reference's position, computed from the single encoding of `F`.
//!
//! Exactness check (per prefix; a failure marks the sequence `ok = false` and
//! the caller falls back to the exact slow path for it):
//! 1. the full encoding has a token boundary at `e_k` (no token straddles it;
//!    `n` tokens end at or before it);
//! 2. the text from the end of the last *added* (special) token before the
//!    boundary up to `e_k` encodes on its own to exactly the full encoding's
//!    tokens over that span. Added tokens split the input into segments that
//!    are normalised, pre-tokenised and merged independently, so the encoding
//!    of `P_k` is the full encoding's tokens up to that added token followed by
//!    this tail encoding; the check therefore proves `encode(P_k) == ids[..n]`.
//!
//! The tokenizer runs with `add_special_tokens = false` and without its
//! post-processor (which only adds special tokens / trims offsets).
use crate::error::{CoreError, Result};
use crate::StrColumn;
use rayon::prelude::*;
use std::collections::HashSet;
use tokenizers::Tokenizer;

pub struct PrefixIndexer {
    tok: Tokenizer,
    added: HashSet<u32>,
}

/// Positions (one per prefix end, `-1` where a sequence failed the check),
/// the token length of each sequence and whether its check passed.
#[derive(Debug, Default, PartialEq)]
pub struct IndexOutput {
    pub positions: Vec<i32>,
    pub seq_len: Vec<i32>,
    pub ok: Vec<bool>,
}

fn value_err(what: &str, problem: impl ToString) -> CoreError {
    CoreError::Value {
        what: what.to_string(),
        problem: problem.to_string(),
    }
}

/// Byte offsets of the given (non-decreasing) character offsets in `text`.
pub fn char_to_byte_offsets(text: &str, char_ends: &[i64]) -> Result<Vec<usize>> {
    let mut out = Vec::with_capacity(char_ends.len());
    let mut it = text.char_indices();
    let mut chars_seen: i64 = 0;
    let mut byte_pos: usize = 0;
    let mut prev = 0i64;
    for &e in char_ends {
        if e < prev {
            return Err(value_err("prefix ends", format!("not non-decreasing ({e} after {prev})")));
        }
        prev = e;
        while chars_seen < e {
            match it.next() {
                Some((_, c)) => {
                    byte_pos += c.len_utf8();
                    chars_seen += 1;
                }
                None => {
                    return Err(value_err(
                        "prefix ends",
                        format!("end {e} beyond the text length {chars_seen} characters"),
                    ))
                }
            }
        }
        out.push(byte_pos);
    }
    Ok(out)
}

impl PrefixIndexer {
    /// Load from the JSON of a `tokenizer.json`.
    pub fn from_json(json: &str) -> Result<Self> {
        let mut tok: Tokenizer = json
            .parse()
            .map_err(|e| value_err("tokenizer.json", e))?;
        tok.with_post_processor(None::<tokenizers::PostProcessorWrapper>);
        tok.with_truncation(None).map_err(|e| value_err("tokenizer", e))?;
        tok.with_padding(None);
        let added = tok.get_added_tokens_decoder().keys().copied().collect();
        Ok(Self { tok, added })
    }

    /// Token ids of one text (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tok
            .encode(text, false)
            .map_err(|e| value_err("tokenize", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of many texts, in parallel.
    pub fn encode_many<C: StrColumn + ?Sized>(&self, texts: &C) -> Result<Vec<Vec<u32>>> {
        (0..texts.len())
            .into_par_iter()
            .map(|i| self.encode(texts.get(i)))
            .collect()
    }

    /// Index one sequence: `Ok(Some(positions), len)` or `Ok(None, len)` when the check fails.
    pub fn index_one(&self, text: &str, char_ends: &[i64]) -> Result<(Option<Vec<i32>>, usize)> {
        let byte_ends = char_to_byte_offsets(text, char_ends)?;
        let enc = self
            .tok
            .encode(text, false)
            .map_err(|e| value_err("tokenize", e))?;
        let ids = enc.get_ids();
        let offs = enc.get_offsets();
        let n_tok = ids.len();
        // token ends must be non-decreasing for the boundary search
        if offs.windows(2).any(|w| w[1].1 < w[0].1) {
            return Ok((None, n_tok));
        }
        let mut positions = Vec::with_capacity(byte_ends.len());
        for &e in &byte_ends {
            let n = offs.partition_point(|o| o.1 <= e);
            if n == 0 || (n < n_tok && offs[n].0 < e) {
                return Ok((None, n_tok));
            }
            // last added token before the boundary: the tail starts after it
            let anchor = (0..n).rev().find(|&i| self.added.contains(&ids[i]));
            let (start_tok, start_byte) = match anchor {
                Some(a) => (a + 1, offs[a].1),
                None => (0, 0),
            };
            if start_byte > e {
                return Ok((None, n_tok));
            }
            let tail = &text[start_byte..e];
            let same = if tail.is_empty() {
                start_tok == n
            } else {
                self.encode(tail)? == ids[start_tok..n]
            };
            if !same {
                return Ok((None, n_tok));
            }
            positions.push((n - 1) as i32);
        }
        Ok((Some(positions), n_tok))
    }

    /// Index many sequences in parallel. `end_offsets` (length `n + 1`) slices
    /// `char_ends` per sequence.
    pub fn index<C: StrColumn + ?Sized>(
        &self,
        texts: &C,
        char_ends: &[i64],
        end_offsets: &[i64],
    ) -> Result<IndexOutput> {
        let n = texts.len();
        crate::check_offsets(end_offsets, char_ends.len())?;
        if end_offsets.len() != n + 1 {
            return Err(CoreError::Length {
                column: "end_offsets".into(),
                expected: n + 1,
                got: end_offsets.len(),
            });
        }
        let results: Vec<(Option<Vec<i32>>, usize)> = (0..n)
            .into_par_iter()
            .map(|i| {
                if texts.is_null(i) {
                    return Err(value_err("text", format!("row {i} is null")));
                }
                let (a, b) = (end_offsets[i] as usize, end_offsets[i + 1] as usize);
                self.index_one(texts.get(i), &char_ends[a..b])
            })
            .collect::<Result<_>>()?;
        let mut out = IndexOutput {
            positions: Vec::with_capacity(char_ends.len()),
            seq_len: Vec::with_capacity(n),
            ok: Vec::with_capacity(n),
        };
        for (i, (pos, len)) in results.into_iter().enumerate() {
            let want = (end_offsets[i + 1] - end_offsets[i]) as usize;
            match pos {
                Some(p) => {
                    out.positions.extend_from_slice(&p);
                    out.ok.push(true);
                }
                None => {
                    out.positions.extend(std::iter::repeat_n(-1, want));
                    out.ok.push(false);
                }
            }
            out.seq_len.push(len as i32);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny word-level tokenizer with one added token, as JSON.
    fn tiny_json() -> String {
        r#"{"version":"1.0","truncation":null,"padding":null,
        "added_tokens":[{"id":0,"content":"<e>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
        "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
        "model":{"type":"WordLevel","vocab":{"<e>":0,"a":1,"b":2,"ab":3,"[UNK]":4},"unk_token":"[UNK]"}}"#
            .to_string()
    }

    #[test]
    fn char_offsets_to_bytes() {
        assert_eq!(char_to_byte_offsets("aé b", &[0, 2, 4]).unwrap(), vec![0, 3, 5]);
        assert!(char_to_byte_offsets("ab", &[3]).is_err());
        assert!(char_to_byte_offsets("ab", &[2, 1]).is_err());
    }

    #[test]
    fn positions_match_prefix_encodings() {
        let ix = PrefixIndexer::from_json(&tiny_json()).unwrap();
        let text = "a b<e>ab a<e>";
        // prefixes: "a b<e>" (3 tokens), "a b<e>ab a" (5), full (6)
        let out = ix.index(&vec![text], &[6, 10, 13], &[0, 3]).unwrap();
        assert_eq!(out.positions, vec![2, 4, 5]);
        assert_eq!(out.seq_len, vec![6]);
        assert_eq!(out.ok, vec![true]);
        for (k, &e) in [6usize, 10, 13].iter().enumerate() {
            assert_eq!(ix.encode(&text[..e]).unwrap().len() as i32 - 1, out.positions[k]);
        }
    }

    #[test]
    fn prefix_inside_a_token_is_detected() {
        let ix = PrefixIndexer::from_json(&tiny_json()).unwrap();
        // "a" is a prefix of the word "ab": the full encoding has no boundary there
        let out = ix.index(&vec!["ab<e>"], &[1, 5], &[0, 2]).unwrap();
        assert_eq!(out.ok, vec![false]);
        assert_eq!(out.positions, vec![-1, -1]);
    }

    #[test]
    fn bad_offsets_are_errors() {
        let ix = PrefixIndexer::from_json(&tiny_json()).unwrap();
        assert!(ix.index(&vec!["a"], &[1], &[0, 2]).is_err());
        assert!(ix.index(&vec!["a"], &[9], &[0, 1]).is_err());
        assert!(PrefixIndexer::from_json("{not json").is_err());
    }
}
