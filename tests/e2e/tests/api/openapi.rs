//! `/v1/openapi.json` is a well-formed OpenAPI 3 document that lists exactly the routes
//! the server serves, and each listed operation is really routed.

use std::collections::BTreeSet;

use reqwest::Method;
use serde_json::Value;
use turnlog_e2e::api::{Api, Body, ALICE};

/// Every operation the ingress serves today.
const SERVED: &[(&str, &str)] = &[
    ("post", "/v1/sessions"),
    ("get", "/v1/sessions"),
    ("get", "/v1/sessions/{id}"),
    ("patch", "/v1/sessions/{id}"),
    ("delete", "/v1/sessions/{id}"),
    ("get", "/v1/sessions/{id}/events"),
    ("get", "/v1/sessions/{id}/context"),
    ("get", "/v1/sessions/{id}/requests/{seq}"),
    ("post", "/v1/sessions/{id}/permissions/{perm_id}"),
    ("post", "/v1/sessions/{id}/fork"),
    ("post", "/v1/sessions/{id}/messages"),
    ("post", "/v1/chat"),
    ("get", "/v1/sessions/{id}/export"),
    ("post", "/v1/import"),
    ("post", "/v1/files"),
    ("get", "/v1/files"),
    ("get", "/v1/files/{id}"),
    ("delete", "/v1/files/{id}"),
    ("get", "/v1/files/{id}/content"),
    ("post", "/v1/sessions/{id}/stop"),
    ("post", "/v1/conversations"),
    ("get", "/v1/conversations/{id}"),
    ("post", "/v1/conversations/{id}"),
    ("delete", "/v1/conversations/{id}"),
    ("get", "/v1/conversations/{id}/items"),
    ("post", "/v1/conversations/{id}/items"),
    ("get", "/v1/conversations/{id}/items/{item_id}"),
    ("delete", "/v1/conversations/{id}/items/{item_id}"),
    ("post", "/v1/responses"),
    ("get", "/v1/responses/{id}"),
    ("post", "/v1/responses/{id}/cancel"),
    ("get", "/v1/responses/{id}/input_items"),
    ("post", "/v1/chat/completions"),
    ("get", "/v1/models"),
    ("post", "/v1/sessions/{id}/retry"),
    ("post", "/v1/sessions/{id}/tool_results"),
    ("get", "/v1/sessions/{id}/stream"),
    ("get", "/v1/search"),
    ("get", "/v1/memories"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
    ("get", "/v1/openapi.json"),
];

const METHODS: [&str; 8] = ["get", "put", "post", "delete", "options", "head", "patch", "trace"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_document_lists_every_served_route() {
    let api = Api::start().await;
    let r = api.call(Method::GET, "/v1/openapi.json", None, Body::None).await;
    assert_eq!(r.status, 200);
    assert!(r.headers["content-type"].to_str().unwrap().starts_with("application/json"));
    let doc: Value = serde_json::from_str(&r.text).expect("the document is JSON");
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{}", doc["openapi"]);
    assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());

    let mut listed = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().unwrap() {
            if !METHODS.contains(&method.as_str()) {
                continue;
            }
            assert!(
                op["responses"].as_object().is_some_and(|r| !r.is_empty()),
                "{method} {path} has no responses"
            );
            listed.insert((method.clone(), path.clone()));
        }
    }
    let served: BTreeSet<(String, String)> =
        SERVED.iter().map(|(m, p)| (m.to_string(), p.to_string())).collect();
    assert_eq!(listed, served);

    // Every reference resolves, and every authenticated route names the bearer scheme.
    let schemas = &doc["components"]["schemas"];
    let mut refs = Vec::new();
    collect_refs(&doc, &mut refs);
    assert!(!refs.is_empty());
    for r in refs {
        let name = r.strip_prefix("#/components/schemas/").unwrap_or_else(|| panic!("unexpected $ref {r}"));
        assert!(schemas.get(name).is_some(), "dangling $ref {r}");
    }
    assert!(doc["components"]["securitySchemes"]["bearer"].is_object());
    for (method, path) in &listed {
        let op = &doc["paths"][path][method];
        let public = ["/healthz", "/readyz", "/metrics", "/v1/openapi.json"].contains(&path.as_str());
        assert_eq!(op.get("security").is_some(), !public, "{method} {path}: security");
    }

    // Each listed operation is routed: never the router's "no such route" or a 405.
    let id = api.create(ALICE, None).await;
    for (method, path) in &listed {
        let concrete = path.replace("{id}", &id.to_string()).replace("{perm_id}", "p1").replace("{seq}", "1");
        let method = Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
        let r = api.call(method.clone(), &concrete, Some(ALICE), Body::None).await;
        assert_ne!(r.status, 405, "{method} {concrete}");
        assert_ne!(r.json["error"]["message"], "no such route", "{method} {concrete} is not served");
    }
}

fn collect_refs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(o) => {
            for (k, v) in o {
                match (k.as_str(), v) {
                    ("$ref", Value::String(s)) => out.push(s.clone()),
                    _ => collect_refs(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| collect_refs(v, out)),
        _ => {}
    }
}
