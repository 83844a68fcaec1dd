//! The hub box's disk image, booted (issue 22). Opt-in: it builds the image with
//! `firmware/build.sh` (~3 min), three update bundles (~3 min), and boots the image
//! under qemu in software emulation seven times (~10 min), so it is `#[ignore]`d in the
//! suite and runs with `--ignored` (`sudo firmware/test.sh` installs what it needs and
//! runs it); there, a missing precondition fails it (see `shoal_testnet::precondition`).
//! Its files stay in `target/tmp/hub-image` (the box's console in
//! `serial.log`); `SHOAL_HUB_REUSE=1` boots the image and bundles left there by the
//! last run instead of building them again.
//!
//! The box sits on a LAN of its own: a network namespace with a bridge, a DHCP server
//! (dnsmasq) and qemu's tap, UEFI firmware (OVMF) booting the raw image as a real disk.
//! Over HTTP from that LAN, as a user's browser would: the first-boot setup through
//! `shoal.local`, a login, a join token made on the page that a Shoal node on the LAN
//! joins with; a reboot keeps all of it; a bundle signed by another key is refused; a
//! bundle whose Shoal cannot start installs into slot B, fails its health check and the
//! box rolls back to slot A; the next version installs into slot B and is kept; a
//! factory reset brings the first-boot setup back. Boot times are printed.

mod common;
use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The hub's fixed address on the test LAN (dnsmasq gives it to its MAC).
const HUB_IP: &str = "10.99.0.10";
const HUB_MAC: &str = "52:54:00:5e:00:10";
/// The host's side of the LAN (the bridge), where the joining node runs.
const HOST_IP: &str = "10.99.0.1";
const PASSWORD: &str = "correct horse battery staple";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Why the test cannot run here, if it cannot.
fn missing() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("needs root (image build, network namespace, tap)".into());
    }
    for tool in
        ["qemu-system-x86_64", "mmdebstrap", "rauc", "mcopy", "dnsmasq", "unsquashfs", "cargo-deb", "grub-editenv"]
    {
        if Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().map_or(true, |o| !o.status.success())
        {
            return Some(format!("{tool} is not installed (firmware/test.sh installs it)"));
        }
    }
    if !Path::new(OVMF_CODE).exists() {
        return Some(format!("{OVMF_CODE} is missing (Debian's ovmf package)"));
    }
    None
}

const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
const OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";

/// The test LAN and everything running on it; torn down on drop.
struct Lan {
    ns: String,
    dir: PathBuf,
    qemu: Option<Child>,
    /// The box's disk, for each power-on.
    disk: PathBuf,
    dnsmasq: Option<Child>,
    node: Option<Child>,
}

impl Lan {
    fn new(dir: &Path) -> Lan {
        let ns = format!("shoalhub{}", std::process::id());
        let lan =
            Lan { ns: ns.clone(), dir: dir.to_path_buf(), qemu: None, disk: PathBuf::new(), dnsmasq: None, node: None };
        sh(Command::new("ip").args(["netns", "add", &ns]));
        let ip = |args: &[&str]| sh(Command::new("ip").args(["-n", &ns]).args(args));
        ip(&["link", "set", "lo", "up"]);
        ip(&["link", "add", "br0", "type", "bridge"]);
        ip(&["addr", "add", &format!("{HOST_IP}/24"), "dev", "br0"]);
        ip(&["link", "set", "br0", "up"]);
        ip(&["tuntap", "add", "dev", "tap0", "mode", "tap"]);
        ip(&["link", "set", "tap0", "master", "br0"]);
        ip(&["link", "set", "tap0", "up"]);
        // mDNS crosses the bridge (DESIGN's testing notes).
        ip(&["route", "add", "224.0.0.0/4", "dev", "br0"]);
        lan
    }

    fn exec(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }

    fn start_dhcp(&mut self) {
        let leases = self.dir.join("leases");
        let child = self
            .exec("dnsmasq")
            .args(["--no-daemon", "--conf-file=/dev/null", "--port=0", "--interface=br0", "--bind-interfaces"])
            .arg("--dhcp-range=10.99.0.50,10.99.0.99,1h")
            .arg(format!("--dhcp-host={HUB_MAC},{HUB_IP}"))
            .arg(format!("--dhcp-leasefile={}", leases.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.dnsmasq = Some(child);
    }

    /// Boot the disk under qemu (UEFI, software emulation; `-cpu max` for AVX2, which
    /// Shoal's llama.cpp build needs), serial console to `serial.log`.
    fn start_vm(&mut self, disk: &Path) {
        let vars = self.dir.join("OVMF_VARS.fd");
        std::fs::copy(OVMF_VARS, &vars).unwrap();
        self.disk = disk.to_path_buf();
        self.power_on();
    }

    /// Start qemu on the disk (again). A reboot of the box ends qemu (`-no-reboot`) and
    /// [`Lan::check_vm`] powers it on again: OVMF under software emulation sometimes
    /// hangs in a warm reset (seen once in ~10 reboots), which a power cycle avoids.
    fn power_on(&mut self) {
        let vars = self.dir.join("OVMF_VARS.fd");
        let disk = self.disk.clone();
        let child = self
            .exec("qemu-system-x86_64")
            .args(["-accel", "tcg", "-cpu", "max", "-m", "2048", "-smp", "2", "-nographic", "-monitor", "none"])
            .arg("-no-reboot")
            // The console log goes on across power cycles (a file: serial would truncate it).
            .arg("-chardev")
            .arg(format!("file,id=console,append=on,path={}", self.serial().display()))
            .args(["-serial", "chardev:console"])
            .arg("-drive")
            .arg(format!("if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}"))
            .arg("-drive")
            .arg(format!("if=pflash,format=raw,unit=1,file={}", vars.display()))
            .arg("-drive")
            .arg(format!("file={},format=raw,if=virtio", disk.display()))
            .args(["-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no"])
            .args(["-device", &format!("virtio-net-pci,netdev=n0,mac={HUB_MAC}")])
            // A hardware watchdog for systemd to arm.
            .args(["-device", "i6300esb"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::options().create(true).append(true).open(self.dir.join("qemu.err")).unwrap())
            .spawn()
            .unwrap();
        self.qemu = Some(child);
    }

    fn serial(&self) -> PathBuf {
        self.dir.join("serial.log")
    }

    /// How many times GRUB started a slot so far, and the last slot it chose.
    fn boots(&self) -> (usize, Option<char>) {
        let log = std::fs::read(self.serial()).unwrap_or_default();
        let log = String::from_utf8_lossy(&log);
        let lines: Vec<&str> = log.matches("Shoal hub: system slot ").collect();
        let last = log.rfind("Shoal hub: system slot ").and_then(|i| log[i + 23..].chars().next());
        (lines.len(), last)
    }

    /// The box's setup code, as its console showed it last (the login prompt on the
    /// serial console prints it: `usr/lib/shoal-hub/setup-code`), once it is not `not`.
    fn setup_code(&mut self, not: Option<&str>) -> String {
        wait_for("the setup code on the console", 120, || {
            self.check_vm();
            let log = std::fs::read(self.serial()).unwrap_or_default();
            let log = String::from_utf8_lossy(&log);
            let at = log.rfind("Shoal hub setup code: ")? + 22;
            let code: String = log[at..].chars().take(14).collect();
            (code.len() == 14 && Some(code.as_str()) != not).then_some(code)
        })
    }

    /// Wait for boot number `n` (1-based) to reach the node's page; its time.
    fn wait_boot(&mut self, n: usize, http: &Http) -> Duration {
        let t0 = Instant::now();
        wait_for(&format!("boot {n} to start (GRUB)"), 600, || {
            self.check_vm();
            (self.boots().0 >= n).then_some(())
        });
        wait_for(&format!("boot {n}: the page to answer"), 600, || {
            self.check_vm();
            http.get("/admin/api/session").ok()
        });
        t0.elapsed()
    }

    fn check_vm(&mut self) {
        if let Some(q) = self.qemu.as_mut() {
            match q.try_wait() {
                // The box rebooted: power it on again.
                Ok(Some(st)) if st.success() => self.power_on(),
                Ok(Some(st)) => panic!(
                    "qemu exited ({st}): {}",
                    std::fs::read_to_string(self.dir.join("qemu.err")).unwrap_or_default()
                ),
                _ => {}
            }
        }
    }

    fn tail(&self) -> String {
        let log = std::fs::read(self.serial()).unwrap_or_default();
        let log = String::from_utf8_lossy(&log);
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        for c in [self.qemu.as_mut(), self.dnsmasq.as_mut(), self.node.as_mut()].into_iter().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip").args(["netns", "delete", &self.ns]).status();
    }
}

/// A browser on the LAN: curl in the namespace, addressing the box as `shoal.local`
/// (resolved to its address, as mDNS would), with a cookie jar and the CSRF token.
struct Http {
    ns: String,
    jar: PathBuf,
    csrf: std::cell::RefCell<String>,
}

impl Http {
    fn curl(&self) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, "curl", "-sS", "-m", "120"])
            .args(["--resolve", &format!("shoal.local:11434:{HUB_IP}"), "-c"])
            .arg(&self.jar)
            .arg("-b")
            .arg(&self.jar)
            .args(["-w", "\n%{http_code}"]);
        c
    }

    fn run(&self, mut c: Command) -> Result<(u16, Value), String> {
        let out = c.output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let (body, code) = text.rsplit_once('\n').ok_or("no status")?;
        let code: u16 = code.trim().parse().map_err(|_| format!("status {code:?}"))?;
        Ok((code, serde_json::from_str(body).unwrap_or(Value::String(body.to_string()))))
    }

    fn get(&self, path: &str) -> Result<Value, String> {
        let mut c = self.curl();
        c.arg(format!("http://shoal.local:11434{path}"));
        match self.run(c)? {
            (200, v) => Ok(v),
            (code, v) => Err(format!("GET {path}: {code} {v}")),
        }
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let mut c = self.curl();
        c.args(["-H", "content-type: application/json", "-H"])
            .arg(format!("x-csrf-token: {}", self.csrf.borrow()))
            .arg("--data-binary")
            .arg(body.to_string())
            .arg(format!("http://shoal.local:11434{path}"));
        self.run(c).unwrap_or_else(|e| panic!("POST {path}: {e}"))
    }

    fn upload(&self, path: &str, file: &Path) -> (u16, Value) {
        let mut c = self.curl();
        c.args(["-H", "content-type: application/octet-stream", "-H"])
            .arg(format!("x-csrf-token: {}", self.csrf.borrow()))
            .arg("--data-binary")
            .arg(format!("@{}", file.display()))
            .arg(format!("http://shoal.local:11434{path}"));
        self.run(c).unwrap_or_else(|e| panic!("upload {path}: {e}"))
    }

    fn login(&self) {
        // Right after a boot the node may still be starting its cluster.
        let s = wait_for("the page to ask for a login", 120, || {
            let s = self.get("/admin/api/session").ok()?;
            matches!(s["state"].as_str(), Some("login" | "in")).then_some(s)
        });
        let _ = s;
        let (code, v) = self.post("/admin/api/login", &json!({"password": PASSWORD}));
        assert_eq!(code, 200, "login: {v}");
        let s = self.get("/admin/api/session").unwrap();
        assert_eq!(s["state"], "in", "{s}");
        *self.csrf.borrow_mut() = s["csrf"].as_str().unwrap().to_string();
    }

    fn act(&self, action: Value) -> Value {
        let (code, v) = self.post("/admin/api/action", &action);
        assert_eq!(code, 200, "{action}: {v}");
        v
    }

    fn appliance(&self) -> Value {
        self.get("/admin/api/appliance").unwrap()
    }
}

/// The image's root, unpacked to be changed into the roots of test updates.
fn unpack(work: &Path, rootfs: &Path) -> PathBuf {
    let dir = work.join("root");
    sh(Command::new("unsquashfs").args(["-q", "-n", "-d"]).arg(&dir).arg(rootfs));
    dir
}

/// `root` as a read-only system image (gzip: quicker to make here than the image's xz,
/// and GRUB reads both).
fn squash(work: &Path, root: &Path, name: &str) -> PathBuf {
    let sqfs = work.join(format!("{name}.sqfs"));
    sh(Command::new("mksquashfs").arg(root).arg(&sqfs).args(["-noappend", "-comp", "gzip", "-quiet"]));
    sqfs
}

/// `sqfs` as a bundle of `version`, signed with `key` (key, certificate).
fn bundle(work: &Path, sqfs: &Path, version: &str, key: (&Path, &Path)) -> PathBuf {
    let out = work.join(format!("{version}.raucb"));
    sh(Command::new(workspace().join("firmware/bundle.sh"))
        .arg("--rootfs")
        .arg(sqfs)
        .args(["--arch", "amd64", "--version", version, "--signing-key"])
        .arg(key.0)
        .arg("--signing-cert")
        .arg(key.1)
        .arg("--out")
        .arg(&out));
    out
}

fn set_image_version(root: &Path, version: &str) {
    let p = root.join("usr/lib/os-release");
    let text = std::fs::read_to_string(&p).unwrap();
    let text: String =
        text.lines().filter(|l| !l.starts_with("IMAGE_VERSION=")).map(|l| format!("{l}\n")).collect::<String>()
            + &format!("IMAGE_VERSION={version}\n");
    std::fs::write(p, text).unwrap();
}

/// Wait until the box has rebooted (GRUB counted one more boot) and the page answers.
fn reboot_wait(lan: &mut Lan, http: &Http, boots: &mut usize, what: &str) -> Duration {
    *boots += 1;
    let t = lan.wait_boot(*boots, http);
    eprintln!("boot {boots} ({what}): slot {:?}, page after {:.0} s", lan.boots().1, t.as_secs_f64());
    t
}

/// status.json as the page shows it, once `f` holds.
fn wait_status(http: &Http, what: &str, secs: u64, f: impl Fn(&Value) -> bool) -> Value {
    wait_for(what, secs, || {
        let a = http.get("/admin/api/appliance").ok()?;
        f(&a["status"]).then_some(a["status"].clone())
    })
}

/// The image (from this build's Shoal) and the test's three update bundles: the next
/// version, one whose Shoal cannot start, one signed by a stranger.
fn build_all(work: &Path, out: &Path, rootfs: &Path, key: (&Path, &Path)) {
    // The image, from this build's Shoal (the test profile's binary as a .deb).
    let deb = work.join("shoal.deb");
    sh(Command::new("cargo")
        .current_dir(workspace())
        .args(["deb", "-p", "shoal", "--no-build", "--profile", "dev", "--fast", "--quiet", "-o"])
        .arg(&deb));
    let t = Instant::now();
    sh(Command::new(workspace().join("firmware/build.sh"))
        .arg("--deb")
        .arg(&deb)
        .arg("--out")
        .arg(out)
        .args(["--version", "1.0-test"]));
    eprintln!("image built in {:.0} s", t.elapsed().as_secs_f64());

    // Bundles: the next version; one whose Shoal cannot start; one signed by a stranger.
    let t = Instant::now();
    let root = unpack(work, rootfs);
    set_image_version(&root, "2.0-test");
    let next_root = squash(work, &root, "next");
    bundle(work, &next_root, "2.0-test", key);
    set_image_version(&root, "3.0-broken");
    std::fs::write(
        root.join("etc/systemd/system/shoal.service.d/zz-broken.conf"),
        "[Service]\nExecStart=\nExecStart=/bin/false\n",
    )
    .unwrap();
    bundle(work, &squash(work, &root, "broken"), "3.0-broken", key);
    let _ = std::fs::remove_dir_all(&root);
    let stranger = work.join("stranger");
    std::fs::create_dir(&stranger).unwrap();
    sh(Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"])
        .args(["-days", "1", "-subj", "/CN=stranger", "-keyout"])
        .arg(stranger.join("key.pem"))
        .arg("-out")
        .arg(stranger.join("cert.pem")));
    bundle(work, &next_root, "9.9-forged", (&stranger.join("key.pem"), &stranger.join("cert.pem")));
    eprintln!("three bundles made in {:.0} s", t.elapsed().as_secs_f64());
}

#[test]
#[ignore = "opt-in, ~20 min: boots the hub image under qemu; run `sudo firmware/test.sh`"]
fn the_hub_image_boots_is_set_up_from_the_lan_updates_rolls_back_and_resets() {
    if let Some(why) = missing() {
        return shoal_testnet::precondition::skip(&why);
    }
    // Kept after the run (the console log, the PC's log) in target/tmp/hub-image.
    let work_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hub-image");
    let reuse = std::env::var_os("SHOAL_HUB_REUSE").is_some() && work_dir.join("image/shoal-hub-amd64.img").exists();
    if !reuse {
        let _ = std::fs::remove_dir_all(&work_dir);
    }
    for stale in ["disk.raw", "cookies", "serial.log", "pc", "leases", "stranger", "root"] {
        let p = work_dir.join(stale);
        let _ = std::fs::remove_file(&p).or_else(|_| std::fs::remove_dir_all(&p));
    }
    std::fs::create_dir_all(&work_dir).unwrap();
    let work = work_dir.as_path();

    let out = work.join("image");
    let image = out.join("shoal-hub-amd64.img");
    let rootfs = out.join("rootfs.sqfs");
    let keys = PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/shoal/firmware-keys");
    let key = (keys.join("dev.key.pem"), keys.join("dev.cert.pem"));
    let key = (key.0.as_path(), key.1.as_path());
    let (next, broken, forged) =
        (work.join("2.0-test.raucb"), work.join("3.0-broken.raucb"), work.join("9.9-forged.raucb"));
    if !reuse {
        build_all(work, &out, &rootfs, key);
    }
    // The disk: a copy of the image, as written to the box.
    let disk = work.join("disk.raw");
    sh(Command::new("cp").arg("--sparse=always").arg(&image).arg(&disk));
    // The box's disk is bigger than the image: the data partition grows into the rest.
    sh(Command::new("truncate").args(["-s", "+2G"]).arg(&disk));
    // The journal on the serial console (serial.log), through GRUB's EXTRA_CMDLINE.
    let env = work.join("grubenv");
    let esp = format!("{}@@1M", disk.display());
    sh(Command::new("mcopy").args(["-o", "-i", &esp, "::/EFI/shoal/grubenv"]).arg(&env));
    sh(Command::new("grub-editenv").arg(&env).args(["set", "EXTRA_CMDLINE=systemd.journald.forward_to_console=1"]));
    sh(Command::new("mcopy").args(["-o", "-i", &esp]).arg(&env).arg("::/EFI/shoal/grubenv"));
    let mut lan = Lan::new(work);
    lan.start_dhcp();
    let http = Http { ns: lan.ns.clone(), jar: work.join("cookies"), csrf: Default::default() };
    lan.start_vm(&disk);
    let mut boots = 0;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // First boot: /health answers (401 from the LAN without an API key: it is
        // Shoal answering), the page offers the first-boot setup to this LAN browser.
        let first = reboot_wait(&mut lan, &http, &mut boots, "first");
        let health = sh(lan
            .exec("curl")
            .args(["-s", "-m", "10", "-o", "/dev/null", "-w", "%{http_code}"])
            .arg(format!("http://{HUB_IP}:11434/health")));
        assert!(matches!(health.as_str(), "200" | "401" | "503"), "/health: {health}");
        eprintln!("first boot: Shoal's /health answered ({health}) {:.0} s after the VM started", first.as_secs_f64());
        // Port 80 is the page too.
        let page = sh(lan.exec("curl").args(["-s", "-L", "-m", "10"]).arg(format!("http://{HUB_IP}/admin/")));
        assert!(page.contains("<html") || page.contains("<!doctype"), "port 80: {page}");
        let s = wait_for("a cluster to form (setup state)", 60, || {
            let s = http.get("/admin/api/session").ok()?;
            (s["state"] == "setup").then_some(s)
        });
        assert_eq!(s["appliance"], true, "{s}");
        assert_eq!(s["here"], true, "a LAN browser at shoal.local may set the box up: {s}");
        // Without the box's setup code (on its console), a LAN browser cannot.
        let (code, v) = http.post("/admin/api/setup", &json!({"password": PASSWORD}));
        assert_eq!(code, 403, "setup without the box's code: {v}");
        let setup_code = lan.setup_code(None);
        let (code, v) = http.post(
            "/admin/api/setup",
            &json!({"password": PASSWORD, "code": setup_code, "cluster_name": "Home lab", "timezone": "Europe/Paris"}),
        );
        assert_eq!(code, 200, "setup: {v}");
        http.login();
        let st = wait_status(&http, "the time zone applied", 60, |s| s["timezone"] == "Europe/Paris");
        assert_eq!(st["booted"], "A", "{st}");
        assert_eq!(st["hardware_watchdog"], true, "the i6300esb watchdog is not armed: {st}");
        let data = st["data_bytes"].as_u64().unwrap_or(0);
        assert!(data > 2 << 30, "the data partition did not grow into the disk: {st}");
        eprintln!("data partition: {:.1} GiB (256 MiB in the image)", data as f64 / (1u64 << 30) as f64);
        let cluster_id = http.get("/admin/api/session").unwrap()["cluster"].clone();

        // A Shoal node on the LAN joins with a token made on the hub's page.
        let token = http.act(json!({"action": "join_token"}))["token"].as_str().unwrap().to_string();
        let node_dir = work.join("pc");
        let node = lan
            .exec(env!("CARGO_BIN_EXE_shoal"))
            .args(["serve", "--name", "pc", "--mdns-allow", "br0", "--no-create", "--max-memory", "256M"])
            .args(["--http-listen", &format!("{HOST_IP}:11500"), "--join-token", &token, "--data-dir"])
            .arg(&node_dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(work.join("pc.log")).unwrap())
            .spawn()
            .unwrap();
        lan.node = Some(node);
        let pc_status = |lan: &Lan| -> Option<Value> {
            let out = lan
                .exec(env!("CARGO_BIN_EXE_shoal"))
                .args(["status", "--json", "--data-dir"])
                .arg(&node_dir)
                .output()
                .ok()?;
            serde_json::from_slice::<Value>(&out.stdout).ok()
        };
        let joined = wait_for("the PC in the hub's cluster", 120, || {
            let s = pc_status(&lan)?;
            (s["cluster"] == cluster_id && s["members"].as_array().map_or(0, Vec::len) == 2).then_some(s)
        });
        eprintln!("the PC joined the hub's cluster {cluster_id}; leader {}", joined["leader"]);

        // Reboot: password, cluster name, time zone and the PC are all still there.
        http.act(json!({"action": "appliance_reboot"}));
        reboot_wait(&mut lan, &http, &mut boots, "after a reboot");
        http.login();
        assert_eq!(http.get("/admin/api/session").unwrap()["cluster"], cluster_id);
        let a = http.appliance();
        assert_eq!(a["settings"]["timezone"], "Europe/Paris", "{a}");
        let o = http.get("/admin/api/overview").unwrap();
        assert!(o.to_string().contains("Home lab"), "the cluster name was lost: {o}");
        wait_for("the PC back in the cluster", 120, || {
            let s = pc_status(&lan)?;
            (s["members"].as_array().map_or(0, Vec::len) == 2 && !s["leader"].is_null()).then_some(())
        });

        // A bundle signed by another key is refused; nothing changes.
        let (code, v) = http.upload("/admin/api/appliance/bundle", &forged);
        assert_eq!(code, 200, "upload: {v}");
        http.act(json!({"action": "appliance_update"}));
        let st = wait_status(&http, "the forged bundle refused", 300, |s| s["update"]["state"] == "failed");
        eprintln!("forged bundle: {}", st["update"]["message"]);
        assert!(st["update"]["message"].as_str().unwrap_or("").contains("signature"), "{st}");
        assert_eq!(lan.boots().0, boots, "the box rebooted after a refused bundle");

        // A broken one: slot B gets it, fails its health check, the box goes back to A.
        let (code, v) = http.upload("/admin/api/appliance/bundle", &broken);
        assert_eq!(code, 200, "upload: {v}");
        http.act(json!({"action": "appliance_update"}));
        let before = boots;
        wait_for("the broken slot to boot and fail", 900, || {
            lan.check_vm();
            (lan.boots().0 >= before + 2).then_some(())
        });
        boots = before + 1;
        reboot_wait(&mut lan, &http, &mut boots, "the rollback");
        http.login();
        let st = wait_status(&http, "the rollback reported", 300, |s| s["update"]["state"] == "rolled-back");
        assert_eq!(st["booted"], "A", "{st}");
        assert!(st["version"].as_str().unwrap_or("").starts_with("1.0-test"), "{st}");
        eprintln!("broken update rolled back: {}", st["update"]["message"]);

        // The next version: installed into slot B (the broken one is overwritten), booted, kept.
        let (code, v) = http.upload("/admin/api/appliance/bundle", &next);
        assert_eq!(code, 200, "upload: {v}");
        http.act(json!({"action": "appliance_update"}));
        let t = reboot_wait(&mut lan, &http, &mut boots, "the update");
        http.login();
        let st = wait_status(&http, "the update kept", 600, |s| s["update"]["state"] == "good");
        assert_eq!(st["booted"], "B", "{st}");
        assert!(st["version"].as_str().unwrap_or("").starts_with("2.0-test"), "{st}");
        eprintln!(
            "update to slot B: installed, booted and kept ({:.0} s from the request to the page)",
            t.as_secs_f64()
        );
        assert_eq!(http.appliance()["settings"]["timezone"], "Europe/Paris");

        // Factory reset: the first-boot setup again, the old password refused, the
        // settings gone; the system slots kept. (The PC is stopped first: a reset hub
        // on a LAN with a cluster waits to be let in to it, as any new node does.)
        if let Some(mut pc) = lan.node.take() {
            let _ = pc.kill();
            let _ = pc.wait();
        }
        http.act(json!({"action": "appliance_reset"}));
        reboot_wait(&mut lan, &http, &mut boots, "the factory reset");
        let s = wait_for("the setup state after the reset", 120, || {
            let s = http.get("/admin/api/session").ok()?;
            (s["state"] == "setup").then_some(s)
        });
        assert_ne!(s["cluster"], cluster_id, "the reset kept the cluster");
        let (code, _) = http.post("/admin/api/login", &json!({"password": PASSWORD}));
        assert_ne!(code, 200, "the old password still works after a factory reset");
        // A new data partition, a new setup code.
        let new_code = lan.setup_code(Some(&setup_code));
        let (code, v) = http.post("/admin/api/setup", &json!({"password": "a new owner's password", "code": new_code}));
        assert_eq!(code, 200, "setup after the reset: {v}");
        *http.csrf.borrow_mut() = v["csrf"].as_str().unwrap_or_default().to_string();
        let a = http.appliance();
        assert_eq!(a["settings"]["timezone"], Value::Null, "the time zone survived the reset: {a}");
        let st = wait_status(&http, "the status after the reset", 120, |s| !s["booted"].is_null());
        assert_eq!(st["booted"], "B", "the reset changed the system slot: {st}");
        assert_eq!(st["update"], Value::Null, "{st}");
        eprintln!("factory reset: first-boot setup again, settings gone, slot B kept");
    }));
    if let Err(e) = result {
        eprintln!("--- the box's console (last lines) ---\n{}", lan.tail());
        if let Ok(log) = std::fs::read_to_string(work.join("pc.log")) {
            eprintln!("--- the PC's log ---\n{log}");
        }
        std::panic::resume_unwind(e);
    }
}
