//! The two exact o200k_base tokenizers side by side: `tiktoken-rs` (OpenAI's tiktoken
//! core behind fancy-regex) and `bpe-openai` (GitHub's rust-gems: a regex-automata
//! pre-tokenizer and a backtracking BPE encoder). Exactness first — both must give the
//! committed fixture's ids (Python tiktoken's) for every case, and the same ids as each
//! other on a synthetic ~1 MB text and on many seeded random strings — then speed: MB/s
//! on the fixture text and on the synthetic text, and the load time of each in a fresh
//! process.

use crate::context::time_per_call;
use std::hint::black_box;
use std::process::Command;
use std::time::{Duration, Instant};

fn tiktoken() -> &'static tiktoken_rs::CoreBPE {
    tiktoken_rs::o200k_base_singleton()
}

fn bpe() -> &'static bpe_openai::Tokenizer {
    bpe_openai::o200k_base()
}

fn tiktoken_ids(text: &str) -> Vec<u32> {
    tiktoken().encode_ordinary(text)
}

fn bpe_ids(text: &str) -> Vec<u32> {
    bpe().encode(text)
}

/// A small deterministic generator (splitmix64), so every run checks the same strings.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a, T: ?Sized>(&mut self, xs: &[&'a T]) -> &'a T {
        xs[self.below(xs.len())]
    }
}

const PROSE: &[&str] = &[
    "The migration runs before the pool is ready, so the first query fails with a timeout.",
    "On 12 March 2024, Dr. Ada Lovelace-Byron promised the report by Friday; she didn't.",
    "We're still waiting — it's 3.14159 times better than 2,718 alternatives, or so they'd claim.",
    "I'LL check it. You've seen the logs? They're in /var/log/turnlog/writer.log (rotated daily).",
    "Les élèves ont déjà étudié l'œuvre de Molière; à bientôt, François!",
    "Straße, Ärger, Übermaß — naïve café résumé coöperate façade.",
    "Привет, мир! Это проверка токенизатора на кириллице, с числами 12345 и точками...",
    "Γειά σου Κόσμε· ἀρχὴ ἥμισυ παντός.",
    "مرحبا بالعالم، هذا اختبار ١٢٣٤٥ للأرقام العربية.",
    "नमस्ते दुनिया, यह एक परीक्षण है।",
    "Order #000123456789 costs $1,234,567.89 (≈ €1.1M) at 2026-11-29T21:23:00Z.",
    "ǅemal Ǉubica ǈ ǋ — titlecase digraphs; ʰʲʷ modifier letters; Ⅻ ⅻ ½ ² ³ ¼.",
];

const CODE: &[&str] = &[
    "fn main() {\n    let xs: Vec<u64> = (1..=10).map(|x| x * x).collect();\n    println!(\"{:?}\", xs);\n}\n",
    "impl<'a> Iterator for Tokens<'a> {\n    type Item = &'a str;\n    fn next(&mut self) -> Option<Self::Item> { self.inner.next() }\n}\n",
    "def f(x):\n\treturn [i ** 2 for i in range(x) if i % 3 == 0]  # squares\n\n\n",
    "SELECT s.id, count(*) FROM session_events e JOIN sessions s ON s.id = e.session_id\n  WHERE e.seq > $1 GROUP BY 1;\n",
    "{\"session_id\": \"0190a0e4-3b1c-7cc1-9a2b-5f0e3d2c1b0a\", \"seq\": 42, \"usage\": {\"input_tokens\": 1234}}\n",
    "<div class=\"msg\"><p>Hello&nbsp;<b>world</b></p></div>\r\n<!-- end -->\r\n",
    "    if (a&&b||!c) { x+=1; y<<=2; z=>w; } // ===\n",
    "path/to/file.rs:120:7 error[E0502]: cannot borrow `x` as mutable\n",
];

const CJK: &[&str] = &[
    "今日は良い天気ですね。",
    "我们明天下午三点在会议室见面讨论项目进度。",
    "한국어도조금섞어봅시다",
    "カタカナとひらがなと漢字、全角スペース　も。",
    "这是一个没有空格的很长的句子用于测试分词器的行为是否一致",
];

const EMOJI: &[&str] = &["🚀", "👨‍👩‍👧‍👦", "🇯🇵🇫🇷", "👍🏽👍🏿", "❤️‍🔥", "🙂🙃😉", "✅ done", "🧪🔬"];

const WHITESPACE: &[&str] =
    &[" ", "  ", "\t", "\n", "\r\n", "\n\n", " \n ", "\u{a0}", "\u{3000}", "\u{2028}", "\u{85}", "\u{200b}"];

/// A run of `n` copies of one whitespace character.
fn ws_run(rng: &mut Rng, n: usize) -> String {
    rng.pick(&[" ", "\t", "\n", "\r", "\u{a0}", "\u{3000}"]).repeat(n)
}

/// About `bytes` bytes of mixed prose, code, CJK, emoji, numbers and whitespace runs.
fn synthetic(bytes: usize, seed: u64) -> String {
    let mut rng = Rng(seed);
    let mut out = String::with_capacity(bytes + 256);
    while out.len() < bytes {
        match rng.below(20) {
            0..=6 => out.push_str(rng.pick(PROSE)),
            7..=11 => out.push_str(rng.pick(CODE)),
            12..=13 => out.push_str(rng.pick(CJK)),
            14 => out.push_str(rng.pick(EMOJI)),
            15 => {
                let n = rng.next() % 10u64.pow(rng.below(13) as u32 + 1);
                out.push_str(&n.to_string());
            }
            16 => {
                let n = 1 + rng.below(40);
                out.push_str(&ws_run(&mut rng, n));
            }
            _ => out.push_str(rng.pick(WHITESPACE)),
        }
        out.push_str(rng.pick(&[" ", " ", "\n", "", "\n\n"]));
    }
    out
}

/// Characters chosen to hit the pre-tokenizer's edges: letter categories (Lu Ll Lt Lm
/// Lo M), numbers (Nd Nl No), apostrophe contractions, punctuation before newlines and
/// slashes, every kind of whitespace.
const ALPHABET: &[&str] = &[
    "a",
    "b",
    "z",
    "A",
    "Q",
    "Z",
    "é",
    "É",
    "ß",
    "ǅ",
    "ʰ",
    "\u{301}",
    "\u{308}",
    "\u{94d}",
    "中",
    "の",
    "한",
    "ا",
    "ж",
    "Ж",
    "0",
    "1",
    "7",
    "9",
    "٣",
    "Ⅻ",
    "½",
    "²",
    "'",
    "'s",
    "'S",
    "'ll",
    "'LL",
    "'re",
    "'ve",
    "'m",
    "'d",
    "'t",
    "’",
    ".",
    ",",
    "!",
    "?",
    "-",
    "_",
    "/",
    "\\",
    "(",
    ")",
    "{",
    "}",
    "<|endoftext|>",
    "#",
    "$",
    "€",
    "—",
    "…",
    "`",
    "\"",
    " ",
    " ",
    " ",
    "\t",
    "\n",
    "\r",
    "\r\n",
    "\u{a0}",
    "\u{3000}",
    "\u{2028}",
    "\u{85}",
    "\u{b}",
    "\u{c}",
    "\u{200b}",
    "\u{feff}",
    "🚀",
    "👍🏽",
    "\u{200d}",
    "🇯",
    "\u{fe0f}",
    "\u{e000}",
    "\u{10ffff}",
    "\u{0}",
];

/// One random string of up to ~`max` pieces: alphabet characters, whitespace and digit
/// runs, words from the synthetic text's sources, and arbitrary Unicode scalars.
fn random_string(rng: &mut Rng, max: usize) -> String {
    let pieces = rng.below(max + 1);
    let mut s = String::new();
    for _ in 0..pieces {
        match rng.below(12) {
            0..=5 => s.push_str(rng.pick(ALPHABET)),
            6 => {
                let longest = if rng.below(8) == 0 { 300 } else { 6 };
                let n = 1 + rng.below(longest);
                s.push_str(&ws_run(rng, n));
            }
            7 => {
                let n = 1 + rng.below(9);
                (0..n).for_each(|_| s.push(char::from(b'0' + rng.below(10) as u8)));
            }
            8 => {
                let source = [PROSE, CODE, CJK, EMOJI][rng.below(4)];
                let src = rng.pick(source);
                let words: Vec<&str> = src.split(' ').collect();
                s.push_str(words[rng.below(words.len())]);
            }
            9 => {
                // Any scalar value: mostly the BMP, sometimes the astral planes.
                let hi = if rng.below(4) == 0 { 0x11_0000 } else { 0x1_0000 };
                if let Some(c) = char::from_u32(rng.below(hi) as u32) {
                    s.push(c);
                }
            }
            10 => s.push(char::from(0x20 + rng.below(0x5f) as u8)),
            _ if rng.below(20) == 0 => {
                // A long piece for the BPE itself: letters (or CJK, or digits and
                // punctuation) with no split point, up to 3,000 characters.
                let chars = rng.pick(&[
                    "abcdefghijklmnopqrstuvwxyz",
                    "中文の한국어",
                    "éèêëàâäôöûüç",
                    "!?.,;:-_=+*&^%$#@~",
                ]);
                let chars: Vec<char> = chars.chars().collect();
                let n = 50 + rng.below(2_950);
                (0..n).for_each(|_| s.push(chars[rng.below(chars.len())]));
            }
            _ => {
                let c = rng.pick(ALPHABET);
                s.push_str(&c.repeat(1 + rng.below(5)));
            }
        }
    }
    s
}

fn mb_s(bytes: usize, per_call: Duration) -> f64 {
    bytes as f64 / per_call.as_secs_f64() / 1e6
}

pub(crate) fn fixture() -> anyhow::Result<Vec<(String, String, Vec<u32>)>> {
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("../../../shared/core/tests/fixtures/token_counts.json"))?;
    anyhow::ensure!(fixture["encoding"] == "o200k_base", "fixture is not o200k_base");
    let cases = fixture["cases"].as_array().ok_or_else(|| anyhow::anyhow!("fixture has no cases"))?;
    cases
        .iter()
        .map(|c| {
            let name = c["name"].as_str().unwrap_or_default().to_string();
            let text =
                c["text"].as_str().ok_or_else(|| anyhow::anyhow!("case {name} has no text"))?.to_string();
            let ids = serde_json::from_value(c["ids"].clone())?;
            Ok((name, text, ids))
        })
        .collect()
}

/// The first place two id sequences part, for the failure message.
fn first_difference(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Random strings checked against each other by [`run`]; the test checks fewer.
pub(crate) const RANDOM_CASES: usize = 200_000;

/// `cases` seeded random strings (and the same number of random slices of a synthetic
/// text) on which the two crates must give the same ids.
pub(crate) fn check_random(cases: usize, seed: u64) -> anyhow::Result<usize> {
    let mut rng = Rng(seed);
    let text = synthetic(200_000, seed ^ 0x5eed);
    let mut bytes = 0;
    for i in 0..cases {
        let s = random_string(&mut rng, if i % 10 == 0 { 400 } else { 40 });
        // A slice of the synthetic text between two char boundaries.
        let (mut a, mut b) = (rng.below(text.len()), rng.below(text.len()));
        if a > b {
            std::mem::swap(&mut a, &mut b);
        }
        b = b.min(a + 1 + rng.below(2_000));
        while !text.is_char_boundary(a) {
            a -= 1;
        }
        while !text.is_char_boundary(b) {
            b += 1;
        }
        for s in [s.as_str(), &text[a..b]] {
            let (t, g) = (tiktoken_ids(s), bpe_ids(s));
            anyhow::ensure!(
                t == g,
                "ids differ on random case {i} at token {}: {s:?}\n tiktoken-rs {t:?}\n bpe-openai  {g:?}",
                first_difference(&t, &g)
            );
            anyhow::ensure!(bpe().count(s) == g.len(), "bpe-openai count differs from its ids on {s:?}");
            bytes += s.len();
        }
    }
    Ok(bytes)
}

/// Resident memory of this process, in kB (Linux): all of it, and its anonymous part (the
/// heap, not the binary's pages).
fn rss_kb() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("RssAnon:"))
}

/// Load time and resident memory (all, anonymous) added by one crate's o200k_base, in a
/// fresh process (median of 3).
fn load(which: &str) -> anyhow::Result<(Duration, u64, u64)> {
    let exe = std::env::current_exe()?;
    let mut runs = Vec::new();
    for _ in 0..3 {
        let out = Command::new(&exe).args(["tokenizer", "--load", which]).output()?;
        anyhow::ensure!(out.status.success(), "load run failed: {}", String::from_utf8_lossy(&out.stderr));
        let out = String::from_utf8(out.stdout)?;
        let mut fields = out.split_whitespace().map(str::parse::<u64>);
        let (Some(Ok(ns)), Some(Ok(kb)), Some(Ok(anon))) = (fields.next(), fields.next(), fields.next())
        else {
            anyhow::bail!("load run printed {out:?}");
        };
        runs.push((Duration::from_nanos(ns), kb, anon));
    }
    runs.sort();
    Ok(runs[1])
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<()> {
    if let [flag, which] = args {
        if flag == "--load" {
            let rss = rss_kb();
            let t = Instant::now();
            let n = match which.as_str() {
                "tiktoken-rs" => tiktoken_ids("hello").len(),
                "bpe-openai" => bpe_ids("hello").len(),
                other => anyhow::bail!("unknown tokenizer {other}"),
            };
            let ns = t.elapsed().as_nanos();
            black_box(n);
            let after = rss_kb();
            println!("{ns} {} {}", after.0.saturating_sub(rss.0), after.1.saturating_sub(rss.1));
            return Ok(());
        }
    }

    // Exactness.
    let cases = fixture()?;
    for (name, text, ids) in &cases {
        anyhow::ensure!(&tiktoken_ids(text) == ids, "tiktoken-rs differs from the fixture on {name}");
        anyhow::ensure!(&bpe_ids(text) == ids, "bpe-openai differs from the fixture on {name}");
    }
    println!("fixture: both crates give Python tiktoken's ids on all {} cases", cases.len());
    let big = synthetic(1_000_000, 21);
    let (t, g) = (tiktoken_ids(&big), bpe_ids(&big));
    anyhow::ensure!(t == g, "ids differ on the synthetic text at token {}", first_difference(&t, &g));
    println!("synthetic: {} bytes, {} tokens, the same ids from both crates", big.len(), t.len());
    let started = Instant::now();
    let bytes = check_random(RANDOM_CASES, 0x7e57)?;
    println!(
        "random: {RANDOM_CASES} strings and {RANDOM_CASES} slices ({:.1} MB), the same ids from both crates ({:.1} s)",
        bytes as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );

    // Speed.
    let fixture_text = cases.iter().map(|(_, text, _)| text.as_str()).collect::<Vec<_>>().join("\n");
    let min = Duration::from_millis(1500);
    let fix_tiktoken = mb_s(fixture_text.len(), time_per_call(min, || tiktoken_ids(&fixture_text).len()));
    let fix_bpe = mb_s(fixture_text.len(), time_per_call(min, || bpe_ids(&fixture_text).len()));
    let fix_bpe_count = mb_s(fixture_text.len(), time_per_call(min, || bpe().count(fixture_text.as_str())));
    let big_tiktoken = mb_s(big.len(), time_per_call(min, || tiktoken_ids(&big).len()));
    let big_bpe = mb_s(big.len(), time_per_call(min, || bpe_ids(&big).len()));
    let big_bpe_count = mb_s(big.len(), time_per_call(min, || bpe().count(big.as_str())));
    let (load_tiktoken, rss_tiktoken, anon_tiktoken) = load("tiktoken-rs")?;
    let (load_bpe, rss_bpe, anon_bpe) = load("bpe-openai")?;

    println!(
        "{:>12} {:>22} {:>22} {:>10} {:>30}",
        "", "fixture text (MB/s)", "synthetic 1 MB (MB/s)", "load", "resident memory added (heap)"
    );
    for (name, fixture, synthetic, load, rss, anon) in [
        ("tiktoken-rs", fix_tiktoken, big_tiktoken, load_tiktoken, rss_tiktoken, anon_tiktoken),
        ("bpe-openai", fix_bpe, big_bpe, load_bpe, rss_bpe, anon_bpe),
    ] {
        println!(
            "{name:>12} {fixture:>22.1} {synthetic:>22.1} {:>7.0} ms {:>19.1} MB ({:.1} MB)",
            load.as_secs_f64() * 1e3,
            rss as f64 / 1e3,
            anon as f64 / 1e3
        );
    }
    println!("{:>12} {:>22.1} {:>22.1}", "(its count)", fix_bpe_count, big_bpe_count);
    println!(
        "RESULT tokenizer tiktoken_fixture_mb_s={fix_tiktoken:.1} bpe_fixture_mb_s={fix_bpe:.1} \
         tiktoken_synthetic_mb_s={big_tiktoken:.1} bpe_synthetic_mb_s={big_bpe:.1} \
         bpe_count_fixture_mb_s={fix_bpe_count:.1} bpe_count_synthetic_mb_s={big_bpe_count:.1} \
         tiktoken_load_ms={:.0} bpe_load_ms={:.0} tiktoken_rss_mb={:.1} bpe_rss_mb={:.1} tiktoken_heap_mb={:.1} bpe_heap_mb={:.1} \
         random_cases={RANDOM_CASES} identical=true",
        load_tiktoken.as_secs_f64() * 1e3,
        load_bpe.as_secs_f64() * 1e3,
        rss_tiktoken as f64 / 1e3,
        rss_bpe as f64 / 1e3,
        anon_tiktoken as f64 / 1e3,
        anon_bpe as f64 / 1e3
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_crates_give_the_fixture_ids() -> anyhow::Result<()> {
        for (name, text, ids) in fixture()? {
            assert_eq!(tiktoken_ids(&text), ids, "tiktoken-rs on {name}");
            assert_eq!(bpe_ids(&text), ids, "bpe-openai on {name}");
        }
        Ok(())
    }

    #[test]
    fn both_crates_agree_on_random_strings() -> anyhow::Result<()> {
        check_random(5_000, 0x5eed_0021)?;
        Ok(())
    }
}
