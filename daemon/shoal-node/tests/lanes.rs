//! Security review F1 on three real nodes (QUIC and mDNS on 127.0.0.1): a member's key
//! speaking the membership protocol straight to the leader (what a node whose machine
//! was taken over can do) writes its own entries and nothing else: not another member's
//! offer, not a placement, however it labels the proposal; an owner's action made on a
//! member (the admin password set there) shows in every node's activity log with that
//! member's name; and a session made on one node's admin page is not good on another.

mod common;
use common::*;
use shoal_membership::node::CreatePolicy;
use shoal_membership::wire::{write_msg, AdminRequest, AdminResponse};
use shoal_membership::{Change, Msg, Proposal};
use shoal_net::{alpn, Node, TransportOptions, TrustedKeys};
use shoal_types::NodeId;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// Options for a node with its HTTP API (and admin page) on a port of its choosing.
fn with_http() -> shoal_node::Options {
    shoal_node::Options { http: Some("127.0.0.1:0".parse().unwrap()), ..Default::default() }
}

/// The base URL of the node in `dir`'s HTTP API.
fn url(dir: &Path) -> String {
    let file = dir.join(shoal_node::http::HTTP_FILE);
    format!("http://{}", std::fs::read_to_string(file).unwrap().trim())
}

/// The entries under `prefix` as `node` holds them.
async fn entries(node: &TestNode, prefix: &str) -> BTreeMap<String, serde_json::Value> {
    match node.admin(AdminRequest::Entries { prefix: prefix.into() }).await {
        AdminResponse::Entries(e) => e.into_iter().collect(),
        other => panic!("entries: {other:?}"),
    }
}

/// Log in on the admin page at `base` with `password`; the session cookie.
fn login(base: &str, password: &str) -> Result<String, String> {
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let body = serde_json::json!({ "password": password }).to_string();
    let r = agent
        .post(&format!("{base}/admin/api/login"))
        .header("content-type", "application/json")
        .send(body)
        .map_err(|e| e.to_string())?;
    if r.status() != 200 {
        return Err(format!("login: {}", r.status()));
    }
    let cookie = r.headers().get("set-cookie").ok_or("no cookie")?.to_str().map_err(|e| e.to_string())?;
    Ok(cookie.split(';').next().unwrap_or_default().to_string())
}

/// GET `path` at `base` with `cookie`: the status and the body.
fn get(base: &str, path: &str, cookie: &str) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut r = agent.get(&format!("{base}{path}")).header("cookie", cookie).call().unwrap();
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_key_writes_only_its_own_entries_and_owner_actions_are_logged_everywhere() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let names = ["alpha", "beta", "gamma"];
    let a = start(&dir("alpha"), "alpha", CreatePolicy::Now, with_http());
    wait_for("alpha's cluster", 10, || async { a.status().await.cluster }).await;
    let b = start(&dir("beta"), "beta", CreatePolicy::Never, with_http());
    join(&a, &b).await;
    let c = start(&dir("gamma"), "gamma", CreatePolicy::Never, with_http());
    join(&a, &c).await;
    let mut nodes = vec![a, b, c];
    let leader = wait_for("three members and a leader everyone knows", 30, || async {
        let mut leaders = Vec::new();
        for n in &nodes {
            let s = n.status().await;
            if s.members.len() != 3 {
                return None;
            }
            leaders.push(s.leader?);
        }
        leaders.windows(2).all(|w| w[0] == w[1]).then(|| leaders[0])
    })
    .await;
    // The leader, the member that will act, and the third.
    let l = nodes.iter().position(|n| n.id == leader).unwrap();
    let m = (l + 1) % 3;
    let o = (l + 2) % 3;
    let ids: Vec<NodeId> = nodes.iter().map(|n| n.id).collect();
    wait_for("every node's offer", 20, || async { (entries(&nodes[l], "offer/").await.len() == 3).then_some(()) })
        .await;

    // An owner's action on the member: the admin password, as `shoal password` sets it
    // there. Every node's activity log names the member.
    let password = "a long admin password";
    let record = shoal_admin::AuthRecord::new(password, 1).unwrap();
    let value = serde_json::to_value(&record).unwrap();
    match nodes[m].admin(AdminRequest::Put { key: shoal_admin::AUTH_KEY.into(), value }).await {
        AdminResponse::Ok(_) => {}
        other => panic!("setting the password on {}: {other:?}", names[m]),
    }
    let want = format!("{}: set the admin password", names[m]);
    let mut sessions = Vec::new();
    for n in &nodes {
        let base = url(&n.dir);
        let b2 = base.clone();
        let cookie = wait_for("a login on every node", 20, move || {
            let base = b2.clone();
            async move { tokio::task::spawn_blocking(move || login(&base, password).ok()).await.unwrap() }
        })
        .await;
        let (b2, c2, w2) = (base.clone(), cookie.clone(), want.clone());
        wait_for("the owner's action in every node's activity log", 20, move || {
            let (base, cookie, want) = (b2.clone(), c2.clone(), w2.clone());
            async move {
                tokio::task::spawn_blocking(move || {
                    let (status, body) = get(&base, "/admin/api/overview", &cookie);
                    assert_eq!(status, 200, "{body}");
                    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                    let events = v["events"].as_array().cloned().unwrap_or_default();
                    events.iter().any(|e| e["kind"] == "owner" && e["text"] == want.as_str()).then_some(())
                })
                .await
                .unwrap()
            }
        })
        .await;
        sessions.push((base, cookie));
    }
    // Each node's session is its own: the record every member holds makes no other's.
    for (i, (base, _)) in sessions.iter().enumerate() {
        for (j, (_, cookie)) in sessions.iter().enumerate() {
            let (base, cookie) = (base.clone(), cookie.clone());
            let (status, _) =
                tokio::task::spawn_blocking(move || get(&base, "/admin/api/overview", &cookie)).await.unwrap();
            assert_eq!(status == 200, i == j, "{}'s page with {}'s session: {status}", names[i], names[j]);
        }
    }

    // The member stops; its key speaks to the leader directly (a machine taken over).
    let leader_addr: std::net::SocketAddr = nodes[l].status().await.addr.parse().unwrap();
    let (member_id, other_id, member_dir) = (ids[m], ids[o], nodes[m].dir.clone());
    let (leader_node, _other) = {
        let member = nodes.remove(m);
        member.stop().await;
        let l = nodes.iter().position(|n| n.id == leader).unwrap();
        let o = 1 - l;
        (&nodes[l], &nodes[o])
    };
    let before = entries(leader_node, "").await;
    let identity = std::sync::Arc::new(shoal_net::Identity::load_or_create(&member_dir).unwrap());
    let endpoint = Node::bind(
        "127.0.0.1:0".parse().unwrap(),
        identity,
        TrustedKeys::new(ids.iter().copied()),
        &TransportOptions::default(),
    )
    .unwrap();
    let conn = endpoint.connect(leader_addr, leader, alpn::MEMBERSHIP).await.unwrap();
    let put = |key: String, value: serde_json::Value| Change::Put { key, value };
    let forged_offer = serde_json::json!({ "memory_bytes": 1, "gpus": [] });
    let own_offer = serde_json::json!({ "memory_bytes": 4242, "gpus": [] });
    let placement = serde_json::json!({ "model": "x" });
    let (other_offer, own_key) = (format!("offer/{other_id}"), format!("offer/{member_id}"));
    let proposals = [
        Proposal::Own(put(other_offer.clone(), forged_offer.clone())),
        // (The other member puts its own offer back when it sees it changed; a speed
        // entry of its stays as written.)
        Proposal::Own(put(format!("speed/{other_id}/forged"), serde_json::json!({ "ms_per_layer": 1e-9 }))),
        Proposal::Owner { action: "forged".into(), change: put(other_offer.clone(), forged_offer) },
        Proposal::Lead(put("placement/forged".into(), placement.clone())),
        Proposal::Owner { action: "forged".into(), change: put("placement/forged2".into(), placement) },
        Proposal::Own(put("settings/api_open".into(), serde_json::json!(true))),
        Proposal::Own(put(own_key.clone(), own_offer.clone())),
    ];
    for (req, proposal) in proposals.into_iter().enumerate() {
        let mut s = conn.open_uni().await.unwrap();
        write_msg(&mut s, &Msg::Forward { req: 9000 + req as u64, proposal }).await.unwrap();
        s.finish().unwrap();
    }
    // Its own offer is taken (sent last: the others reached the leader before it).
    wait_for("the member's own offer at the leader", 20, || async {
        (entries(leader_node, "offer/").await.get(&own_key) == Some(&own_offer)).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = entries(leader_node, "").await;
    assert_eq!(after.get(&other_offer), before.get(&other_offer), "another member's offer changed");
    assert_eq!(after.get(&format!("offer/{leader}")), before.get(&format!("offer/{leader}")));
    assert_eq!(after.get(shoal_admin::AUTH_KEY), before.get(shoal_admin::AUTH_KEY));
    let forged: Vec<&String> = after
        .keys()
        .filter(|k| k.starts_with("placement/") || k.starts_with("settings/") || k.ends_with("/forged"))
        .collect();
    assert!(forged.is_empty(), "forged entries taken: {forged:?}");
    endpoint.close();
    drop(nodes);
}
