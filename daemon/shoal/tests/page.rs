//! The admin page in a real browser (issue 19): Debian's Chromium, headless, driven by
//! playwright-core through `web/tests/admin.cjs`, against `shoal serve` nodes on
//! loopback (real QUIC, mDNS on `lo`, llama.cpp). First-run password, the session
//! cookie's flags, three machines live on the overview, logout and a refused wrong
//! password, a POST without the CSRF token refused, a fourth node seen waiting and let
//! in with a join token the page makes, the test model added by path and loaded (the
//! placement bar shows its three stages), a chat that streams `shoal run`'s greedy
//! answer, a member SIGKILLed shown down without a reload and in the activity log, a
//! phone's width in dark mode, and no request to any host but the node; then `shoal
//! password` on a node replaces the password the page set. Screenshots go
//! to `target/tmp/admin-page/`. scripts/setup.sh installs the browser and the npm
//! package; without them the test fails and says so. A hub box (`shoal serve --role hub
//! --appliance`) is set up from "another machine" through `shoal.local` with its
//! first-boot settings and managed from its System card (`web/tests/hub.cjs`, which
//! plays the image's system side by writing `status.json`).

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The folder holding playwright-core's `node_modules` (scripts/setup.sh links it).
/// `node web/tests/SCRIPT` with what every browser script needs: Playwright's modules,
/// where screenshots go, the Chromium to drive.
fn browser(script: &str, modules: &Path, artifacts: &Path, chromium: &str) -> Command {
    let mut c = Command::new("node");
    c.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../web/tests").join(script))
        .env("NODE_PATH", modules)
        .env("SHOAL_ARTIFACTS", artifacts)
        .env("SHOAL_CHROMIUM", chromium);
    c
}

/// Run a browser script to its end; a panic with what it said unless it passed.
fn run_browser(cmd: &mut Command) {
    let out = cmd.output().expect("node (Node.js) runs: scripts/setup.sh installs it");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "the browser test failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
}

fn playwright() -> PathBuf {
    let dir = std::env::var_os("SHOAL_PLAYWRIGHT").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/shoal/npm/playwright-core/node_modules")
    });
    assert!(
        dir.join("playwright-core").is_dir(),
        "playwright-core is not at {}: run scripts/setup.sh (or set SHOAL_PLAYWRIGHT)",
        dir.display()
    );
    dir
}

#[test]
fn the_admin_page_runs_the_cluster_in_a_real_browser() {
    let modules = playwright();
    let chromium = std::env::var("SHOAL_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(std::path::Path::new(&chromium).exists(), "no browser at {chromium}: run scripts/setup.sh");
    let model = model(SMOL);
    let prompt = "Name three colours.";
    let expect = unsplit(&model, &["--prompt", prompt, "-n", "24", "--json"])["text"].as_str().unwrap().to_string();

    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let mut nodes = start_cluster(&dir, &["alpha", "beta", "gamma"]);
    // A fourth machine, started but not a member: the page lets it in. It offers next
    // to no memory, so the model's three stages stay on the first three.
    nodes.0.push(("delta", serve_offering(&dir("delta"), "delta", false, "1M", "1")));
    wait_for("delta up", 30, || status(&dir("delta")));
    let url = format!("http://{}", std::fs::read_to_string(dir("alpha").join("http")).unwrap().trim());
    // A member that does not lead stops during the test (the page is served by alpha).
    let leader =
        wait_for("a leader", 30, || status(&dir("alpha")).and_then(|s| s["leader"].as_str().map(String::from)));
    let victim = ["beta", "gamma"].into_iter().find(|n| key(&dir(n)) != leader).unwrap();
    let pid = nodes.0.iter().find(|(n, _)| *n == victim).unwrap().1.id();
    let artifacts = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("admin-page");
    // A web page of another site, through this machine's browser: it needs a key (the
    // page's setting lifts that below).
    let foreign = || {
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        agent.get(&format!("{url}/v1/models")).header("origin", "http://elsewhere.example").call().unwrap().status()
    };
    assert_eq!(foreign(), 401);
    // A local web server with the test model, for the page's download.
    let site = tmp.path().join("site");
    std::fs::create_dir_all(&site).unwrap();
    std::os::unix::fs::symlink(&model, site.join("served.gguf")).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let server = std::process::Command::new("python3")
        .args(["-m", "http.server", &port.to_string(), "--bind", "127.0.0.1", "--directory"])
        .arg(&site)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("python3 (scripts/setup.sh installs it)");
    let _server = KillOnDrop(server);
    let bad = tmp.path().join("broken.gguf");
    std::fs::write(&bad, [&b"GGUF"[..], &[0u8; 4096]].concat()).unwrap();
    run_browser(
        browser("admin.cjs", &modules, &artifacts, &chromium)
            .env("SHOAL_URL", &url)
            .env("SHOAL_NODES", "3")
            .env("SHOAL_BIN", env!("CARGO_BIN_EXE_shoal"))
            .env("SHOAL_NEW_DIR", dir("delta"))
            .env("SHOAL_NEW_ID", key(&dir("delta")))
            .env("SHOAL_MODEL", &model)
            .env("SHOAL_BAD_UPLOAD", &bad)
            .env("SHOAL_DOWNLOAD", format!("http://127.0.0.1:{port}/served.gguf"))
            .env("SHOAL_STAGES", "3")
            .env("SHOAL_PROMPT", prompt)
            .env("SHOAL_EXPECT", &expect)
            .env("SHOAL_MAX_TOKENS", "24")
            .env("SHOAL_KILL_PID", pid.to_string())
            .env("SHOAL_KILL_ID", key(&dir(victim)))
            .env("SHOAL_KILL_NAME", victim),
    );
    for shot in ["01-first-run", "02-overview", "05-models", "07-chat", "09-activity", "10-settings", "11-phone-dark"] {
        let f = artifacts.join(format!("{shot}.png"));
        assert!(std::fs::metadata(&f).is_ok_and(|m| m.len() > 1000), "screenshot {}", f.display());
    }

    assert_eq!(foreign(), 200, "the page let every machine in without a key");

    // The owner of a node sets a new password without the page (a forgotten one): the
    // old one stops working on every node, the new one works.
    let mut set = shoal()
        .args(["password", "--data-dir"])
        .arg(dir("alpha"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut set.stdin.take().unwrap(), b"a new admin password\n").unwrap();
    let done = set.wait_with_output().unwrap();
    assert!(done.status.success(), "shoal password: {}", String::from_utf8_lossy(&done.stdout));
    let try_login = |password: &str| {
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let body = serde_json::json!({ "password": password }).to_string();
        agent
            .post(&format!("{url}/admin/api/login"))
            .header("content-type", "application/json")
            .send(body)
            .unwrap()
            .status()
    };
    // (Each wrong try counts towards the limit of 5 a minute: give the commit a beat
    // to reach alpha's view first.)
    std::thread::sleep(std::time::Duration::from_millis(500));
    wait_for("the new password", 10, || (try_login("a new admin password") == 200).then_some(()));
    assert_eq!(try_login("a long admin password2"), 401, "the page's password no longer works");
    drop(nodes);
}

/// Set the admin password of the node in `dir` with `shoal password`, log in over HTTP
/// at `url`; the session cookie's value and the CSRF token.
fn login(dir: &std::path::Path, url: &str, password: &str) -> (String, String) {
    let mut set = shoal()
        .args(["password", "--data-dir"])
        .arg(dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut set.stdin.take().unwrap(), format!("{password}\n").as_bytes()).unwrap();
    assert!(set.wait().unwrap().success());
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let body = serde_json::json!({ "password": password }).to_string();
    let mut r = wait_for("a login", 10, || {
        let r = agent
            .post(&format!("{url}/admin/api/login"))
            .header("content-type", "application/json")
            .send(&body)
            .unwrap();
        (r.status() == 200).then_some(r)
    });
    let cookie = r.headers().get("set-cookie").unwrap().to_str().unwrap().split(';').next().unwrap().to_string();
    let v: serde_json::Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
    (cookie, v["csrf"].as_str().unwrap().to_string())
}

/// A field of `/proc/<pid>/status` in bytes (`VmRSS`, `VmHWM`).
fn proc_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// Bytes of a GGUF-shaped file that is not a model: the magic, then `len` bytes of a
/// pattern, made as they are read (nothing of it is held in memory or on disk here).
struct FakeGguf {
    left: u64,
    sent_magic: bool,
}

impl std::io::Read for FakeGguf {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if !self.sent_magic {
            self.sent_magic = true;
            buf[..4].copy_from_slice(b"GGUF");
            return Ok(4);
        }
        let n = (buf.len() as u64).min(self.left) as usize;
        for (i, b) in buf[..n].iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        self.left -= n as u64;
        Ok(n)
    }
}

#[test]
fn a_gigabyte_upload_streams_to_disk_and_is_refused_whole_when_it_is_not_a_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("solo");
    let nodes = Nodes(vec![("solo", serve_offering(&dir, "solo", true, "90M", "1"))]);
    wait_for("the node's cluster", 30, || status(&dir).filter(|s| !s["cluster"].is_null()));
    let url = format!("http://{}", wait_for("the API", 30, || std::fs::read_to_string(dir.join("http")).ok()).trim());
    let (cookie, csrf) = login(&dir, &url, "an admin password");
    let pid = nodes.0[0].1.id();
    let before = proc_bytes(pid, "VmRSS");
    // Reset the peak (VmHWM) to now, so that it measures the upload alone; where the
    // kernel refuses, the peak since start bounds it from above.
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
    const GIB: u64 = 1 << 30;
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut body = FakeGguf { left: GIB, sent_magic: false };
    let t0 = std::time::Instant::now();
    let mut r = agent
        .post(&format!("{url}/admin/api/upload?name=big.gguf"))
        .header("cookie", &cookie)
        .header("x-csrf-token", &csrf)
        .header("content-type", "application/octet-stream")
        .send(ureq::SendBody::from_reader(&mut body))
        .unwrap();
    let took = t0.elapsed();
    let answer = r.body_mut().read_to_string().unwrap();
    assert_eq!(r.status(), 400, "{answer}");
    let peak = proc_bytes(pid, "VmHWM");
    let growth = peak.saturating_sub(before);
    println!(
        "upload of 1 GiB in {:.1} s; node RSS {} MiB before, peak {} MiB: growth {} MiB; answer {answer}",
        took.as_secs_f64(),
        before >> 20,
        peak >> 20,
        growth >> 20
    );
    assert!(growth < 64 << 20, "the upload grew the node's memory by {} MiB", growth >> 20);
    let models = dir.join("models");
    let left: Vec<_> =
        std::fs::read_dir(&models).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "nothing of the refused upload is left: {left:?}");
    drop(nodes);
}

#[test]
fn a_hub_box_is_set_up_from_its_lan_and_its_system_managed_from_the_page() {
    let modules = playwright();
    let chromium = std::env::var("SHOAL_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(std::path::Path::new(&chromium).exists(), "no browser at {chromium}: run scripts/setup.sh");
    // The node checks time zones against this machine's database (tzdata).
    let zone = ["Europe/Paris", "UTC"]
        .into_iter()
        .find(|z| std::path::Path::new("/usr/share/zoneinfo").join(z).is_file())
        .unwrap_or("UTC");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hub");
    let mut serve = shoal();
    serve
        .args(["serve", "--listen", "127.0.0.1:0", "--join-listen", "127.0.0.1:0", "--mdns-allow", "lo"])
        .args(["--http-listen", "127.0.0.1:0", "--name", "hub", "--max-memory", "90M", "--threads", "1"])
        .args(["--create-cluster", "--role", "hub", "--appliance", "--data-dir"])
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let nodes = Nodes(vec![("hub", serve.spawn().unwrap())]);
    wait_for("the hub's cluster", 30, || status(&dir).filter(|s| !s["cluster"].is_null()));
    let url = format!("http://{}", wait_for("the API", 30, || std::fs::read_to_string(dir.join("http")).ok()).trim());
    let appliance = dir.join("appliance");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&appliance).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755, "the appliance folder");
        let mode = std::fs::metadata(appliance.join("inbox")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o770, "the appliance folder's inbox");
    }
    let artifacts = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("admin-page");
    run_browser(
        browser("hub.cjs", &modules, &artifacts, &chromium)
            .env("SHOAL_URL", &url)
            .env("SHOAL_APPLIANCE", &appliance)
            .env("SHOAL_ZONE", zone),
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(appliance.join("inbox/settings.json")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "settings.json holds the WiFi passphrase");
    }
    drop(nodes);
}

/// A child process killed when the test ends, passed or failed.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
