//! A strict reader of Prometheus's text exposition format (version 0.0.4), for tests that
//! must fail when a `/metrics` page is malformed. Parsers made for scraping skip what they
//! cannot read; this one names the first line that breaks the format: a line that is not
//! `# HELP`, `# TYPE` or a sample with a float value, a second `TYPE` for a family, a
//! family whose lines are split by another's, a series given twice, a histogram whose
//! buckets are not cumulative or whose `+Inf` bucket is not its `_count`.

use std::collections::{BTreeMap, HashMap, HashSet};

/// One sample line: its metric name, labels (sorted) and value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A page that passed [`check_exposition`].
#[derive(Debug, Clone, Default)]
pub struct Exposition {
    pub samples: Vec<Sample>,
    /// Each family's TYPE.
    pub types: HashMap<String, String>,
}

impl Exposition {
    /// The value of the sample `name` whose labels include `labels` (the largest when
    /// several match); for a histogram, its `_count`.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let count = format!("{name}_count");
        let name = if self.types.get(name).is_some_and(|t| t == "histogram") { count.as_str() } else { name };
        self.samples
            .iter()
            .filter(|s| {
                s.name == name && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .reduce(f64::max)
    }
}

/// Checks `text` strictly and returns what it holds, or what is wrong, naming the line.
pub fn check_exposition(text: &str) -> Result<Exposition, String> {
    let mut types: HashMap<String, String> = HashMap::new();
    let mut helps: HashSet<String> = HashSet::new();
    // Families in the order their lines appear; one that appears again after another's
    // lines is split.
    let mut done: HashSet<String> = HashSet::new();
    let mut current: Option<String> = None;
    let mut series: HashSet<(String, BTreeMap<String, String>)> = HashSet::new();
    let mut samples = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let at = |why: String| format!("line {}: {why}: {line:?}", i + 1);
        if line.trim().is_empty() {
            continue;
        }
        let family = if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (keyword, name) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
            if !matches!(keyword, "HELP" | "TYPE") {
                return Err(at("a comment other than HELP or TYPE".into()));
            }
            if !valid_name(name) {
                return Err(at("a comment names no valid metric".into()));
            }
            match keyword {
                "HELP" => {
                    if !helps.insert(name.to_owned()) {
                        return Err(at(format!("a second HELP for {name}")));
                    }
                }
                "TYPE" => {
                    let kind = parts.next().unwrap_or_default();
                    if !matches!(kind, "counter" | "gauge" | "histogram" | "summary" | "untyped") {
                        return Err(at(format!("unknown type {kind:?}")));
                    }
                    if types.insert(name.to_owned(), kind.to_owned()).is_some() {
                        return Err(at(format!("a second TYPE for {name}")));
                    }
                    if samples.iter().any(|s: &Sample| family_of(&s.name, &types) == name) {
                        return Err(at(format!("TYPE for {name} after its samples")));
                    }
                }
                _ => return Err(at("a comment other than HELP or TYPE".into())),
            }
            name.to_owned()
        } else if line.starts_with('#') {
            return Err(at("a comment other than HELP or TYPE".into()));
        } else {
            let sample = parse_sample(line).map_err(at)?;
            if !series.insert((sample.name.clone(), sample.labels.clone())) {
                return Err(at("a series given twice".into()));
            }
            let family = family_of(&sample.name, &types).to_owned();
            samples.push(sample);
            family
        };
        if current.as_deref() != Some(family.as_str()) {
            if done.contains(&family) {
                return Err(at(format!("family {family} is split by another's lines")));
            }
            if let Some(previous) = current.replace(family.clone()) {
                done.insert(previous);
            }
        }
    }
    for (name, kind) in &types {
        if kind == "histogram" {
            check_histogram(name, &samples)?;
        }
    }
    Ok(Exposition { samples, types })
}

/// The family a sample belongs to: a histogram's or summary's `_bucket`, `_sum` and
/// `_count` belong to the name its TYPE gives.
fn family_of<'a>(name: &'a str, types: &HashMap<String, String>) -> &'a str {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix) {
            if types.get(base).is_some_and(|t| t == "histogram" || t == "summary") {
                return base;
            }
        }
    }
    name
}

/// Every series of histogram `name`: buckets that only grow with `le`, a `+Inf` bucket equal
/// to `_count`, and a `_sum`.
fn check_histogram(name: &str, samples: &[Sample]) -> Result<(), String> {
    let mut buckets: BTreeMap<BTreeMap<String, String>, Vec<(f64, f64)>> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.name == format!("{name}_bucket")) {
        let mut labels = s.labels.clone();
        let le = labels.remove("le").ok_or_else(|| format!("{name}_bucket without le: {s:?}"))?;
        let le = parse_float(&le).ok_or_else(|| format!("{name}_bucket le {le:?} is not a float"))?;
        buckets.entry(labels).or_default().push((le, s.value));
    }
    if buckets.is_empty() {
        return Err(format!("histogram {name} has no buckets"));
    }
    let find = |suffix: &str, labels: &BTreeMap<String, String>| {
        samples.iter().find(|s| s.name == format!("{name}{suffix}") && s.labels == *labels).map(|s| s.value)
    };
    for (labels, mut list) in buckets {
        list.sort_by(|a, b| a.0.total_cmp(&b.0));
        if list.windows(2).any(|w| w[1].1 < w[0].1) {
            return Err(format!("histogram {name}{labels:?}: buckets are not cumulative: {list:?}"));
        }
        let inf = list.last().filter(|(le, _)| *le == f64::INFINITY).map(|(_, v)| *v);
        let count = find("_count", &labels);
        if inf.is_none() || inf != count {
            return Err(format!("histogram {name}{labels:?}: +Inf bucket {inf:?} is not _count {count:?}"));
        }
        if find("_sum", &labels).is_none() {
            return Err(format!("histogram {name}{labels:?} has no _sum"));
        }
    }
    Ok(())
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn parse_float(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

/// `name{label="value",...} value [timestamp]`.
fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(['{', ' ']).ok_or("a sample without a value")?;
    let name = &line[..name_end];
    if !valid_name(name) {
        return Err(format!("{name:?} is not a metric name"));
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices().peekable();
        loop {
            // A label name, `=`, a quoted value with \\, \" and \n escapes, then `,` or `}`.
            let start = match chars.peek() {
                Some((_, '}')) => {
                    chars.next();
                    break;
                }
                Some((i, _)) => *i,
                None => return Err("unterminated labels".into()),
            };
            let mut end = start;
            for (i, c) in chars.by_ref() {
                if c == '=' {
                    end = i;
                    break;
                }
            }
            let key = &inner[start..end];
            if !valid_name(key) || key.contains(':') {
                return Err(format!("{key:?} is not a label name"));
            }
            if chars.next().map(|(_, c)| c) != Some('"') {
                return Err(format!("label {key} has no quoted value"));
            }
            let mut value = String::new();
            loop {
                match chars.next().map(|(_, c)| c) {
                    Some('\\') => match chars.next().map(|(_, c)| c) {
                        Some('\\') => value.push('\\'),
                        Some('"') => value.push('"'),
                        Some('n') => value.push('\n'),
                        other => return Err(format!("label {key}: bad escape {other:?}")),
                    },
                    Some('"') => break,
                    Some('\n') | None => return Err(format!("label {key}: unterminated value")),
                    Some(c) => value.push(c),
                }
            }
            if labels.insert(key.to_owned(), value).is_some() {
                return Err(format!("label {key} given twice"));
            }
            match chars.next().map(|(_, c)| c) {
                Some(',') => {}
                Some('}') => break,
                other => return Err(format!("after label {key}: {other:?}")),
            }
        }
        let consumed = chars.peek().map_or(inner.len(), |(i, _)| *i);
        rest = &inner[consumed..];
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or("a sample without a value")?;
    let value = parse_float(value).ok_or_else(|| format!("{value:?} is not a float"))?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().map_err(|_| format!("{ts:?} is not a timestamp"))?;
    }
    if fields.next().is_some() || !rest.starts_with(' ') {
        return Err("a sample line must be `name{labels} value [timestamp]`".into());
    }
    Ok(Sample { name: name.to_owned(), labels, value })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "# HELP a_total A.\n# TYPE a_total counter\na_total{k=\"v\\\"x\"} 3\na_total 1\n\
        # HELP h Latency.\n# TYPE h histogram\nh_bucket{le=\"0.1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 0.3\nh_count 2\n\
        g NaN\n";

    #[test]
    fn a_well_formed_page_passes_and_every_break_is_named() {
        let page = check_exposition(GOOD).expect("well formed");
        assert_eq!(page.samples.len(), 7);
        assert_eq!(page.samples[0].labels["k"], "v\"x");
        assert_eq!(page.value("a_total", &[("k", "v\"x")]), Some(3.0));
        assert_eq!(page.value("h", &[]), Some(2.0));
        let broken = |text: &str, says: &str| {
            let why = check_exposition(text).expect_err(text);
            assert!(why.contains(says), "{text:?}: {why}");
        };
        broken("a_total three\n", "not a float");
        broken("a_total{k=v} 1\n", "no quoted value");
        broken("garbage line\n", "not a float");
        broken("# TYPE a counter\n# TYPE a gauge\n", "second TYPE");
        broken("a 1\nb 1\na{x=\"1\"} 2\n", "split");
        broken("a 1\na 2\n", "twice");
        broken("# comment\n", "other than HELP or TYPE");
        broken("a 1\n# TYPE a gauge\n", "after its samples");
        broken(
            "# TYPE h histogram\nh_bucket{le=\"1\"} 3\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 2\n",
            "cumulative",
        );
        broken(
            "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 3\n",
            "_count",
        );
        broken("# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_count 2\n", "no _sum");
    }
}
