//! Retrospective reward labelling (paper Eq. "retrospective labels"), with
//! per-environment rules and precedence format > invalid > repeat:
//!
//! * `format`  — the model output has no parsable `Action:` line;
//! * `invalid` — the next observation matches one of the environment's
//!   invalid-action patterns;
//! * `repeat`  — the next observation equals the current one, unless the
//!   environment exempts repeats entirely (WebShop) or the command is a no-op
//!   by design (SciWorld `wait` / `wait1`).
use crate::error::{check_len, CoreError, Result};
use crate::StrColumn;
use rayon::prelude::*;
use memchr::memmem;
use std::sync::LazyLock;
use regex::Regex;

/// Marker that starts the command in a ReAct output.
pub const ACTION_MARKER: &str = "Action:";

/// The command of a ReAct output `Thought: ...\nAction: <command>`: the text
/// after the last `Action:` up to the end of that line, trimmed. `None` when
/// there is no marker or the command is empty (a format error).
pub fn parse_action(text: &str) -> Option<&str> {
    // memchr's SIMD searches: str::rfind / find are several times slower on 1M rows
    static FINDER: LazyLock<memmem::FinderRev<'static>> = LazyLock::new(|| memmem::FinderRev::new(ACTION_MARKER));
    let at = FINDER.rfind(text.as_bytes())?;
    let rest = &text[at + ACTION_MARKER.len()..];
    let line = match memchr::memchr(b'\n', rest.as_bytes()) {
        Some(nl) => &rest[..nl],
        None => rest,
    };
    let cmd = line.trim();
    if cmd.is_empty() {
        None
    } else {
        Some(cmd)
    }
}

/// Kind of an auxiliary label; stored as a string column `aux_kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum AuxKind {
    None = 0,
    Format = 1,
    Invalid = 2,
    Repeat = 3,
}

impl AuxKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AuxKind::None => "none",
            AuxKind::Format => "format",
            AuxKind::Invalid => "invalid",
            AuxKind::Repeat => "repeat",
        }
    }
}

/// One invalid-action pattern. Most patterns in practice are literals (`No known action matches
/// that input`) or anchored literals (`^Unknown action`): those are matched with a SIMD substring search or a
/// prefix comparison, exactly what the regex would match; anything else is a regex. A
/// `RegexSet` of the same patterns scans every byte and took 3-4x longer on 1M observations.
// A rule set holds a handful of patterns, built once per labelling run; keeping the finder inline spares the
// per-observation match an indirection, so the enum's size is not worth boxing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
enum Pattern {
    Prefix(String),
    Contains(memmem::Finder<'static>),
    Regex(Regex),
}

/// Characters with a meaning in a regex (`regex_syntax::is_meta_character`).
const META: &[char] = &['\\', '.', '+', '*', '?', '(', ')', '|', '[', ']', '{', '}', '^', '$', '#', '&', '-', '~'];

impl Pattern {
    fn compile(p: &str) -> std::result::Result<Pattern, regex::Error> {
        let (anchored, body) = match p.strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, p),
        };
        if !body.is_empty() && !body.contains(META) {
            return Ok(if anchored {
                Pattern::Prefix(body.to_owned())
            } else {
                Pattern::Contains(memmem::Finder::new(body).into_owned())
            });
        }
        Regex::new(p).map(Pattern::Regex)
    }

    fn is_match(&self, text: &str) -> bool {
        match self {
            Pattern::Prefix(p) => text.starts_with(p.as_str()),
            Pattern::Contains(f) => f.find(text.as_bytes()).is_some(),
            Pattern::Regex(re) => re.is_match(text),
        }
    }
}

/// Uncompiled rules of one environment, as read from `configs/labels.yaml`.
#[derive(Clone, Debug, Default)]
pub struct RuleSpec {
    pub env: String,
    pub r_fmt: f32,
    pub r_inv: f32,
    pub r_repeat: f32,
    /// Regular expressions searched in the next observation.
    pub invalid_patterns: Vec<String>,
    /// Whether an unchanged observation is penalised at all.
    pub repeat_enabled: bool,
    /// Regular expressions that must match the whole command for it to be
    /// exempt from the repeat penalty (no-op actions by design).
    pub repeat_exempt_commands: Vec<String>,
}

/// Compiled rules.
#[derive(Clone, Debug)]
pub struct Rules {
    pub env: String,
    pub r_fmt: f32,
    pub r_inv: f32,
    pub r_repeat: f32,
    invalid: Vec<Pattern>,
    repeat_enabled: bool,
    exempt: Vec<Regex>,
}

impl Rules {
    pub fn compile(spec: &RuleSpec) -> Result<Rules> {
        let bad = |problem: String| CoreError::Rules { env: spec.env.clone(), problem };
        for (name, x) in [("r_fmt", spec.r_fmt), ("r_inv", spec.r_inv), ("r_repeat", spec.r_repeat)] {
            if !x.is_finite() {
                return Err(bad(format!("{name} must be finite, got {x}")));
            }
        }
        let invalid = spec
            .invalid_patterns
            .iter()
            .map(|p| Pattern::compile(p).map_err(|e| bad(format!("invalid_patterns: {e}"))))
            .collect::<Result<Vec<_>>>()?;
        let exempt = spec
            .repeat_exempt_commands
            .iter()
            .map(|p| Regex::new(&format!("^(?:{p})$")).map_err(|e| bad(format!("repeat_exempt_commands: {e}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Rules {
            env: spec.env.clone(),
            r_fmt: spec.r_fmt,
            r_inv: spec.r_inv,
            r_repeat: spec.r_repeat,
            invalid,
            repeat_enabled: spec.repeat_enabled,
            exempt,
        })
    }

    /// Label one step.
    pub fn label(&self, action: &str, observation: &str, next_observation: &str) -> (f32, AuxKind) {
        let cmd = match parse_action(action) {
            None => return (self.r_fmt, AuxKind::Format),
            Some(c) => c,
        };
        if self.invalid.iter().any(|p| p.is_match(next_observation)) {
            return (self.r_inv, AuxKind::Invalid);
        }
        if self.repeat_enabled
            && observation.trim() == next_observation.trim()
            && !self.exempt.iter().any(|re| re.is_match(cmd))
        {
            return (self.r_repeat, AuxKind::Repeat);
        }
        (0.0, AuxKind::None)
    }
}

/// Label every row. `env_code[i]` indexes `rules` (the environment of row i).
pub fn label_steps<A, O, N>(
    action: &A,
    observation: &O,
    next_observation: &N,
    env_code: &[u32],
    rules: &[Rules],
) -> Result<(Vec<f32>, Vec<AuxKind>)>
where
    A: StrColumn + ?Sized,
    O: StrColumn + ?Sized,
    N: StrColumn + ?Sized,
{
    let n = action.len();
    check_len("observation", n, observation.len())?;
    check_len("next_observation", n, next_observation.len())?;
    check_len("env", n, env_code.len())?;
    if let Some(&bad) = env_code.iter().find(|&&c| c as usize >= rules.len()) {
        return Err(CoreError::Value { what: "env".into(), problem: format!("no rules for environment code {bad}") });
    }
    // each worker fills its block of both outputs in place (collecting (reward, kind) pairs and
    // unzipping them cost as much as the labelling on 1M short steps)
    const BLOCK: usize = 8192;
    let mut reward = vec![0.0f32; n];
    let mut kind = vec![AuxKind::None; n];
    reward.par_chunks_mut(BLOCK).zip(kind.par_chunks_mut(BLOCK)).enumerate().for_each(|(b, (rs, ks))| {
        for (j, (r_out, k_out)) in rs.iter_mut().zip(ks.iter_mut()).enumerate() {
            let i = b * BLOCK + j;
            let r = &rules[env_code[i] as usize];
            // A null action is a format error; null observations compare as "".
            let act = if action.is_null(i) { "" } else { action.get(i) };
            let obs = if observation.is_null(i) { "" } else { observation.get(i) };
            let nxt = if next_observation.is_null(i) { "" } else { next_observation.get(i) };
            (*r_out, *k_out) = r.label(act, obs, nxt);
        }
    });
    Ok((reward, kind))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sciworld() -> Rules {
        Rules::compile(&RuleSpec {
            env: "sciworld".into(),
            r_fmt: -0.3,
            r_inv: -0.2,
            r_repeat: -0.1,
            invalid_patterns: vec!["No known action matches that input".into()],
            repeat_enabled: true,
            repeat_exempt_commands: vec!["wait1?".into()],
        })
        .unwrap()
    }

    #[test]
    fn parse() {
        assert_eq!(parse_action("Thought: x\nAction: open door"), Some("open door"));
        assert_eq!(parse_action("Action: a\nAction:  b  \nmore"), Some("b"));
        assert_eq!(parse_action("Thought: no action"), None);
        assert_eq!(parse_action("Action:   \n"), None);
        assert_eq!(parse_action("Action:look"), Some("look"));
    }

    #[test]
    fn precedence_and_exemptions() {
        let r = sciworld();
        // format beats everything
        assert_eq!(r.label("no marker", "o", "No known action matches that input."), (-0.3, AuxKind::Format));
        // invalid beats repeat
        let inv = "No known action matches that input.";
        assert_eq!(r.label("Action: fly", inv, inv), (-0.2, AuxKind::Invalid));
        assert_eq!(r.label("Action: look around", "room", "room"), (-0.1, AuxKind::Repeat));
        assert_eq!(r.label("Action: wait1", "room", "room"), (0.0, AuxKind::None));
        assert_eq!(r.label("Action: wait", "room", "room"), (0.0, AuxKind::None));
        // exemption matches the whole command only
        assert_eq!(r.label("Action: wait for it", "room", "room"), (-0.1, AuxKind::Repeat));
        assert_eq!(r.label("Action: look around", "room", "hall"), (0.0, AuxKind::None));
    }

    #[test]
    fn repeat_disabled() {
        let r = Rules::compile(&RuleSpec { env: "webshop".into(), r_fmt: -0.3, repeat_enabled: false, ..Default::default() }).unwrap();
        assert_eq!(r.label("Action: click[x]", "same", "same"), (0.0, AuxKind::None));
    }

    #[test]
    fn bad_regex() {
        let e = Rules::compile(&RuleSpec { env: "x".into(), invalid_patterns: vec!["(".into()], ..Default::default() });
        assert!(matches!(e, Err(CoreError::Rules { .. })));
    }

    #[test]
    fn batch_and_codes() {
        let rules = vec![sciworld()];
        let act = vec!["Action: look", "nothing"];
        let obs = vec!["a", "b"];
        let nxt = vec!["a", "c"];
        let (r, k) = label_steps(&act, &obs, &nxt, &[0, 0], &rules).unwrap();
        assert_eq!(r, vec![-0.1, -0.3]);
        assert_eq!(k, vec![AuxKind::Repeat, AuxKind::Format]);
        assert!(label_steps(&act, &obs, &nxt, &[0, 1], &rules).is_err());
    }

    /// The literal fast paths match exactly what the regex matches.
    #[test]
    fn literal_patterns_equal_their_regex() {
        let patterns = ["No known action", "^Unknown action", "^Could not ", "Nothing happens.", "^Nothing happens\\.",
                        "^Invalid action!?", "a|b", "^", "x$", "Über"];
        let texts = ["", "No known action matches that input", "Unknown action: go", "an Unknown action",
                     "Could not find", "Could notfind", "Nothing happens.", "Nothing happensX", "Invalid action!",
                     "a", "b", "xx", "x\n", "Über alles", "no known action"];
        for p in patterns {
            let fast = Pattern::compile(p).unwrap();
            let re = Regex::new(p).unwrap();
            for t in texts {
                assert_eq!(fast.is_match(t), re.is_match(t), "pattern {p:?} on {t:?}");
            }
        }
        assert!(matches!(Pattern::compile("No known action").unwrap(), Pattern::Contains(_)));
        assert!(matches!(Pattern::compile("^Unknown action").unwrap(), Pattern::Prefix(_)));
        assert!(matches!(Pattern::compile("Nothing happens.").unwrap(), Pattern::Regex(_)));
    }

    #[test]
    fn parse_action_takes_the_last_marker() {
        assert_eq!(parse_action("Action: a\nThought: Action: b \nx"), Some("b"));
        assert_eq!(parse_action("Action:\nAction: c"), Some("c"));
        assert_eq!(parse_action("ActionAction: d"), Some("d"));
        assert_eq!(parse_action("Action: é\n"), Some("é"));
    }
}
