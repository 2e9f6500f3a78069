//! turnlog's token counts equal OpenAI's reference tokenizer on a committed fixture
//! (made by fixtures/make_token_fixture.py with Python tiktoken's o200k_base).

use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    encoding: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    text: String,
    count: usize,
    ids: Vec<u32>,
}

#[test]
fn counts_equal_python_tiktoken_o200k_base() {
    let raw = include_str!("fixtures/token_counts.json");
    let fixture: Fixture = serde_json::from_str(raw).expect("fixture parses");
    assert_eq!(fixture.encoding, "o200k_base");
    assert!(fixture.cases.len() >= 8);
    for case in &fixture.cases {
        let ids = turnlog_core::tokens::encode(&case.text);
        assert_eq!(ids, case.ids, "token ids differ for case {}", case.name);
        assert_eq!(
            turnlog_core::tokens::count(&case.text) as usize,
            case.count,
            "count differs for {}",
            case.name
        );
    }
}
