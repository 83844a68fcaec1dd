// A hub box's page in a real browser (Debian's Chromium, headless, driven by
// playwright-core, as admin.cjs): first boot from "another machine" that reaches the
// box as shoal.local (a host-resolver rule maps it to the node on loopback), then the
// System card. Run by daemon/shoal/tests/page.rs against one `shoal serve --role hub
// --appliance` node; the script plays the image's system side by writing status.json and the setup code.
//   SHOAL_URL        the node's API, e.g. http://127.0.0.1:41234
//   SHOAL_APPLIANCE  its appliance folder (<data dir>/appliance)
//   SHOAL_ZONE       a time zone of this machine's database (the browser's, here)
//   SHOAL_ARTIFACTS  where the screenshots go
//   SHOAL_CHROMIUM   the browser (default /usr/bin/chromium)
// It exits 0 when every check held; else it prints what failed and exits 1.

const { chromium } = require("playwright-core");
const path = require("path");
const fs = require("fs");
const os = require("os");

const env = (k) => {
  const v = process.env[k];
  if (v === undefined) throw new Error(`${k} is not set`);
  return v;
};
const port = new URL(env("SHOAL_URL")).port;
const dir = env("SHOAL_APPLIANCE");
const zone = env("SHOAL_ZONE");
const artifacts = env("SHOAL_ARTIFACTS");
const PASSWORD = "a long admin password";

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
  console.log(`ok: ${what}`);
}

/** The JSON of a file the node wrote (in the appliance folder's inbox), or null. */
function file(name) {
  try { return JSON.parse(fs.readFileSync(path.join(dir, "inbox", name), "utf8")); } catch { return null; }
}

/** Wait until `f()` is truthy (up to 10 s); its value. */
async function until(what, f) {
  for (let i = 0; i < 100; i++) {
    const v = f();
    if (v) { console.log(`ok: ${what}`); return v; }
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`check failed: ${what} (within 10 s)`);
}

/** What the image's system side would write. */
function status(fields) {
  const s = { booted: "A", version: "1.0.0", hardware_watchdog: true, timezone: zone, wifi: "home net",
    update: { state: "none", message: "", at: 0 }, ...fields };
  fs.writeFileSync(path.join(dir, "status.json"), JSON.stringify(s));
}

(async () => {
  fs.mkdirSync(artifacts, { recursive: true });
  const browser = await chromium.launch({
    executablePath: process.env.SHOAL_CHROMIUM || "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
      "--disable-component-update", "--disable-sync", "--disable-default-apps",
      // The box as the LAN reaches it, and a name of another site that leads to it.
      "--host-resolver-rules=MAP shoal.local 127.0.0.1, MAP shoal.test 127.0.0.1"],
  });
  const errors = [];
  try {
    // Through another site's name, the box does not offer its first boot.
    const stranger = await (await browser.newContext()).newPage();
    await stranger.goto(`http://shoal.test:${port}/admin/`);
    await stranger.locator("#setup-elsewhere").waitFor({ state: "visible" });
    check(await stranger.locator("#elsewhere-hub").isVisible(), "through another name: where to set the box up");

    // The image's system side makes the box's setup code at first boot (root's file).
    const CODE = "4821-9375-1064";
    fs.writeFileSync(path.join(dir, "setup-code"), CODE + "\n");
    const context = await browser.newContext({ timezoneId: zone });
    const page = await context.newPage();
    page.on("pageerror", (e) => errors.push(String(e)));
    await page.goto(`http://shoal.local:${port}/admin/`);
    await page.locator("#setup").waitFor({ state: "visible" });
    check(await page.locator("#setup-hub").isVisible(), "the first-boot form asks for the box's settings");
    check(await page.locator("#setup-code").isVisible(), "and, from another machine, for the box's setup code");
    check(await page.inputValue("#setup-timezone") === zone, `the time zone is the browser's (${zone})`);
    check(await page.locator("#timezones option").count() > 100, "time zones to pick from");
    await page.fill("#setup-password", PASSWORD);
    await page.fill("#setup-confirm", PASSWORD);
    await page.fill("#setup-name", "Home");
    await page.fill("#setup-ssid", "home net");
    await page.fill("#setup-code", "4821 9375 1065");
    await page.fill("#setup-passphrase", "short");
    await page.click("#setup-submit");
    check((await page.textContent("#setup-error")).includes("8 to 63"), "a bad passphrase is said inline");
    check(file("settings.json") === null, "and nothing is written");
    // A wrong setup code: refused by the node, nothing stored (a stranger on the LAN
    // would own the box).
    await page.fill("#setup-passphrase", "correct horse");
    await page.click("#setup-submit");
    await page.locator("#setup-error", { hasText: "setup code" }).waitFor();
    check(file("settings.json") === null && file("request.json") === null, "a wrong setup code: refused, nothing stored");
    // The node checks the rest too: a time zone it does not have.
    await page.fill("#setup-code", CODE);
    await page.fill("#setup-timezone", "Mars/Olympus");
    await page.click("#setup-submit");
    await page.locator("#setup-error", { hasText: "time zone" }).waitFor();
    check(file("settings.json") === null && file("request.json") === null, "a time zone the box lacks: refused, nothing stored");
    await page.fill("#setup-timezone", zone);
    await page.screenshot({ path: path.join(artifacts, "12-hub-first-boot.png"), fullPage: true });
    await page.click("#setup-submit");
    await page.locator("#tabs").waitFor({ state: "visible" });
    check(JSON.stringify(file("settings.json")) === JSON.stringify({ timezone: zone, wifi: { ssid: "home net", passphrase: "correct horse" } }),
      "settings.json holds the first-boot settings");
    const first = file("request.json");
    check(first && first.action === "apply", "and the box is asked to apply them");

    // The system side reports; the System card shows it.
    status({ request: { id: first.id, action: "apply", state: "done", message: "settings applied" } });
    await page.reload();
    await page.locator("#tabs").waitFor({ state: "visible" });
    await page.getByRole("link", { name: "Settings" }).click();
    await page.locator("#system-card").waitFor({ state: "visible" });
    await page.locator("#system-facts", { hasText: "slot A" }).waitFor();
    check((await page.textContent("#system-facts")).includes("version 1.0.0"), "the booted slot and version");
    check((await page.textContent("#wifi-now")).includes("Joined: home net"), "the WiFi network joined");
    check(await page.inputValue("#system-timezone") === zone, "the time zone");
    await page.locator("#cluster", { hasText: "Home" }).waitFor({ timeout: 10000 });
    check(true, "the cluster is called as the first boot said");

    // A new time zone: asked, followed until the box says it is done.
    await page.fill("#system-timezone", "UTC");
    await page.click("#timezone-form button[type=submit]");
    const asked = await until("the time zone change is asked", () => { const r = file("request.json"); return r && r.id !== first.id && r; });
    check(file("settings.json").timezone === "UTC" && file("settings.json").wifi.ssid === "home net", "UTC, the WiFi kept");
    await page.locator("#system-request", { hasText: "waiting" }).waitFor();
    status({ timezone: "UTC", request: { id: asked.id, action: "apply", state: "done", message: "settings applied" } });
    await page.locator("#system-request", { hasText: "Done" }).waitFor({ timeout: 10000 });
    check(true, "the page followed the request to its end");

    // An update: the bundle streams up, then the box is asked to install it.
    const bundle = path.join(os.tmpdir(), `shoal-hub-test-${process.pid}.raucb`);
    fs.writeFileSync(bundle, Buffer.alloc(256 << 10, 7));
    await page.setInputFiles("#bundle-file", bundle);
    await page.click("#bundle-send");
    const update = await until("an update is asked", () => { const r = file("request.json"); return r && r.action === "update" && r; });
    check(fs.readFileSync(path.join(dir, "inbox", "update.raucb")).equals(fs.readFileSync(bundle)), "the bundle arrived whole");
    fs.unlinkSync(bundle);
    status({ request: { id: update.id, action: "update", state: "running", message: "" }, update: { state: "installing", message: "", at: 1 } });
    await page.locator("#update-status", { hasText: "Installing" }).waitFor({ timeout: 10000 });
    status({ booted: "B", version: "1.1.0", request: { id: update.id, action: "update", state: "done", message: "" }, update: { state: "good", message: "", at: 2 } });
    await page.locator("#update-status", { hasText: "runs the update" }).waitFor({ timeout: 10000 });
    check(true, "the update's progress is shown as the box reports it");

    // Reboot, and a factory reset whose warning names what is lost.
    page.once("dialog", (d) => d.accept());
    await page.click("#reboot");
    await until("a reboot is asked", () => { const r = file("request.json"); return r && r.action === "reboot"; });
    let warning = "";
    page.once("dialog", (d) => { warning = d.message(); d.accept(); });
    await page.click("#factory-reset");
    await until("a factory reset is asked", () => { const r = file("request.json"); return r && r.action === "reset"; });
    check(/erased/.test(warning) && /models/.test(warning) && /password/.test(warning), "the reset's warning names what is lost");
    await page.screenshot({ path: path.join(artifacts, "13-hub-system.png"), fullPage: true });
    check(errors.length === 0, `no script errors (${errors.join("; ")})`);
  } catch (e) {
    console.log(String(e && e.stack || e));
    process.exitCode = 1;
  } finally {
    await browser.close();
  }
})();
