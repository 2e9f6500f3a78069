//! Files (DESIGN §12): upload throughput of 1 MiB and 20 MiB images (sniffed, decoded,
//! scaled when larger than the model is sent, stored, metadata committed through the
//! writer), beside writing the same bytes straight to the same kind of blob store; and
//! what one 1 MiB image adds to a turn before the upstream call (its bytes read from the
//! store and sent as a data URL), beside the same turn without it.

use std::io::Cursor;
use std::time::Instant;

use bytes::Bytes;
use serde_json::json;
use turnlog_ingress::files::{Blobs, Part};
use turnlog_ingress::turn::TurnLimits;
use uuid::Uuid;

use crate::ingress::{p50, unix_us};
use crate::system::{Settings, System};

const TURNS: usize = 30;

/// A PNG of noise (it does not compress) of about `bytes` bytes, different per `seed`.
fn noise_png(bytes: usize, seed: u64) -> Vec<u8> {
    let side = ((bytes / 3) as f64).sqrt() as u32;
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    let img = image::RgbImage::from_fn(side, side, |_, _| {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let v = (state >> 33) as u32;
        image::Rgb([v as u8, (v >> 8) as u8, (v >> 16) as u8])
    });
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).expect("encoding a PNG");
    out.into_inner()
}

fn multipart(name: &str, bytes: &[u8]) -> (String, Vec<u8>) {
    let boundary = "turnlog-bench-7f1e";
    let mut body =
        format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\r\n")
            .into_bytes();
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

async fn upload(sys: &System, name: &str, bytes: &[u8]) -> anyhow::Result<String> {
    let (content_type, body) = multipart(name, bytes);
    let resp = sys
        .http
        .post(format!("{}/v1/files", sys.base))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await?;
    let status = resp.status();
    let json: serde_json::Value = resp.json().await?;
    anyhow::ensure!(status.as_u16() == 201, "upload refused: {status} {json}");
    json["id"].as_str().map(str::to_owned).ok_or_else(|| anyhow::anyhow!("no file id: {json}"))
}

/// MB/s of uploading `files` one after another, and of putting the same bytes straight
/// into a blob store of the same kind.
async fn throughput(sys: &System, files: &[Vec<u8>], direct: &Blobs) -> anyhow::Result<(f64, f64)> {
    let total: usize = files.iter().map(Vec::len).sum();
    let mb = total as f64 / 1e6;
    let t0 = Instant::now();
    for (i, f) in files.iter().enumerate() {
        upload(sys, &format!("bench-{i}.png"), f).await?;
    }
    let through = mb / t0.elapsed().as_secs_f64();
    let (t0, owner) = (Instant::now(), turnlog_core::ids::Owner::parse("bench")?);
    for f in files {
        direct.put(&owner, Uuid::now_v7(), Part::Original, Bytes::from(f.clone())).await?;
    }
    Ok((through, mb / t0.elapsed().as_secs_f64()))
}

/// Time from the POST to the mock receiving the model request, for a first turn in a new
/// session, with `images` attached.
async fn turn(sys: &System, text: &str, images: &[String]) -> anyhow::Result<f64> {
    let session = sys.create_session().await?;
    let body = json!({"text": text, "images": images});
    let sent = unix_us();
    let resp =
        sys.http.post(format!("{}/v1/sessions/{session}/messages", sys.base)).json(&body).send().await?;
    anyhow::ensure!(resp.status().is_success(), "turn refused: {}", resp.status());
    resp.bytes().await?;
    let received = sys
        .mock
        .log()
        .entries()
        .iter()
        .rev()
        .find(|r| r.raw.contains(text))
        .map(|r| r.received_at_us)
        .ok_or_else(|| anyhow::anyhow!("the mock did not log the model request"))?;
    Ok(received.saturating_sub(sent) as f64 / 1e3)
}

pub(crate) async fn run() -> anyhow::Result<()> {
    let sys = System::start(Settings {
        model: "mock",
        windows: vec![],
        system_prompt: "You are terse.",
        turn_limits: TurnLimits::default(),
    })
    .await?;
    let direct_dir = sys.files_dir.with_extension("direct");
    let direct = Blobs::open(&format!("file://{}", direct_dir.display()))?;

    let small: Vec<Vec<u8>> = (0..20).map(|i| noise_png(1 << 20, i)).collect();
    let large: Vec<Vec<u8>> = (0..4).map(|i| noise_png(19 << 20, 100 + i)).collect();
    let (small_mb_s, small_direct) = throughput(&sys, &small, &direct).await?;
    let (large_mb_s, large_direct) = throughput(&sys, &large, &direct).await?;
    println!(
        "upload, 1 MiB PNGs ({} px a side, not scaled): {small_mb_s:.1} MB/s   (baseline, the same bytes put \
         straight into the store: {small_direct:.1} MB/s)",
        image::load_from_memory(&small[0])?.width()
    );
    println!(
        "upload, 19 MiB PNGs ({} px a side, scaled to 1536): {large_mb_s:.1} MB/s   (baseline: {large_direct:.1} MB/s)",
        image::load_from_memory(&large[0])?.width()
    );

    let image = upload(&sys, "turn.png", &small[0]).await?;
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for i in 0..TURNS {
        // Alternated, so both see the same machine.
        with.push(turn(&sys, &format!("with image {i} [mock words=5]"), std::slice::from_ref(&image)).await?);
        without.push(turn(&sys, &format!("without image {i} [mock words=5]"), &[]).await?);
    }
    let (with, without) = (p50(with), p50(without));
    println!(
        "turn before the upstream call, p50 of {TURNS}: {with:.2} ms with one 1 MiB image   (baseline, the same \
         turn without it: {without:.2} ms; added {:.2} ms)",
        with - without
    );
    println!(
        "RESULT files upload_mb_s={small_mb_s:.1} upload_mb_s_20mib={large_mb_s:.1} direct_mb_s={small_direct:.1} \
         direct_mb_s_20mib={large_direct:.1} image_turn_pre_upstream_p50_ms={with:.2} \
         text_turn_pre_upstream_p50_ms={without:.2} image_added_ms={:.2}",
        with - without
    );
    let _ = std::fs::remove_dir_all(&direct_dir);
    sys.stop().await
}
