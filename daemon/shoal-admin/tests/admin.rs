//! The admin routes on 127.0.0.1:0 over a fake node: first-run password, login,
//! sessions (cookie flags, expiry, logout, another cluster's), CSRF, the limit on wrong
//! passwords, requests another site's page could send, and the page's own files; a hub
//! appliance's first-boot setup from the LAN and its system routes (the fake keeps the
//! real appliance folder in a temporary directory, so the files are the real ones).

use shoal_admin::{Action, ActionError, AdminBackend, Appliance, AuthRecord, Config, NodeCard, Overview};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A node of cluster `cluster` whose state holds `record` once set.
struct Fake {
    cluster: Option<String>,
    record: Mutex<Option<AuthRecord>>,
    /// The actions done, in order.
    done: Mutex<Vec<Action>>,
    /// Where uploads go (and the appliance folder, on an appliance).
    uploads: tempfile::TempDir,
    /// A hub appliance's folder, under `uploads`; `None`: a PC.
    appliance: Option<Appliance>,
    /// This node's session secret (each fake has its own, as each node does).
    secret: [u8; 32],
}

impl AdminBackend for Fake {
    fn credentials(&self) -> (Option<String>, Option<AuthRecord>) {
        (self.cluster.clone(), self.record.lock().unwrap().clone())
    }

    fn session_secret(&self) -> [u8; 32] {
        self.secret
    }

    async fn set_credentials(&self, record: AuthRecord) -> Result<(), String> {
        *self.record.lock().unwrap() = Some(record);
        Ok(())
    }

    async fn overview(&self) -> Overview {
        Overview {
            cluster: self.cluster.clone().unwrap_or_default(),
            node: "n1".into(),
            nodes: vec![NodeCard {
                id: "n1".into(),
                name: "alpha".into(),
                state: "online".into(),
                ..NodeCard::default()
            }],
            ..Overview::default()
        }
    }

    fn upload_dir(&self) -> std::path::PathBuf {
        self.uploads.path().join("models")
    }

    fn appliance(&self) -> Option<&Appliance> {
        self.appliance.as_ref()
    }

    async fn act(&self, action: Action) -> Result<serde_json::Value, ActionError> {
        if matches!(
            action,
            Action::ApplianceSettings { .. }
                | Action::ApplianceUpdate
                | Action::ApplianceReset
                | Action::ApplianceReboot
        ) {
            // What the node does: the appliance folder's own code.
            let answer = shoal_admin::appliance::act(self.appliance.as_ref(), action.clone()).await;
            if answer.is_ok() {
                self.done.lock().unwrap().push(action);
            }
            return answer;
        }
        if action == (Action::Remove { node: "nobody".into() }) {
            return Err(ActionError { status: 404, message: "no member nobody".into() });
        }
        if let Action::ModelAdd { path, .. } = &action {
            // What the node's catalog does: the file must be there, whole.
            let bytes = std::fs::read(path).map_err(|e| ActionError { status: 400, message: e.to_string() })?;
            if !bytes.starts_with(b"GGUF") {
                return Err(ActionError { status: 400, message: "not a GGUF file".into() });
            }
        }
        self.done.lock().unwrap().push(action);
        Ok(serde_json::json!({"ok": true}))
    }
}

/// Makes each fake node's session secret its own.
static NEXT_SECRET: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(1);

/// A server for `cluster` with `cfg`; its base URL and the fake.
fn server(cluster: Option<&str>, cfg: Config) -> (String, Arc<Fake>) {
    serve(cluster, cfg, false)
}

/// A hub appliance's server (host name `hubbox`, a time zone database holding
/// Europe/Paris) for cluster c1.
fn hub() -> (String, Arc<Fake>) {
    serve(Some("c1"), Config::default(), true)
}

fn serve(cluster: Option<&str>, cfg: Config, appliance: bool) -> (String, Arc<Fake>) {
    let uploads = tempfile::tempdir().unwrap();
    let appliance = appliance.then(|| {
        let zones = uploads.path().join("zoneinfo");
        std::fs::create_dir_all(zones.join("Europe")).unwrap();
        std::fs::write(zones.join("Europe/Paris"), b"TZif2").unwrap();
        let a = Appliance::open(uploads.path(), Some("hubbox".into())).unwrap().with_zoneinfo(zones);
        // What the image's system side writes at first boot (root's, beside status.json).
        std::fs::write(uploads.path().join("appliance/setup-code"), format!("{SETUP_CODE}\n")).unwrap();
        a
    });
    let fake = Arc::new(Fake {
        cluster: cluster.map(str::to_string),
        record: Mutex::new(None),
        done: Mutex::default(),
        uploads,
        appliance,
        secret: [NEXT_SECRET.fetch_add(1, std::sync::atomic::Ordering::Relaxed); 32],
    });
    // Stands for the node's OpenAI routes.
    let llm = axum::Router::new().route("/v1/chat/completions", axum::routing::post(|| async { "chat" }));
    let router = shoal_admin::router(fake.clone(), cfg, llm);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(listener, router.into_make_service_with_connect_info::<SocketAddr>()).await.unwrap();
        });
    });
    (url, fake)
}

/// An answer: status, the headers we look at, body.
struct Answer {
    status: u16,
    set_cookie: Option<String>,
    retry_after: Option<String>,
    csp: Option<String>,
    body: String,
}

impl Answer {
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The session token in `Set-Cookie`.
    fn token(&self) -> String {
        let c = self.set_cookie.as_deref().expect("a session cookie");
        c.split(';').next().unwrap().strip_prefix("shoal_session=").unwrap().to_string()
    }
}

/// A request with optional session cookie, CSRF token, JSON body and extra headers.
fn call(
    method: &str,
    url: &str,
    token: Option<&str>,
    csrf: Option<&str>,
    body: Option<&str>,
    extra: &[(&str, &str)],
) -> Answer {
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut req = ureq::http::Request::builder().method(method).uri(url);
    if let Some(t) = token {
        req = req.header("cookie", format!("other=1; shoal_session={t}"));
    }
    if let Some(c) = csrf {
        req = req.header("x-csrf-token", c);
    }
    if body.is_some() && !extra.iter().any(|(k, _)| *k == "content-type") {
        req = req.header("content-type", "application/json");
    }
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let mut r = agent.run(req.body(body.unwrap_or("").to_string()).unwrap()).unwrap();
    let h = |name: &str| r.headers().get(name).map(|v| v.to_str().unwrap().to_string());
    let (set_cookie, retry_after, csp) = (h("set-cookie"), h("retry-after"), h("content-security-policy"));
    Answer { status: r.status().as_u16(), set_cookie, retry_after, csp, body: r.body_mut().read_to_string().unwrap() }
}

fn get(url: &str, token: Option<&str>) -> Answer {
    call("GET", url, token, None, None, &[])
}

const PASSWORD: &str = "correct horse battery";
/// The fake hub box's setup code.
const SETUP_CODE: &str = "1234-5678-9012";

/// Set the first password on `url`; the session token and CSRF token.
fn setup(url: &str) -> (String, String) {
    let a = call(
        "POST",
        &format!("{url}/admin/api/setup"),
        None,
        None,
        Some(&format!("{{\"password\":\"{PASSWORD}\"}}")),
        &[],
    );
    assert_eq!(a.status, 200, "{}", a.body);
    (a.token(), a.json()["csrf"].as_str().unwrap().to_string())
}

#[test]
fn first_run_sets_the_password_then_every_admin_route_needs_the_session() {
    let (url, fake) = server(Some("c1"), Config::default());
    assert_eq!(get(&format!("{url}/admin/api/session"), None).json()["state"], "setup");
    for route in ["overview", "events"] {
        assert_eq!(get(&format!("{url}/admin/api/{route}"), None).status, 401, "{route} before any password");
    }
    let short = call("POST", &format!("{url}/admin/api/setup"), None, None, Some(r#"{"password":"short"}"#), &[]);
    assert_eq!(short.status, 400);
    assert!(short.json()["error"].as_str().unwrap().contains("at least 8"), "{}", short.body);
    assert!(fake.record.lock().unwrap().is_none(), "a refused password changes nothing");

    let a = call(
        "POST",
        &format!("{url}/admin/api/setup"),
        None,
        None,
        Some(&format!("{{\"password\":\"{PASSWORD}\"}}")),
        &[],
    );
    assert_eq!(a.status, 200, "{}", a.body);
    let cookie = a.set_cookie.clone().unwrap();
    for flag in ["HttpOnly", "SameSite=Strict", "Path=/admin", "Max-Age=43200"] {
        assert!(cookie.contains(flag), "{flag} in {cookie}");
    }
    assert!(!cookie.contains("Secure"), "plain HTTP: a Secure cookie would never come back");
    let (token, csrf) = (a.token(), a.json()["csrf"].as_str().unwrap().to_string());
    let stored = fake.record.lock().unwrap().clone().unwrap();
    assert!(stored.password.starts_with("$argon2id$") && !stored.password.contains(PASSWORD));

    let again =
        call("POST", &format!("{url}/admin/api/setup"), None, None, Some(r#"{"password":"another one!"}"#), &[]);
    assert_eq!(again.status, 409, "the first password cannot be set twice");
    assert_eq!(fake.record.lock().unwrap().clone().unwrap(), stored);

    let s = get(&format!("{url}/admin/api/session"), Some(&token)).json();
    assert_eq!((s["state"].as_str(), s["csrf"].as_str()), (Some("in"), Some(csrf.as_str())));
    let o = get(&format!("{url}/admin/api/overview"), Some(&token));
    assert_eq!(o.status, 200, "{}", o.body);
    assert_eq!(o.json()["nodes"][0]["name"], "alpha");
    for bad in ["", "s1.1.2.3", &token.replace("s1.", "s1.9")] {
        assert_eq!(get(&format!("{url}/admin/api/overview"), Some(bad)).status, 401, "{bad:?}");
    }

    // A change without the CSRF token, or with another session's, is refused.
    let logout = format!("{url}/admin/api/logout");
    assert_eq!(call("POST", &logout, Some(&token), None, None, &[]).status, 403);
    let (_, other_csrf) = {
        let a = call(
            "POST",
            &format!("{url}/admin/api/login"),
            None,
            None,
            Some(&format!("{{\"password\":\"{PASSWORD}\"}}")),
            &[],
        );
        (a.token(), a.json()["csrf"].as_str().unwrap().to_string())
    };
    assert_eq!(call("POST", &logout, Some(&token), Some(&other_csrf), None, &[]).status, 403);
    let out = call("POST", &logout, Some(&token), Some(&csrf), None, &[]);
    assert_eq!(out.status, 200, "{}", out.body);
    assert!(out.set_cookie.unwrap().contains("Max-Age=0"), "the cookie is cleared");
    assert_eq!(get(&format!("{url}/admin/api/overview"), Some(&token)).status, 401, "a logged-out session is over");
}

#[test]
fn the_sixth_wrong_password_within_a_minute_is_refused_without_being_checked() {
    let (url, _) = server(Some("c1"), Config::default());
    setup(&url);
    let login = format!("{url}/admin/api/login");
    for i in 0..5 {
        let a = call("POST", &login, None, None, Some(r#"{"password":"wrong password"}"#), &[]);
        assert_eq!(a.status, 401, "attempt {i}: {}", a.body);
        assert!(a.set_cookie.is_none());
    }
    let a = call("POST", &login, None, None, Some(&format!("{{\"password\":\"{PASSWORD}\"}}")), &[]);
    assert_eq!(a.status, 429, "even the right password is not checked: {}", a.body);
    assert!(a.set_cookie.is_none());
    let wait: u64 = a.retry_after.expect("Retry-After").parse().unwrap();
    assert!((1..=60).contains(&wait), "{wait}");
}

#[test]
fn a_session_of_one_cluster_is_refused_by_another() {
    let (one, _) = server(Some("c1"), Config::default());
    let (two, _) = server(Some("c2"), Config::default());
    let (token, _) = setup(&one);
    setup(&two); // the same password, another cluster
    assert_eq!(get(&format!("{one}/admin/api/overview"), Some(&token)).status, 200);
    assert_eq!(get(&format!("{two}/admin/api/overview"), Some(&token)).status, 401);
    assert_eq!(get(&format!("{two}/admin/api/session"), Some(&token)).json()["state"], "login");
}

/// Security review F1: every member holds the admin record; a session made on one node
/// is not good on another (each signs with a secret of its own), so a member cannot
/// mint sessions for the others from the record it holds.
#[test]
fn a_session_is_good_on_the_node_that_made_it_only() {
    let (one, a) = server(Some("c1"), Config::default());
    let (two, b) = server(Some("c1"), Config::default());
    let (token, csrf) = setup(&one);
    *b.record.lock().unwrap() = a.record.lock().unwrap().clone();
    assert_eq!(get(&format!("{one}/admin/api/overview"), Some(&token)).status, 200);
    assert_eq!(get(&format!("{two}/admin/api/overview"), Some(&token)).status, 401);
    assert_eq!(get(&format!("{two}/admin/api/session"), Some(&token)).json()["state"], "login");
    // The same password logs in there, with a session of its own.
    let login = call(
        "POST",
        &format!("{two}/admin/api/login"),
        None,
        None,
        Some(&format!("{{\"password\":\"{PASSWORD}\"}}")),
        &[],
    );
    assert_eq!(login.status, 200, "{}", login.body);
    let (there, there_csrf) = (login.token(), login.json()["csrf"].as_str().unwrap().to_string());
    assert_ne!(there_csrf, csrf);
    assert_eq!(get(&format!("{two}/admin/api/overview"), Some(&there)).status, 200);
    assert_eq!(get(&format!("{one}/admin/api/overview"), Some(&there)).status, 401);
}

#[test]
fn sessions_expire() {
    // Expiry counts whole Unix seconds: a 1 s session made late in a second could be
    // over before the first request (CI saw it once); 3 s leaves room for that request.
    let cfg = Config { session_ttl: Duration::from_secs(3), ..Config::default() };
    let (url, _) = server(Some("c1"), cfg);
    let (token, _) = setup(&url);
    assert_eq!(get(&format!("{url}/admin/api/overview"), Some(&token)).status, 200);
    std::thread::sleep(Duration::from_millis(4100));
    let a = get(&format!("{url}/admin/api/overview"), Some(&token));
    assert_eq!(a.status, 401);
    assert!(a.body.contains("expired"), "{}", a.body);
}

#[test]
fn login_and_setup_refuse_what_another_site_could_send_and_bad_bodies() {
    let (url, fake) = server(Some("c1"), Config::default());
    let body = format!("{{\"password\":\"{PASSWORD}\"}}");
    let setup_url = format!("{url}/admin/api/setup");
    let form = call("POST", &setup_url, None, None, Some(&body), &[("content-type", "text/plain")]);
    assert_eq!(form.status, 415, "a cross-site form posts text/plain: {}", form.body);
    let foreign = call("POST", &setup_url, None, None, Some(&body), &[("origin", "http://evil.example")]);
    assert_eq!(foreign.status, 403);
    for bad in ["", "{", "[]", r#"{"password": 5}"#, "\u{0}"] {
        let a = call("POST", &setup_url, None, None, Some(bad), &[]);
        assert_eq!(a.status, 400, "{bad:?}: {}", a.body);
        assert!(a.json()["error"].as_str().unwrap().starts_with("bad JSON"));
    }
    assert!(fake.record.lock().unwrap().is_none(), "nothing refused changed anything");
    let host = url.trim_start_matches("http://");
    let same = call("POST", &setup_url, None, None, Some(&body), &[("origin", &format!("http://{host}"))]);
    assert_eq!(same.status, 200, "the page's own origin: {}", same.body);
    let login = format!("{url}/admin/api/login");
    assert_eq!(call("POST", &login, None, None, Some(&body), &[("origin", "http://evil.example")]).status, 403);
}

#[test]
fn a_node_in_no_cluster_says_so_and_takes_no_password() {
    let (url, fake) = server(None, Config::default());
    assert_eq!(get(&format!("{url}/admin/api/session"), None).json()["state"], "unpaired");
    let a = call(
        "POST",
        &format!("{url}/admin/api/setup"),
        None,
        None,
        Some(&format!("{{\"password\":\"{PASSWORD}\"}}")),
        &[],
    );
    assert_eq!(a.status, 409);
    assert!(fake.record.lock().unwrap().is_none());
}

#[test]
fn the_page_is_served_with_a_policy_that_keeps_it_on_this_node() {
    let (url, _) = server(Some("c1"), Config::default());
    let page = get(&format!("{url}/admin/"), None);
    assert_eq!(page.status, 200);
    assert!(page.body.contains("<title>Shoal</title>"));
    let csp = page.csp.expect("a Content-Security-Policy");
    for d in ["default-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"] {
        assert!(csp.contains(d), "{d} in {csp}");
    }
    // Every file the page names is served; nothing it names is on another host.
    for file in ["app.js", "style.css", "icon.svg"] {
        assert!(page.body.contains(file), "index.html names {file}");
        assert_eq!(get(&format!("{url}/admin/{file}"), None).status, 200, "{file}");
    }
    for body in [
        &page.body,
        &get(&format!("{url}/admin/app.js"), None).body,
        &get(&format!("{url}/admin/style.css"), None).body,
    ] {
        // (Text may name a URL for people to type; nothing the browser loads may.)
        for load in ["src=\"http", "href=\"http", "src=\"//", "href=\"//", "url(http", "url(//", "(\"http", "(`http"] {
            assert!(!body.contains(load), "a resource from another host: {load}");
        }
    }
    assert_eq!(get(&format!("{url}/admin/nope.js"), None).status, 404);
    assert_eq!(get(&format!("{url}/admin/api/nope"), None).status, 404);
    assert_eq!(get(&format!("{url}/admin/../etc/passwd"), None).status, 404);
}

#[test]
fn the_live_overview_streams_as_server_sent_events() {
    let (url, _) = server(Some("c1"), Config::default());
    let (token, _) = setup(&url);
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut r = agent
        .get(&format!("{url}/admin/api/events"))
        .header("cookie", format!("shoal_session={token}"))
        .call()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut reader = std::io::BufReader::new(r.body_mut().as_reader());
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut reader, &mut line).unwrap();
        if line.trim().is_empty() && !lines.is_empty() {
            break;
        }
        lines.push(line.trim_end().to_string());
    }
    assert_eq!(lines[0], "event: overview");
    let data: serde_json::Value = serde_json::from_str(lines[1].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(data["nodes"][0]["name"], "alpha");
}

#[test]
fn actions_and_the_chat_need_the_session_and_its_csrf_token_and_bad_ones_change_nothing() {
    let (url, fake) = server(Some("c1"), Config::default());
    let (token, csrf) = setup(&url);
    let action = format!("{url}/admin/api/action");
    let chat = format!("{url}/admin/api/llm/v1/chat/completions");
    let approve = r#"{"action":"approve","node":"abcd1234"}"#;
    assert_eq!(call("POST", &action, None, None, Some(approve), &[]).status, 401);
    assert_eq!(call("POST", &action, Some(&token), None, Some(approve), &[]).status, 403);
    assert_eq!(call("POST", &chat, None, None, Some("{}"), &[]).status, 401, "the chat is behind the login");
    assert_eq!(call("POST", &chat, Some(&token), None, Some("{}"), &[]).status, 403);
    assert!(fake.done.lock().unwrap().is_empty());
    for bad in [
        r#"{"action":"explode"}"#,
        r#"{"node":"x"}"#,
        r#"{"action":"approve"}"#,
        r#"{"action":"approve","node":"x","extra":1}"#,
    ] {
        let a = call("POST", &action, Some(&token), Some(&csrf), Some(bad), &[]);
        assert_eq!(a.status, 400, "{bad}: {}", a.body);
    }
    assert!(fake.done.lock().unwrap().is_empty(), "refused actions did nothing");

    let a = call("POST", &action, Some(&token), Some(&csrf), Some(approve), &[]);
    assert_eq!(a.status, 200, "{}", a.body);
    let a = call("POST", &action, Some(&token), Some(&csrf), Some(r#"{"action":"join_token"}"#), &[]);
    assert_eq!(a.status, 200, "{}", a.body);
    let nobody = call("POST", &action, Some(&token), Some(&csrf), Some(r#"{"action":"remove","node":"nobody"}"#), &[]);
    assert_eq!((nobody.status, nobody.json()["error"].as_str()), (404, Some("no member nobody")));
    assert_eq!(
        *fake.done.lock().unwrap(),
        [Action::Approve { node: "abcd1234".into() }, Action::JoinToken { valid_s: 86_400 }]
    );
    let c = call("POST", &chat, Some(&token), Some(&csrf), Some("{}"), &[]);
    assert_eq!((c.status, c.body.as_str()), (200, "chat"));
}

#[test]
fn uploads_stream_to_the_upload_folder_and_what_is_refused_leaves_nothing() {
    let (url, fake) = server(Some("c1"), Config::default());
    let (token, csrf) = setup(&url);
    let up = |name: &str, body: &[u8], token: Option<&str>, csrf: Option<&str>| {
        let body = String::from_utf8(body.to_vec()).unwrap();
        call(
            "POST",
            &format!("{url}/admin/api/upload?name={name}"),
            token,
            csrf,
            Some(&body),
            &[("content-type", "application/octet-stream")],
        )
    };
    let model = format!("GGUF{}", "x".repeat(3 << 20)); // over axum's default 2 MB body limit
                                                        // (Refused before the body is read: a small one, or the client's write meets the
                                                        // closed connection.)
    assert_eq!(up("m.gguf", b"GGUF", None, None).status, 401);
    assert_eq!(up("m.gguf", b"GGUF", Some(&token), None).status, 403);
    for bad in ["m.bin", ".gguf", "a%20b.gguf", ".hidden.gguf", "..%2F..", "x.gguf%00"] {
        let a = up(bad, b"GGUF", Some(&token), Some(&csrf));
        assert_eq!(a.status, 400, "{bad}: {}", a.body);
    }
    let dir = fake.upload_dir();
    let a = up("m.gguf", model.as_bytes(), Some(&token), Some(&csrf));
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.json()["bytes"], model.len());
    assert_eq!(std::fs::read(dir.join("m.gguf")).unwrap(), model.as_bytes(), "the file arrived whole");
    assert_eq!(
        fake.done.lock().unwrap().last(),
        Some(&Action::ModelAdd { path: dir.join("m.gguf").display().to_string(), name: None })
    );
    assert_eq!(up("m.gguf", b"GGUF", Some(&token), Some(&csrf)).status, 409, "an existing file is kept");
    let refused = up("broken.gguf", b"not a model at all", Some(&token), Some(&csrf));
    assert_eq!((refused.status, refused.json()["error"].as_str()), (400, Some("not a GGUF file")));
    // A path is cut to its last component: nothing lands outside the folder.
    let a = up("..%2F..%2Fescape.gguf", b"GGUF", Some(&token), Some(&csrf));
    assert_eq!(a.status, 200, "{}", a.body);
    let mut left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    left.sort();
    assert_eq!(left, ["escape.gguf", "m.gguf"], "the refused file and every .part are gone");
    assert_eq!(std::fs::read_dir(fake.uploads.path()).unwrap().count(), 1, "only the models folder");
}

#[test]
fn the_first_password_is_set_only_from_this_machine() {
    let (url, fake) = server(Some("c1"), Config::default());
    let body = format!("{{\"password\":\"{PASSWORD}\"}}");
    // A page that reaches this port through a name of its own (DNS rebinding), or
    // another site's page: neither is this machine's own browser.
    for (k, v) in [("host", "shoal.evil.example"), ("origin", "http://evil.example")] {
        let s = call("GET", &format!("{url}/admin/api/session"), None, None, None, &[(k, v)]).json();
        assert_eq!((s["state"].as_str(), s["here"].as_bool()), (Some("setup"), Some(false)), "{k}: {v}");
    }
    let a = call("POST", &format!("{url}/admin/api/setup"), None, None, Some(&body), &[("host", "shoal.evil.example")]);
    assert_eq!(a.status, 403, "{}", a.body);
    assert!(a.json()["error"].as_str().unwrap().contains("shoal password"), "{}", a.body);
    assert!(fake.record.lock().unwrap().is_none());
    assert_eq!(get(&format!("{url}/admin/api/session"), None).json()["here"], true, "this machine's browser may");
}

#[test]
fn wrong_passwords_sent_at_once_cannot_slip_past_the_limit() {
    let (url, _) = server(Some("c1"), Config::default());
    setup(&url);
    let login = format!("{url}/admin/api/login");
    let answers: Vec<u16> = std::thread::scope(|s| {
        let all: Vec<_> = (0..12)
            .map(|_| s.spawn(|| call("POST", &login, None, None, Some(r#"{"password":"wrong password"}"#), &[]).status))
            .collect();
        all.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let checked = answers.iter().filter(|s| **s == 401).count();
    assert!(checked <= 5, "at most five were checked: {answers:?}");
    assert!(answers.iter().all(|s| [401, 429, 503].contains(s)), "{answers:?}");
}

/// The JSON of file `name` the node wrote (in `fake`'s appliance inbox).
fn appliance_file(fake: &Fake, name: &str) -> Option<serde_json::Value> {
    let bytes = std::fs::read(fake.appliance.as_ref().unwrap().inbox().join(name)).ok()?;
    Some(serde_json::from_slice(&bytes).unwrap())
}

#[test]
fn a_hub_appliance_is_set_up_from_its_lan_and_checks_everything_before_storing_anything() {
    let (url, fake) = hub();
    let session = |extra: &[(&str, &str)]| call("GET", &format!("{url}/admin/api/session"), None, None, None, extra);
    let s = session(&[("host", "shoal.local:11434")]).json();
    assert_eq!(
        (s["state"].as_str(), s["appliance"].as_bool(), s["here"].as_bool(), s["code"].as_bool()),
        (Some("setup"), Some(true), Some(true), Some(true))
    );
    for (k, v) in [("host", "evil.example"), ("origin", "http://evil.example")] {
        assert_eq!(session(&[(k, v)]).json()["here"], false, "{k}: {v}");
    }
    let setup = |body: &str, extra: &[(&str, &str)]| {
        call("POST", &format!("{url}/admin/api/setup"), None, None, Some(body), extra)
    };
    let good = format!(
        r#"{{"password":"{PASSWORD}","code":"1234 5678 9012","cluster_name":"Home","timezone":"Europe/Paris","wifi":{{"ssid":"home net","passphrase":"correct horse"}}}}"#
    );
    // Without the box's setup code, or with a wrong one: refused, nothing stored
    // (security review F10: a stranger on the LAN would own the box).
    let lan = [("host", "shoal.local:11434")];
    for (body, why) in [
        (good.replace(r#""code":"1234 5678 9012","#, ""), "setup code"),
        (good.replace("1234 5678 9012", "1234 5678 9013"), "wrong"),
        (good.replace("1234 5678 9012", "123456789012345"), "wrong"),
    ] {
        let a = setup(&body, &lan);
        assert_eq!(a.status, 403, "{body}: {}", a.body);
        assert!(a.json()["error"].as_str().unwrap().contains(why), "{why}: {}", a.body);
        assert!(fake.record.lock().unwrap().is_none() && appliance_file(&fake, "settings.json").is_none());
    }
    // A DNS-rebinding page (its own name in Host) and another site's page are refused.
    let rebound = setup(&good, &[("host", "evil.example:11434")]);
    assert_eq!(rebound.status, 403, "{}", rebound.body);
    assert!(rebound.json()["error"].as_str().unwrap().contains("shoal.local"), "{}", rebound.body);
    let foreign = setup(&good, &[("host", "shoal.local:11434"), ("origin", "http://evil.example")]);
    assert_eq!(foreign.status, 403, "{}", foreign.body);
    // Anything wrong: 400, and nothing is stored (no password, no file, no name).
    for (bad, why) in [
        (good.replace("Europe/Paris", "Mars/Olympus"), "time zone"),
        (good.replace("Europe/Paris", "../../etc/passwd"), "time zone"),
        (good.replace("correct horse", "short"), "passphrase"),
        (good.replace("home net", &"n".repeat(33)), "network name"),
        (good.replace("\"Home\"", "\"   \""), "cluster name"),
        (good.replace(PASSWORD, "short"), "at least 8"),
    ] {
        let a = setup(&bad, &[("host", "shoal.local:11434")]);
        assert_eq!(a.status, 400, "{bad}: {}", a.body);
        assert!(a.json()["error"].as_str().unwrap().contains(why), "{why}: {}", a.body);
        assert!(fake.record.lock().unwrap().is_none(), "{why}: the password is not set");
        assert!(appliance_file(&fake, "settings.json").is_none() && appliance_file(&fake, "request.json").is_none());
        assert!(fake.done.lock().unwrap().is_empty());
    }
    // From a machine of the LAN that reaches the box by address (the peer here is
    // loopback; the unit tests cover other peers).
    let a = setup(&good, &[("host", "192.168.1.20:11434"), ("origin", "http://192.168.1.20:11434")]);
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.set_cookie.is_some() && a.json().get("warnings").is_none(), "{}", a.body);
    assert!(fake.record.lock().unwrap().as_ref().unwrap().verify(PASSWORD));
    assert_eq!(
        appliance_file(&fake, "settings.json").unwrap(),
        serde_json::json!({"timezone": "Europe/Paris", "wifi": {"ssid": "home net", "passphrase": "correct horse"}})
    );
    assert_eq!(appliance_file(&fake, "request.json").unwrap()["action"], "apply");
    let done = fake.done.lock().unwrap().clone();
    assert_eq!(done[0], Action::ClusterName { name: "Home".into() });
    assert!(matches!(done[1], Action::ApplianceSettings { .. }), "{done:?}");
    assert_eq!(setup(&good, &[("host", "shoal.local")]).status, 409, "once");
}

#[test]
fn a_hub_appliance_is_set_up_through_shoal_local_with_the_password_and_its_code_alone() {
    let (url, fake) = hub();
    let body = format!(r#"{{"password":"{PASSWORD}","code":"{SETUP_CODE}"}}"#);
    let a = call(
        "POST",
        &format!("{url}/admin/api/setup"),
        None,
        None,
        Some(&body),
        &[("host", "Shoal.local:11434"), ("origin", "http://shoal.local:11434")],
    );
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(fake.record.lock().unwrap().is_some());
    assert!(appliance_file(&fake, "settings.json").is_none(), "no system setting asked: none written");
    // This machine's own browser (loopback, addressed as localhost) needs no code.
    let (url, fake) = hub();
    let body = format!(r#"{{"password":"{PASSWORD}"}}"#);
    let s = call("GET", &format!("{url}/admin/api/session"), None, None, None, &[]).json();
    assert_eq!(s["code"], false);
    let a = call("POST", &format!("{url}/admin/api/setup"), None, None, Some(&body), &[]);
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(fake.record.lock().unwrap().is_some());
    assert!(fake.done.lock().unwrap().is_empty());
}

#[test]
fn a_pc_is_set_up_only_from_itself_and_takes_no_system_settings() {
    let (url, fake) = server(Some("c1"), Config::default());
    let shoal_local = [("host", "shoal.local:11434")];
    let s = call("GET", &format!("{url}/admin/api/session"), None, None, None, &shoal_local).json();
    assert_eq!((s["appliance"].as_bool(), s["here"].as_bool()), (Some(false), Some(false)));
    let body = format!(r#"{{"password":"{PASSWORD}"}}"#);
    let a = call("POST", &format!("{url}/admin/api/setup"), None, None, Some(&body), &shoal_local);
    assert_eq!(a.status, 403, "{}", a.body);
    let with_zone = format!(r#"{{"password":"{PASSWORD}","timezone":"UTC"}}"#);
    let a = call("POST", &format!("{url}/admin/api/setup"), None, None, Some(&with_zone), &[]);
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(a.json()["error"].as_str().unwrap().contains("only on a hub appliance"), "{}", a.body);
    assert!(fake.record.lock().unwrap().is_none());
}

#[test]
fn a_hub_appliance_writes_settings_and_requests_reads_its_status_and_takes_a_bundle() {
    let (url, fake) = hub();
    let api = format!("{url}/admin/api/appliance");
    assert_eq!(get(&api, None).status, 401, "behind the login");
    let (token, csrf) = setup(&url);
    let dir = fake.appliance.as_ref().unwrap().dir().to_path_buf();
    let state = || {
        let a = get(&api, Some(&token));
        assert_eq!(a.status, 200, "{}", a.body);
        a
    };
    assert_eq!(
        state().json(),
        serde_json::json!({"appliance": true, "settings": {"timezone": null, "wifi": null}, "status": null})
    );
    let action =
        |body: &str| call("POST", &format!("{url}/admin/api/action"), Some(&token), Some(&csrf), Some(body), &[]);

    let a = action(
        r#"{"action":"appliance_settings","timezone":"Europe/Paris","wifi":{"ssid":"home","passphrase":"correct horse"}}"#,
    );
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(!a.body.contains("correct horse"), "the passphrase never goes back: {}", a.body);
    assert_eq!(
        appliance_file(&fake, "settings.json").unwrap(),
        serde_json::json!({"timezone": "Europe/Paris", "wifi": {"ssid": "home", "passphrase": "correct horse"}})
    );
    let request = appliance_file(&fake, "request.json").unwrap();
    assert_eq!(request["action"], "apply");
    assert_eq!(a.json()["request"], request);
    let shown = state();
    assert!(!shown.body.contains("correct horse"), "{}", shown.body);
    assert_eq!(shown.json()["settings"], serde_json::json!({"timezone": "Europe/Paris", "wifi": {"ssid": "home"}}));

    // Refused settings change nothing; absent ones are kept, null ones cleared.
    for bad in [
        r#"{"action":"appliance_settings","timezone":"Europe"}"#,
        r#"{"action":"appliance_settings","timezone":"/usr/share/zoneinfo/UTC"}"#,
        r#"{"action":"appliance_settings","wifi":{"ssid":"home","passphrase":"1234567"}}"#,
        r#"{"action":"appliance_settings","wifi":{"ssid":""}}"#,
        r#"{"action":"appliance_settings","wifi":{"ssid":"home","key":"x"}}"#,
    ] {
        let a = action(bad);
        assert_eq!(a.status, 400, "{bad}: {}", a.body);
    }
    assert_eq!(appliance_file(&fake, "request.json").unwrap(), request, "no request for a refused change");
    let a = action(r#"{"action":"appliance_settings","wifi":null}"#);
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        appliance_file(&fake, "settings.json").unwrap(),
        serde_json::json!({"timezone": "Europe/Paris", "wifi": null})
    );

    // status.json as the system side writes it; unknown fields dropped; a malformed one
    // reads as null.
    std::fs::write(
        dir.join("status.json"),
        r#"{"booted":"A","version":"1.2.0","request":{"id":"0011223344556677","action":"apply","state":"done","message":""},
            "update":{"state":"good","message":"","at":7},"timezone":"Europe/Paris","wifi":null,"hardware_watchdog":true,"new":1}"#,
    )
    .unwrap();
    let status = state().json()["status"].clone();
    assert_eq!((status["booted"].as_str(), status["version"].as_str()), (Some("A"), Some("1.2.0")));
    assert_eq!((status["update"]["state"].as_str(), status["request"]["state"].as_str()), (Some("good"), Some("done")));
    assert!(status.get("new").is_none(), "{status}");
    std::fs::write(dir.join("status.json"), r#"{"booted": ["#).unwrap();
    assert_eq!(state().json()["status"], serde_json::Value::Null);

    // An update needs a bundle; the bundle streams in behind the login and the CSRF token.
    let before = appliance_file(&fake, "request.json").unwrap();
    let a = action(r#"{"action":"appliance_update"}"#);
    assert_eq!(a.status, 409, "{}", a.body);
    assert!(a.json()["error"].as_str().unwrap().contains("upload"), "{}", a.body);
    assert_eq!(appliance_file(&fake, "request.json").unwrap(), before);
    let bundle = "b".repeat(3 << 20);
    let upload = |body: &str, token: Option<&str>, csrf: Option<&str>| {
        call(
            "POST",
            &format!("{url}/admin/api/appliance/bundle"),
            token,
            csrf,
            Some(body),
            &[("content-type", "application/octet-stream")],
        )
    };
    // (Refused before the body is read: a small one, or the client's write meets the
    // closed connection.)
    assert_eq!(upload("b", None, None).status, 401);
    assert_eq!(upload("b", Some(&token), None).status, 403);
    assert!(!dir.join("inbox/update.raucb").exists());
    let a = upload(&bundle, Some(&token), Some(&csrf));
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.json()["bytes"], bundle.len());
    assert_eq!(std::fs::read(dir.join("inbox/update.raucb")).unwrap(), bundle.as_bytes());
    let mut names: Vec<_> = std::fs::read_dir(dir.join("inbox")).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    assert_eq!(names, ["request.json", "settings.json", "update.raucb"], "no staging file left");
    let mut names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    // (setup-code: the system side's, written by the fake as the image would.)
    assert_eq!(names, ["inbox", "setup-code", "status.json"], "the node writes only in its inbox");
    for (body, name) in [
        (r#"{"action":"appliance_update"}"#, "update"),
        (r#"{"action":"appliance_reboot"}"#, "reboot"),
        (r#"{"action":"appliance_reset"}"#, "reset"),
    ] {
        let a = action(body);
        assert_eq!(a.status, 200, "{}", a.body);
        let r = appliance_file(&fake, "request.json").unwrap();
        assert_eq!(r["action"], name);
        assert_eq!(a.json()["request"], r);
        assert_ne!(r["id"], before["id"]);
    }
    // Another bundle takes the first one's place.
    assert_eq!(upload("second", Some(&token), Some(&csrf)).status, 200);
    assert_eq!(std::fs::read(dir.join("inbox/update.raucb")).unwrap(), b"second");
}

#[test]
fn a_pc_refuses_the_appliance_routes() {
    let (url, fake) = server(Some("c1"), Config::default());
    let (token, csrf) = setup(&url);
    let a = get(&format!("{url}/admin/api/appliance"), Some(&token));
    assert_eq!(a.json(), serde_json::json!({"appliance": false, "settings": null, "status": null}));
    for body in [
        r#"{"action":"appliance_settings","timezone":"UTC"}"#,
        r#"{"action":"appliance_update"}"#,
        r#"{"action":"appliance_reset"}"#,
        r#"{"action":"appliance_reboot"}"#,
    ] {
        let a = call("POST", &format!("{url}/admin/api/action"), Some(&token), Some(&csrf), Some(body), &[]);
        assert_eq!(a.status, 409, "{body}: {}", a.body);
        assert!(a.json()["error"].as_str().unwrap().contains("not a hub appliance"), "{}", a.body);
    }
    let a = call(
        "POST",
        &format!("{url}/admin/api/appliance/bundle"),
        Some(&token),
        Some(&csrf),
        Some("bundle"),
        &[("content-type", "application/octet-stream")],
    );
    assert_eq!(a.status, 409, "{}", a.body);
    assert!(fake.done.lock().unwrap().is_empty());
    assert_eq!(std::fs::read_dir(fake.uploads.path()).unwrap().count(), 0, "nothing written");
}
