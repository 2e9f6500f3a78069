//! `turnlog-bench recall`: what one turn's recall costs Postgres in a large store. One
//! owner's 20,000 memories (names, places and things from small vocabularies, and the words
//! every sentence has), 200 questions over them, on a private Postgres, one at a time:
//! - `common`: as the ingress recalls, after ANALYZE, with the memories' common words;
//! - `every_word` (the baseline): with none, so the memories sharing any word with the
//!   question are candidates — recall before issue 43's change, and still before
//!   autovacuum's first ANALYZE of the memories.
//!
//! Prints the Postgres CPU and the wall time of a recall in each, and how often the two
//! agree on the first memory recalled.

use std::sync::Arc;
use std::time::Instant;

use turnlog_core::ids::Owner;
use turnlog_runtime::read::{recall_relevant, CommonWords};
use turnlog_testkit::{free_port, private_nats, private_postgres, test_env_on};
use uuid::Uuid;

use crate::cpu::{Meter, Part};

const MEMORIES: i64 = 20_000;
const QUESTIONS: usize = 200;
const RECALLED: i64 = 5;
const NAMES: [&str; 12] =
    ["Maria", "Jonas", "Lena", "Omar", "Priya", "Tomas", "Aiko", "Bruno", "Chloe", "Dmitri", "Elif", "Farid"];
const PLACES: [&str; 8] = ["Lisbon", "Porto", "Berlin", "Osaka", "Lagos", "Quito", "Oslo", "Perth"];
const THINGS: [&str; 10] =
    ["invoice", "contract", "garden", "concert", "flight", "dentist", "budget", "roof", "exam", "wedding"];

pub(crate) async fn run() -> anyhow::Result<()> {
    let (pg, nats) = (private_postgres(free_port()).await, private_nats(free_port()).await);
    let env = test_env_on(Some(&pg.url()), Some(&nats.url())).await;
    let pool = &env.pool;
    let owner = Owner::parse("alice")?;
    let session = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO sessions (id, owner, last_seq, created_at, updated_at, active_at)
         VALUES ($1, $2, 0, now(), now(), now())",
    )
    .bind(session)
    .bind(owner.as_str())
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO memories (id, owner, session_id, turn_seq, text, created_at)
         SELECT gen_random_uuid(), $1, $2, g,
                format('%s said the %s in %s is on the %s of the month and costs %s euros.',
                       ($4::text[])[1 + g % 12], ($6::text[])[1 + (g / 12) % 10], ($5::text[])[1 + (g / 7) % 8],
                       1 + g % 28, 10 * (g % 997)),
                now() - g * interval '1 second'
           FROM generate_series(1, $3) g",
    )
    .bind(owner.as_str())
    .bind(session)
    .bind(MEMORIES)
    .bind(&NAMES[..])
    .bind(&PLACES[..])
    .bind(&THINGS[..])
    .execute(pool)
    .await?;
    sqlx::query("ANALYZE memories").execute(pool).await?;
    let words = Arc::new(CommonWords::default());
    words.refresh(pool).await?;
    let common = words.current(pool);
    anyhow::ensure!(!common.is_empty(), "no common words after ANALYZE");
    let questions: Vec<String> = (0..QUESTIONS)
        .map(|i| {
            format!(
                "What did {} tell me about the {} in {}, the one for {} euros?",
                NAMES[i % 12],
                THINGS[(i / 12) % 10],
                PLACES[(i / 5) % 8],
                10 * ((i * 37) % 997)
            )
        })
        .collect();

    let meter = Meter::new(vec![("postgres", Part::postgres(&pg))]);
    let mut figures = Vec::new();
    let mut firsts: Vec<Vec<Uuid>> = Vec::new();
    for (name, common) in [("every_word", Arc::from([])), ("common", common.clone())] {
        let started = Instant::now();
        let (first, spent) = meter
            .measure(async {
                let mut first = Vec::new();
                for q in &questions {
                    let got = recall_relevant(pool, &owner, q, RECALLED, &common).await?;
                    first.push(got.first().map_or(Uuid::nil(), |m| m.id));
                }
                anyhow::Ok(first)
            })
            .await;
        let wall_us = started.elapsed().as_secs_f64() * 1e6 / QUESTIONS as f64;
        let cpu_us = spent.total() * 1e6 / QUESTIONS as f64;
        println!("recall, {name}: {cpu_us:.0} µs of Postgres CPU, {wall_us:.0} µs wall a recall");
        figures.push(format!("recall_cpu_us_{name}={cpu_us:.0} recall_wall_us_{name}={wall_us:.0}"));
        firsts.push(first?);
    }
    let same = firsts[0].iter().zip(&firsts[1]).filter(|(a, b)| a == b).count();
    println!(
        "{MEMORIES} memories of one owner, {} common words, {QUESTIONS} questions; the same first memory in {same}",
        common.len()
    );
    env.cleanup().await;
    drop((pg, nats));
    println!("RESULT recall {} memories={MEMORIES} same_first={same}", figures.join(" "));
    Ok(())
}
