// The admin page in a real browser: Debian's Chromium, headless, driven by
// playwright-core (from npm; scripts/setup.sh installs both). Run by the Rust test
// daemon/shoal/tests/page.rs against `shoal serve` nodes on loopback; the environment
// says where and what to expect:
//   SHOAL_URL        the first node's API, e.g. http://127.0.0.1:41234
//   SHOAL_NODES      how many members there are at first
//   SHOAL_BIN        the shoal binary, to run the join command the page shows, on
//   SHOAL_NEW_DIR    the data directory of a started node that is not a member yet,
//   SHOAL_NEW_ID     whose id this is
//   SHOAL_MODEL      a GGUF to add by path, load, and chat with
//   SHOAL_BAD_UPLOAD a file shaped like a GGUF that is not a model, to upload
//   SHOAL_DOWNLOAD   the URL of a GGUF on a local HTTP server, to download
//   SHOAL_STAGES     how many stages its placement should show
//   SHOAL_PROMPT     a message, and the greedy answer `shoal run` gives it in
//   SHOAL_EXPECT     SHOAL_MAX_TOKENS tokens
//   SHOAL_MAX_TOKENS
//   SHOAL_KILL_PID   a member (not the leader) this script SIGKILLs, its id and name:
//   SHOAL_KILL_ID
//   SHOAL_KILL_NAME
//   SHOAL_ARTIFACTS  where the screenshots go
//   SHOAL_CHROMIUM   the browser (default /usr/bin/chromium)
// It exits 0 when every check held; else it prints what failed and exits 1.

const { chromium } = require("playwright-core");
const { execFileSync } = require("child_process");
const path = require("path");
const fs = require("fs");

const env = (k) => {
  const v = process.env[k];
  if (v === undefined) throw new Error(`${k} is not set`);
  return v;
};
const url = env("SHOAL_URL");
const artifacts = env("SHOAL_ARTIFACTS");
const PASSWORD = "a long admin password";

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
  console.log(`ok: ${what}`);
}

async function shot(page, name) {
  const file = path.join(artifacts, `${name}.png`);
  await page.screenshot({ path: file, fullPage: true });
  console.log(`screenshot: ${file}`);
}

async function tab(page, name) {
  await page.getByRole("link", { name }).click();
  await page.locator(`#${name.toLowerCase()}`).waitFor({ state: "visible" });
}

(async () => {
  fs.mkdirSync(artifacts, { recursive: true });
  const browser = await chromium.launch({
    executablePath: process.env.SHOAL_CHROMIUM || "/usr/bin/chromium",
    // Root in CI: no sandbox. No background traffic (the machine has no internet and
    // the test counts every request).
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
      "--disable-component-update", "--disable-sync", "--disable-default-apps",
      // A name of another site that leads to this node (what DNS rebinding does).
      "--host-resolver-rules=MAP shoal.test 127.0.0.1"],
  });
  const origin = new URL(url).host;
  const requests = [];
  const errors = [];
  const watch = (page) => {
    page.on("request", (r) => requests.push(r.url()));
    page.on("pageerror", (e) => errors.push(String(e)));
    // Refusals the test asks for (401, 403) are logged by the browser as failed loads.
    page.on("console", (m) => {
      if (m.type() === "error" && !m.text().startsWith("Failed to load resource")) errors.push(m.text());
    });
  };
  try {
    // Through a name that is not this machine's, a fresh cluster's page does not offer
    // to set the first password (whoever sets it owns the cluster), and the node
    // refuses it.
    const stranger = await (await browser.newContext()).newPage();
    const port = new URL(url).port;
    await stranger.goto(`http://shoal.test:${port}/admin/`);
    await stranger.locator("#setup-elsewhere").waitFor({ state: "visible" });
    const refused = await stranger.evaluate(async () => (await fetch("/admin/api/setup", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ password: "taken over!" }),
    })).status);
    check(refused === 403, `the first password cannot be set through another name (${refused})`);
    await shot(stranger, "00-first-run-elsewhere");

    const context = await browser.newContext({ colorScheme: "light", viewport: { width: 1280, height: 900 } });
    const page = await context.newPage();
    watch(page);

    // A browser at the root lands on the admin page; a fresh cluster asks for a password.
    await page.goto(url + "/");
    check(new URL(page.url()).pathname === "/admin/", `the root sends a browser to /admin/ (${page.url()})`);
    await page.locator("#setup").waitFor({ state: "visible" });
    await shot(page, "01-first-run");
    await page.getByLabel("Admin password (at least 8 characters)").fill(PASSWORD);
    await page.getByLabel("The same again").fill(PASSWORD + "x");
    await page.getByRole("button", { name: "Set password" }).click();
    await page.getByText("The two passwords differ.").waitFor();
    check(true, "two different passwords are refused on the page");
    await page.getByLabel("The same again").fill(PASSWORD);
    await page.getByRole("button", { name: "Set password" }).click();
    await page.locator("#overview").waitFor({ state: "visible" });
    check(true, "the first password logs the owner in");

    const session = (await context.cookies()).find((c) => c.name === "shoal_session");
    check(session && session.httpOnly && session.sameSite === "Strict", "the session cookie is HttpOnly and SameSite=Strict");

    // Every member appears, online, one of them the leader, each with its machine's report.
    const members = Number(env("SHOAL_NODES"));
    await page.waitForFunction((n) => document.querySelectorAll("#nodes .node.online").length === n
      && document.querySelectorAll("#nodes .node .badge.leader").length === 1
      && [...document.querySelectorAll("#nodes .node")].every((c) => c.querySelector("[role=meter]")), members,
      { timeout: 30000 });
    check(true, `${members} machines online, one leader, each with its memory bars`);
    await shot(page, "02-overview");

    // Logging out ends the session; a wrong password is refused; the right one lets in.
    await page.getByRole("button", { name: "Log out" }).click();
    await page.locator("#login").waitFor({ state: "visible" });
    const api = await page.evaluate(async () => (await fetch("/admin/api/overview")).status);
    check(api === 401, `the admin API refuses a request without a session (${api})`);
    await page.getByLabel("Admin password", { exact: true }).fill("not the password");
    await page.getByRole("button", { name: "Log in" }).click();
    await page.getByText("wrong password").waitFor();
    await shot(page, "03-login-refused");
    await page.getByLabel("Admin password", { exact: true }).fill(PASSWORD);
    await page.getByRole("button", { name: "Log in" }).click();
    await page.locator("#overview").waitFor({ state: "visible" });
    check(true, "logged in again with the password");
    const forged = await page.evaluate(async () => (await fetch("/admin/api/logout", { method: "POST" })).status);
    check(forged === 403, `a POST without the CSRF token is refused (${forged})`);

    // Machines: the new node waits to join; a join token lets it in.
    await tab(page, "Machines");
    const newId = env("SHOAL_NEW_ID");
    await page.locator(`#pending [data-node="${newId}"]`).waitFor({ timeout: 60000 });
    check(true, "the new machine is listed as waiting, with its fingerprint");
    await page.getByRole("button", { name: "Create join token" }).click();
    await page.waitForFunction(() => document.getElementById("join-command").value !== "");
    const command = await page.locator("#join-command").inputValue();
    check(/^shoal join \S+$/.test(command), `the page shows the command to run (${command.split(" ").slice(0, 2).join(" ")} …)`);
    await shot(page, "04-machines-token");
    execFileSync(env("SHOAL_BIN"), [...command.split(" ").slice(1), "--data-dir", env("SHOAL_NEW_DIR")], { stdio: "inherit" });
    await page.locator(`#members tr[data-node="${newId}"] .state-online`).waitFor({ timeout: 60000 });
    await page.waitForFunction(() => document.querySelectorAll("#members tbody tr").length >= 4, null, { timeout: 30000 });
    check(true, "the machine that ran the command is a member, online");

    // Models: an upload that is not a model is refused; the test model is added by
    // path, loaded, placed over the machines, shown as one bar.
    await tab(page, "Models");
    await page.locator("#upload-file").setInputFiles(env("SHOAL_BAD_UPLOAD"));
    await page.getByRole("button", { name: "Upload", exact: true }).click();
    await page.locator("#upload-status").filter({ hasText: "Refused" }).waitFor({ timeout: 60000 });
    check(true, `an upload that is not a model is refused (${await page.locator("#upload-status").textContent()})`);
    const model = env("SHOAL_MODEL");
    const name = path.basename(model);
    await page.getByLabel("Path of a GGUF file on the machine serving this page").fill(model);
    await page.getByRole("button", { name: "Add", exact: true }).click();
    const card = page.locator(`#catalog .model[data-model="${name}"]`);
    await card.waitFor({ timeout: 120000 });
    check(true, `${name} is in the catalog`);
    await page.getByLabel("Context when loading (positions per conversation; empty: 4096 or the model's own)").fill("512");
    await card.getByRole("button", { name: "Load" }).click();
    await page.locator(`#catalog .model[data-model="${name}"][data-state="ready"]`).waitFor({ timeout: 180000 });
    const stages = await page.locator(`#catalog .model[data-model="${name}"] .layers .stage`).count();
    check(stages === Number(env("SHOAL_STAGES")), `the placement bar shows ${stages} stages`);
    await page.waitForFunction((n) => [...document.querySelectorAll(`#catalog .model[data-model="${n}"] .legend li`)]
      .every((li) => li.textContent.includes("measured")), name, { timeout: 30000 });
    check(true, "each stage shows its predicted and measured memory");
    await card.getByText("Why this placement").click();
    check(await card.locator(".explain li").count() > 0, "the planner's reasons are shown");

    // What if a machine were left out: the planner's answer, nothing applied.
    await page.locator("#what-if-model").selectOption({ label: name });
    const out = env("SHOAL_KILL_ID");
    await page.locator(`#what-if input[type=checkbox][data-node="${out}"]`).check();
    await page.getByRole("button", { name: "Preview" }).click();
    const proposed = page.locator("#what-if .model.proposed");
    await proposed.waitFor({ timeout: 30000 });
    const onIt = await proposed.locator(`.stage[data-node="${out}"]`).count();
    const parts = await proposed.locator(".stage").count();
    const why = (await proposed.locator(".error").allTextContents()).join(" ");
    // Every machine offers 90 MiB and the model takes all three: without one, the
    // planner must say it does not fit (an error of any other kind is a failure).
    check(onIt === 0 && parts === 0 && /does not fit/.test(why),
      `the what-if leaves the machine out, and the model does not fit on the rest (${parts} stages; ${why})`);
    // Nothing was applied: the model still runs in its stages.
    const live = await page.locator(`#catalog .model[data-model="${name}"][data-state="ready"] .layers .stage`).count();
    check(live === Number(env("SHOAL_STAGES")), `the live placement is unchanged (${live} stages)`);
    await shot(page, "05b-what-if");

    // A download from a URL shows its progress and ends in the catalog; an import
    // from a store that is empty here says so.
    await page.getByLabel("URL of a GGUF file, or hf://org/repo/file.gguf").fill(env("SHOAL_DOWNLOAD"));
    await page.getByRole("button", { name: "Download", exact: true }).click();
    await page.locator("#downloads li").filter({ hasText: "added as" }).waitFor({ timeout: 120000 });
    check(true, `the download ended in the catalog (${await page.locator("#downloads li").first().textContent()})`);
    await page.getByRole("button", { name: "From LM Studio" }).click();
    await page.locator("#import-status").filter({ hasText: /Nothing new found|Added/ }).waitFor({ timeout: 30000 });
    check(true, `an import tells what it found (${await page.locator("#import-status").textContent()})`);
    await shot(page, "05-models");
    await tab(page, "Overview");
    await shot(page, "06-overview-placed");

    // Chat: the answer streams, greedy, the same as `shoal run`'s.
    await tab(page, "Chat");
    await page.locator(`#chat-model option[value="${name}"]`).waitFor({ state: "attached" });
    await page.locator("#chat-model").selectOption(name);
    await page.locator("#chat-max").fill(env("SHOAL_MAX_TOKENS"));
    await page.locator("#chat-temperature").fill("0");
    await page.getByLabel("Message").fill(env("SHOAL_PROMPT"));
    await page.getByRole("button", { name: "Send" }).click();
    await page.locator("#chat-stats").filter({ hasText: "first token" }).waitFor({ timeout: 120000 });
    await page.waitForFunction(() => !document.getElementById("chat-send").disabled, null, { timeout: 120000 });
    const answer = await page.locator("#chat-log .msg.assistant .text").last().textContent();
    check(answer === env("SHOAL_EXPECT"), `the chat answers as shoal run does (${JSON.stringify(answer)})`);
    console.log(`chat: ${await page.locator("#chat-stats").textContent()}`);
    await shot(page, "07-chat");
    // Stop ends a long answer part way.
    await page.locator("#chat-max").fill("400");
    await page.getByLabel("Message").fill("Write a long story about the sea.");
    await page.getByRole("button", { name: "Send" }).click();
    await page.waitForFunction(() => [...document.querySelectorAll("#chat-log .msg.assistant .text")].pop().textContent.length > 20,
      null, { timeout: 60000 });
    await page.getByRole("button", { name: "Stop" }).click();
    await page.locator("#chat-log .msg.assistant .text").last().filter({ hasText: "[stopped]" }).waitFor({ timeout: 10000 });
    check(await page.locator("#chat-send").isEnabled(), "Stop ends an answer part way, and the chat goes on");
    await tab(page, "Models");
    await page.locator(`#catalog .model[data-model="${name}"]`).filter({ hasText: "Last answer through this machine" })
      .waitFor({ timeout: 10000 });
    check(true, "the model's card shows the measured speed of the last answer beside the prediction");
    // The stages' compute per token, added up, against the answer's own time per token:
    // within it (the rest is the network and sampling) and not a small part of it, so a
    // figure in other units or divided by the steps again (once 50x too small) fails.
    const facts = card.locator(".facts").filter({ hasText: "the stages compute a token in" });
    await facts.waitFor({ timeout: 30000 });
    const text = await facts.textContent();
    const tokS = Number(/Last answer through this machine: ([\d.]+) tokens\/s/.exec(text)[1]);
    const computeMs = Number(/the stages compute a token in ([\d.]+) ms together/.exec(text)[1]);
    const perToken = 1000 / tokS;
    check(computeMs > 0.1 * perToken && computeMs <= 1.5 * perToken,
      `the stages' compute (${computeMs} ms) is most of a token's ${perToken.toFixed(1)} ms (${tokS} tokens/s)`);

    // Activity: the tokens/s chart (uPlot, embedded) and each stage's hop latency.
    await tab(page, "Activity");
    await page.locator("#chart .uplot canvas").first().waitFor({ timeout: 10000 });
    await page.waitForFunction(() => document.querySelectorAll("#hops tbody tr td").length >= 8, null, { timeout: 15000 });
    const hopRows = await page.locator("#hops tbody tr").count();
    check(true, `the activity shows the tokens/s chart and ${hopRows} rows of hop latency`);
    await shot(page, "08a-activity-running");

    // A member stops: its card says so without a reload, and the log tells it.
    process.kill(Number(env("SHOAL_KILL_PID")), "SIGKILL");
    await tab(page, "Overview");
    await page.locator(`#nodes .node[data-node="${env("SHOAL_KILL_ID")}"].down`).waitFor({ timeout: 30000 });
    check(true, "the stopped machine shows as down, live");
    await shot(page, "08-machine-down");
    await tab(page, "Activity");
    await page.locator("#events li").filter({ hasText: `${env("SHOAL_KILL_NAME")} is down` }).waitFor({ timeout: 10000 });
    check(true, "the activity log tells that it went down");
    await shot(page, "09-activity");

    // Settings: a name every page shows, an API key shown once and revoked, a new
    // password (a wrong current one refused).
    await tab(page, "Settings");
    await page.getByLabel("Name shown on every machine's page").fill("Home lab");
    await page.getByRole("button", { name: "Save name" }).click();
    await page.locator("#cluster").filter({ hasText: "Home lab" }).waitFor();
    check(true, "the cluster's name shows in the header");
    await page.getByLabel("What the key is for").fill("open-webui");
    await page.getByRole("button", { name: "Create key" }).click();
    await page.waitForFunction(() => document.getElementById("key-secret").value.startsWith("sk-shoal-"));
    await page.locator("#keys tbody tr").filter({ hasText: "open-webui" }).waitFor();
    check(true, "a new API key is shown once and listed by name");
    await shot(page, "10-settings");
    page.once("dialog", (d) => d.accept());
    await page.locator("#keys tbody tr").filter({ hasText: "open-webui" }).getByRole("button", { name: "Revoke" }).click();
    await page.locator("#keys tbody tr").filter({ hasText: "open-webui" }).waitFor({ state: "detached" });
    check(true, "a revoked key leaves the list");
    page.once("dialog", (d) => d.accept());
    await page.getByLabel(/Let every machine on the network call the API without a key/).check();
    await page.locator("#settings-status").filter({ hasText: "need no key" }).waitFor();
    await page.getByLabel("Stages between tokens").selectOption("on");
    await page.locator("#settings-status").filter({ hasText: "stages started from now on" }).waitFor();
    check(true, "the API's key requirement and keep-alive are set for every machine");
    await page.getByLabel("Current password").fill("not it at all");
    await page.getByLabel(/^New password/).fill(PASSWORD + "2");
    await page.getByRole("button", { name: "Change password" }).click();
    await page.locator("#settings-error").filter({ hasText: "current password is wrong" }).waitFor();
    await page.getByLabel("Current password").fill(PASSWORD);
    await page.getByRole("button", { name: "Change password" }).click();
    await page.locator("#settings-status").filter({ hasText: "password is changed" }).waitFor();
    check(true, "the password is changed from the page (a wrong current one refused)");

    // Dark, and a phone's width.
    const dark = await browser.newContext({ colorScheme: "dark", viewport: { width: 390, height: 844 }, isMobile: true });
    const phone = await dark.newPage();
    watch(phone);
    await phone.goto(url + "/admin/");
    await phone.getByLabel("Admin password", { exact: true }).fill(PASSWORD + "2");
    await phone.getByRole("button", { name: "Log in" }).click();
    await phone.locator("#nodes .node").first().waitFor();
    const fits = await phone.evaluate(() => document.documentElement.scrollWidth <= window.innerWidth + 1);
    check(fits, "no sideways scrolling on a phone");
    await shot(phone, "11-phone-dark");

    check(errors.length === 0, `no script errors (${errors.join("; ")})`);
    const foreign = requests.filter((r) => { try { return new URL(r).host !== origin; } catch { return true; } });
    check(foreign.length === 0, `${requests.length} requests, all to ${origin} (${foreign.join(", ")})`);
  } finally {
    await browser.close();
  }
})().catch((e) => {
  console.error(e.stack || String(e));
  process.exit(1);
});
