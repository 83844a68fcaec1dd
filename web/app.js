// Shoal's admin page: one module, no framework, no build step. It asks the node it
// came from (and no other host) what to show: /admin/api/session decides between
// first-run setup, login and the overview, which then stays live over server-sent
// events. Text from the network only ever goes in through textContent.

const $ = (id) => document.getElementById(id);
let csrf = "";
let events = null;

/** Send JSON to the admin API; resolves to [status, body]. */
async function call(method, path, body) {
  const headers = { "Content-Type": "application/json" };
  if (csrf) headers["X-CSRF-Token"] = csrf;
  const res = await fetch(path, {
    method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  let data = {};
  try { data = await res.json(); } catch { /* not JSON: keep {} */ }
  return [res.status, data];
}

const TABS = ["overview", "machines", "models", "chat", "activity", "settings"];

/** Show one of the page's views: a login step, or (logged in) the tab in the URL. */
function show(view) {
  const inside = view === "in";
  for (const id of ["loading", "unpaired", "setup", "setup-elsewhere", "login"]) $(id).hidden = id !== view;
  $("tabs").hidden = !inside;
  $("logout").hidden = !inside;
  $("live").hidden = !inside;
  const tab = TABS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "overview";
  for (const t of TABS) $(t).hidden = !inside || t !== tab;
  for (const a of document.querySelectorAll("#tabs a")) {
    if (a.dataset.tab === tab) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
  }
  const focus = { setup: "setup-password", login: "login-password" }[view];
  if (focus) $(focus).focus();
}
window.addEventListener("hashchange", () => { if (!$("tabs").hidden) show("in"); });

async function start() {
  const [status, s] = await call("GET", "/admin/api/session");
  if (status !== 200) { show("loading"); $("loading").textContent = s.error || `The node answered ${status}.`; return; }
  if (s.cluster) $("cluster").textContent = `cluster ${s.cluster.slice(0, 8)}`;
  if (s.state === "in") { csrf = s.csrf; enter(); }
  else if (s.state === "setup") {
    setupFor(Boolean(s.appliance));
    $("setup-code-box").hidden = !s.code;
    show(s.here ? "setup" : "setup-elsewhere");
  }
  else show(s.state === "unpaired" ? "unpaired" : "login");
}

/** The time zones this browser knows (with UTC), in the shared datalist, once. */
function timeZones() {
  const list = $("timezones");
  if (list.children.length) return;
  const zones = typeof Intl.supportedValuesOf === "function" ? Intl.supportedValuesOf("timeZone") : [];
  list.replaceChildren(...["UTC", ...zones.filter((z) => z !== "UTC")].map((z) => { const o = el("option"); o.value = z; return o; }));
}

/** The browser's own time zone, if it says. */
function browserZone() {
  try { return Intl.DateTimeFormat().resolvedOptions().timeZone || ""; } catch { return ""; }
}

/** The first-run form: the password alone, or a hub box's first-boot settings too. */
function setupFor(hub) {
  $("setup-hub").hidden = !hub;
  $("setup-intro-hub").hidden = !hub;
  $("setup-intro-pc").hidden = hub;
  $("elsewhere-hub").hidden = !hub;
  $("elsewhere-pc").hidden = hub;
  $("setup-submit").textContent = hub ? "Set up the box" : "Set password";
  if (hub) {
    timeZones();
    if (!$("setup-timezone").value) $("setup-timezone").value = browserZone();
  }
}

/** Why a WiFi network cannot be used, checked here first (the node checks again). */
function wifiProblem(ssid, passphrase) {
  const bytes = new TextEncoder().encode(ssid).length;
  if (bytes < 1 || bytes > 32) return "A WiFi network name has 1 to 32 bytes.";
  if (/[\u0000-\u001f\u007f-\u009f]/.test(ssid)) return "A WiFi network name has no control characters.";
  if (passphrase && !/^[\x20-\x7e]{8,63}$/.test(passphrase)) {
    return "A WiFi passphrase has 8 to 63 characters: letters, digits, punctuation or spaces (or none, for an open network).";
  }
  return "";
}

function enter() {
  show("in");
  systemFilled = false;
  systemRefresh();
  if (events) events.close();
  events = new EventSource("/admin/api/events");
  events.addEventListener("overview", (e) => {
    $("live").textContent = "live";
    render(JSON.parse(e.data));
  });
  events.onerror = async () => {
    $("live").textContent = "reconnecting…";
    // The stream ends when the session does: ask whether to log in again.
    const [status, s] = await call("GET", "/admin/api/session");
    if (status === 200 && s.state !== "in") { events.close(); events = null; csrf = ""; start(); }
  };
}

$("setup-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const error = $("setup-error");
  const password = $("setup-password").value;
  if (password !== $("setup-confirm").value) { error.textContent = "The two passwords differ."; return; }
  const body = { password };
  if (!$("setup-code-box").hidden) {
    const code = $("setup-code").value.trim();
    if (!code) { error.textContent = "Type the box's setup code."; $("setup-code").focus(); return; }
    body.code = code;
  }
  if (!$("setup-hub").hidden) {
    const name = $("setup-name").value.trim();
    const zone = $("setup-timezone").value.trim();
    const ssid = $("setup-ssid").value;
    const passphrase = $("setup-passphrase").value;
    if (name) body.cluster_name = name;
    if (zone) body.timezone = zone;
    if (ssid) {
      const problem = wifiProblem(ssid, passphrase);
      if (problem) { error.textContent = problem; $("setup-ssid").focus(); return; }
      body.wifi = { ssid, passphrase };
    }
  }
  error.textContent = "";
  $("setup-submit").disabled = true;
  const [status, s] = await call("POST", "/admin/api/setup", body);
  $("setup-submit").disabled = false;
  if (status === 200) {
    csrf = s.csrf;
    $("setup-form").reset();
    enter();
    // The password is set; what else was asked and not done is said where it is changed.
    if (s.warnings && s.warnings.length) { location.hash = "#settings"; $("settings-error").textContent = s.warnings.join(" "); }
  } else if (status === 409) start();
  else error.textContent = s.error || `Refused (${status}).`;
});

$("login-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const [status, s] = await call("POST", "/admin/api/login", { password: $("login-password").value });
  if (status === 200) { csrf = s.csrf; $("login-form").reset(); $("login-error").textContent = ""; enter(); }
  else $("login-error").textContent = s.error || `Refused (${status}).`;
});

$("logout").addEventListener("click", async () => {
  await call("POST", "/admin/api/logout");
  if (events) { events.close(); events = null; }
  csrf = "";
  start();
});

// ---- rendering ----

const GiB = 1024 ** 3;
function bytes(n) {
  if (n >= GiB) return `${(n / GiB).toFixed(1)} GiB`;
  return `${Math.round(n / 1024 ** 2)} MiB`;
}

/** An element with a class and text. */
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

/** A labelled bar: `used` of `total`. */
function meter(label, used, total, detail) {
  const m = el("div", "meter");
  const head = el("div", "label");
  head.append(el("span", "", label), el("span", "muted", detail));
  const track = el("div", "track");
  track.setAttribute("role", "meter");
  track.setAttribute("aria-label", label);
  track.setAttribute("aria-valuemin", "0");
  track.setAttribute("aria-valuemax", String(total));
  track.setAttribute("aria-valuenow", String(used));
  track.setAttribute("aria-valuetext", detail);
  const fill = el("div", "fill");
  fill.style.width = `${total > 0 ? Math.min(100, (100 * used) / total) : 0}%`;
  track.append(fill);
  m.append(head, track);
  return m;
}

function nodeCard(n) {
  const card = el("article", `card node ${n.state}`);
  card.dataset.node = n.id;
  const h = el("h3");
  h.append(el("span", "", n.name));
  if (n.leader) h.append(el("span", "badge leader", "leader"));
  h.append(el("span", "badge", n.role === "hub" ? "hub" : "PC"));
  h.append(el("span", `badge state-${n.state}`, n.state));
  card.append(h);
  const m = n.machine;
  if (m) {
    card.append(el("p", "facts", `${m.cpu || "CPU"} · ${m.cores} cores · ${m.os} · Shoal ${m.version}`));
    if (m.cpu_percent != null) card.append(meter("CPU", m.cpu_percent, 100, `${Math.round(m.cpu_percent)}% busy`));
    const used = m.ram_total - m.ram_available;
    card.append(meter("RAM", used, m.ram_total, `${bytes(used)} used of ${bytes(m.ram_total)}`));
    for (const g of m.gpus) {
      card.append(meter(g.name, g.total - g.free, g.total, `${bytes(g.total - g.free)} used of ${bytes(g.total)}`));
    }
  } else {
    card.append(el("p", "facts", n.state === "down" ? "Not answering." : "No report from this machine yet."));
  }
  if (n.offered_bytes) {
    card.append(meter("Models", n.placed_bytes, n.offered_bytes,
      `${bytes(n.placed_bytes)} placed of ${bytes(n.offered_bytes)} offered`));
  }
  card.append(el("p", "facts mono", n.id.slice(0, 16)));
  return card;
}

function colours(nodes) {
  const map = new Map();
  nodes.forEach((n, i) => map.set(n.id, `var(--n${i % 6})`));
  return map;
}

function modelCard(m, nodes, colour) {
  const card = el("article", "card model");
  card.dataset.model = m.name;
  card.dataset.state = m.state;
  const h = el("h3");
  h.append(el("span", "", m.name), el("span", "muted", ` · ${m.arch} · ${m.layers} layers · ${bytes(m.size)} · ${m.state}`));
  card.append(h);
  if (m.error) card.append(el("p", "error", m.error));
  if (m.stages.length) {
    const bar = el("div", "layers");
    bar.setAttribute("role", "img");
    const names = new Map(nodes.map((n) => [n.id, n.name]));
    bar.setAttribute("aria-label", `Placement: ${m.stages.map((s) => `${s.end - s.first} layers on ${names.get(s.node) || s.node.slice(0, 8)}`).join(", ")}`);
    const legend = el("ul", "legend");
    const span = (s) => (s.end - s.first === 1 ? `layer ${s.first}` : `layers ${s.first}–${s.end - 1}`);
    for (const s of m.stages) {
      const part = el("div", "stage", s.end - s.first === 1 ? String(s.first) : `${s.first}–${s.end - 1}`);
      part.dataset.node = s.node;
      part.style.flex = String(Math.max(1, s.end - s.first));
      part.style.background = colour.get(s.node) || "var(--muted)";
      part.title = `${names.get(s.node) || s.node.slice(0, 8)}: ${span(s)}, ${bytes(s.memory_bytes)}`;
      bar.append(part);
      const item = el("li");
      const sw = el("span", "swatch");
      sw.style.background = part.style.background;
      // Measured: what llama.cpp allocated for the stage (weights, KV cache, compute
      // buffers). The node process's growth since the load (its RSS) also holds the API's
      // tokenizer, samplers and the allocator's slack: shown on hover, not as the stage's.
      const measured = s.loaded_bytes != null ? `, ${bytes(s.loaded_bytes)} measured` : s.state ? ` (${s.state})` : "";
      if (s.resident_bytes != null) item.title = `The node's process grew by ${bytes(s.resident_bytes)} since this stage loaded.`;
      const speed = s.decode_ms != null ? `, ${s.decode_ms.toFixed(1)} ms of compute per token` : "";
      const draft = s.draft ? `; ${s.draft}` : "";
      item.append(sw, `${names.get(s.node) || s.node.slice(0, 8)}: ${span(s)}, ${bytes(s.memory_bytes)} predicted${measured}${speed}${draft}`);
      legend.append(item);
    }
    card.append(bar, legend);
    if (m.predicted_tok_s) {
      const timed = m.stages.filter((s) => s.decode_ms != null);
      const compute = timed.reduce((a, s) => a + s.decode_ms, 0);
      const measured = timed.length === m.stages.length && compute > 0
        ? ` Measured: the stages compute a token in ${compute.toFixed(1)} ms together (at most ${(1000 / compute).toFixed(0)} tokens/s before the network).`
        : "";
      const last = m.measured_tok_s != null ? ` Last answer through this machine: ${m.measured_tok_s.toFixed(1)} tokens/s.` : "";
      card.append(el("p", "facts", `Predicted: ${m.predicted_tok_s.toFixed(1)} tokens/s for one conversation.${last}${measured}`));
    }
    if (m.explanation.length) {
      const why = el("details");
      why.append(el("summary", "facts", "Why this placement"));
      const list = el("ul", "explain");
      for (const line of m.explanation) list.append(el("li", "", line));
      why.append(list);
      card.append(why);
    }
  }
  return card;
}

/** Replace `container`'s children with `build()` only when `data` changed since the
 *  last time: buttons do not move under the pointer while nothing changed. */
function renderIf(container, data, build) {
  const key = JSON.stringify(data);
  if (container.dataset.key === key) return;
  container.dataset.key = key;
  container.replaceChildren(...build());
}

/** Ask the node to do something; shows the error in `errorBox`. */
async function act(body, errorBox) {
  errorBox.textContent = "";
  const [status, r] = await call("POST", "/admin/api/action", body);
  if (status !== 200) { errorBox.textContent = r.error || `Refused (${status}).`; return null; }
  return r;
}

function button(text, cls, onClick) {
  const b = el("button", cls, text);
  b.type = "button";
  b.addEventListener("click", async () => { b.disabled = true; try { await onClick(); } finally { b.disabled = false; } });
  return b;
}

function render(o) {
  const colour = colours(o.nodes);
  const online = o.nodes.filter((n) => n.state !== "down");
  const ramTotal = online.reduce((a, n) => a + (n.machine ? n.machine.ram_total : 0), 0);
  const ramFree = online.reduce((a, n) => a + (n.machine ? n.machine.ram_available : 0), 0);
  const gpus = online.flatMap((n) => (n.machine ? n.machine.gpus : []));
  const vramTotal = gpus.reduce((a, g) => a + g.total, 0);
  const vramFree = gpus.reduce((a, g) => a + g.free, 0);
  const offered = online.reduce((a, n) => a + (n.offered_bytes || 0), 0);
  const placed = o.nodes.reduce((a, n) => a + n.placed_bytes, 0);
  const pool = $("pool");
  pool.replaceChildren();
  const tile = (title, child) => { const c = el("div", "card"); c.append(el("strong", "", title), child); return c; };
  pool.append(tile(`${online.length} of ${o.nodes.length} machines online`,
    meter("RAM", ramTotal - ramFree, ramTotal, `${bytes(ramTotal - ramFree)} used of ${bytes(ramTotal)}`)));
  if (vramTotal) pool.append(tile("GPU memory", meter("VRAM", vramTotal - vramFree, vramTotal, `${bytes(vramTotal - vramFree)} used of ${bytes(vramTotal)}`)));
  pool.append(tile("Models", meter("Placed", placed, offered, `${bytes(placed)} placed of ${bytes(offered)} offered`)));

  renderIf($("nodes"), o.nodes, () => o.nodes.map(nodeCard));
  const shown = o.models.filter((m) => m.stages.length || m.error);
  renderIf($("placements"), [shown, o.nodes.map((n) => [n.id, n.name])], () => shown.length
    ? shown.map((m) => modelCard(m, o.nodes, colour))
    : [el("p", "muted", "No model is loaded. Load one under Models.")]);

  // Machines.
  $("pending-wrap").hidden = o.pending.length === 0;
  renderIf($("pending"), o.pending, () => o.pending.map((p) => {
    const c = el("article", "card node");
    c.dataset.node = p.id;
    c.append(el("h3", "", p.name), el("p", "facts", `${p.role === "hub" ? "hub" : "PC"} · ${bytes(p.memory_bytes)} · ${p.addr}`),
      el("p", "facts mono", `fingerprint ${p.id}`));
    const row = el("div", "actions");
    row.append(button("Let in", "", () => act({ action: "approve", node: p.id }, $("machines-error"))));
    c.append(row);
    return c;
  }));
  renderIf($("members").tBodies[0], o.nodes.map((n) => [n.id, n.name, n.state, n.role, n.addr, n.leader]), () => o.nodes.map((n) => {
    const tr = el("tr");
    tr.dataset.node = n.id;
    const state = el("td", `state-${n.state}`, n.state + (n.leader ? " · leader" : ""));
    const actions = el("td");
    if (n.id !== o.node) {
      actions.append(button("Remove", "danger", async () => {
        if (confirm(`Remove ${n.name} from the cluster? Its key is revoked; it can join again only with a new code or token.`)) {
          await act({ action: "remove", node: n.id }, $("machines-error"));
        }
      }));
    } else {
      actions.append(el("span", "muted", "this node"));
    }
    tr.append(el("td", "", n.name), state, el("td", "", n.role === "hub" ? "hub" : "PC"), el("td", "mono", n.addr || ""),
      el("td", "mono", n.id.slice(0, 16)), actions);
    return tr;
  }));

  // Models.
  renderIf($("catalog"), [o.models, o.nodes.map((n) => [n.id, n.name])], () => o.models.length === 0
    ? [el("p", "muted", "No models in the catalog yet.")]
    : o.models.map((m) => {
      const card = modelCard(m, o.nodes, colour);
      const row = el("div", "actions");
      const err = $("models-error");
      if (m.state === "available") {
        row.append(button("Load", "", () => {
          const ctx = Number($("load-context").value);
          return act({ action: "model_load", model: m.hash, context: ctx > 0 ? ctx : undefined }, err);
        }));
        row.append(button("Remove from catalog", "danger", async () => {
          if (confirm(`Remove ${m.name} from the catalog? The files stay where they are.`)) {
            await act({ action: "model_remove", model: m.hash }, err);
          }
        }));
      } else {
        row.append(button("Unload", "secondary", () => act({ action: "model_unload", model: m.hash }, err)));
      }
      card.append(row);
      return card;
    }));

  renderIf($("what-if"), [o.models.map((m) => [m.hash, m.name]), o.nodes.map((n) => [n.id, n.name])],
    () => [whatIf(o.models, o.nodes, colour)]);

  // Chat: the models that answer now.
  const ready = o.models.filter((m) => m.state === "ready").map((m) => m.name);
  renderIf($("chat-model"), ready, () => ready.length
    ? ready.map((n) => { const opt = el("option", "", n); opt.value = n; return opt; })
    : [Object.assign(el("option", "", "no model is ready"), { value: "" })]);

  // Downloads started here.
  renderIf($("downloads"), o.downloads, () => [...o.downloads].reverse().map((d) => {
    const li = el("li");
    li.append(el("span", "mono", d.source), " ");
    if (d.state === "running") {
      const p = el("progress");
      p.max = d.total || 1;
      p.value = d.total ? d.done : 0;
      p.setAttribute("aria-label", `download of ${d.source}`);
      li.append(p, el("span", "muted", ` ${bytes(d.done)}${d.total ? ` of ${bytes(d.total)}` : ""}`));
    } else {
      li.append(el("span", d.state === "added" ? "state-online" : "error", d.state === "added" ? `added as ${d.message}` : `failed: ${d.message}`));
    }
    return li;
  }));

  // Settings.
  if ($("api-open").dataset.key !== String(o.settings.api_open)) {
    $("api-open").checked = o.settings.api_open;
    $("api-open").dataset.key = String(o.settings.api_open);
  }
  if ($("keepalive").dataset.key !== o.settings.keepalive) {
    $("keepalive").value = o.settings.keepalive;
    $("keepalive").dataset.key = o.settings.keepalive;
  }
  if (document.activeElement !== $("cluster-name") && $("cluster-name").dataset.key !== o.name) {
    $("cluster-name").value = o.name;
    $("cluster-name").dataset.key = o.name;
  }
  $("cluster").textContent = o.name ? `${o.name} · cluster ${o.cluster.slice(0, 8)}` : `cluster ${o.cluster.slice(0, 8)}`;
  renderIf($("keys").tBodies[0], o.keys, () => o.keys.length ? o.keys.map((k) => {
    const tr = el("tr");
    tr.append(el("td", "", k.name), el("td", "", new Date(k.created_unix * 1000).toLocaleString()));
    const td = el("td");
    td.append(button("Revoke", "danger", async () => {
      if (confirm(`Revoke the key ${k.name}? Programs using it are refused from then on.`)) {
        await act({ action: "key_revoke", name: k.name }, $("settings-error"));
      }
    }));
    tr.append(td);
    return tr;
  }) : [(() => { const tr = el("tr"); const td = el("td", "muted", "No keys: other machines cannot call the API."); td.colSpan = 3; tr.append(td); return tr; })()]);

  activity(o.activity, o.nodes);

  // Activity, newest first.
  const evs = [...o.events].reverse();
  renderIf($("events"), evs, () => evs.length ? evs.map((e) => {
    const li = el("li");
    const t = el("time", "", new Date(e.at_ms).toLocaleTimeString());
    t.dateTime = new Date(e.at_ms).toISOString();
    li.append(t, el("span", `kind kind-${e.kind}`, e.kind), el("span", "", e.text));
    return li;
  }) : [el("li", "muted", "Nothing yet.")]);
}

/** The what-if: pick a model, leave machines out or change the context, see the plan
 *  the planner would make, then apply it (a load with those options). */
function whatIf(models, nodes, colour) {
  const box = el("div");
  if (!models.length) { box.append(el("p", "muted", "Add a model first.")); return box; }
  const form = el("div", "row wrap");
  const pickLabel = el("label", "", "Model ");
  const pick = el("select");
  pick.id = "what-if-model";
  for (const m of models) { const o = el("option", "", m.name); o.value = m.hash; pick.append(o); }
  pickLabel.append(pick);
  const ctxLabel = el("label", "", "Context ");
  const ctx = el("input");
  ctx.type = "number"; ctx.min = "16"; ctx.step = "16"; ctx.value = "4096"; ctx.id = "what-if-context";
  ctxLabel.append(ctx);
  form.append(pickLabel, ctxLabel);
  const leave = [];
  for (const n of nodes) {
    const l = el("label");
    const c = el("input");
    c.type = "checkbox";
    c.dataset.node = n.id;
    leave.push(c);
    l.append(c, ` leave out ${n.name}`);
    form.append(l);
  }
  const out = el("div", "preview");
  const options = () => ({ model: pick.value, context: Number(ctx.value), exclude: leave.filter((c) => c.checked).map((c) => c.dataset.node) });
  form.append(button("Preview", "secondary", async () => {
    out.replaceChildren();
    const err = el("p", "error");
    const r = await act({ action: "plan_preview", ...options() }, err);
    if (!r) { out.append(err); return; }
    const card = modelCard(r, nodes, colour);
    card.classList.add("proposed");
    if (!r.error) {
      const apply = el("div", "actions");
      apply.append(button("Apply this plan", "", async () => {
        const done = await act({ action: "model_load", ...options() }, err);
        if (done) out.replaceChildren(el("p", "muted", "Applied: the leader places the model so."));
      }), err);
      card.append(apply);
    }
    out.append(card);
  }));
  box.append(form, out);
  return box;
}

// ---- activity ----

/** Successive counters (seconds, tokens streamed, requests), the newest 300: one per
 *  update and one a second between them (the node sends nothing while nothing moves). */
const samples = [];
let chart = null;
let lastActivity = null;

function sample() {
  samples.push({ t: Date.now() / 1000, tokens: lastActivity.streamed_tokens, requests: lastActivity.requests });
  if (samples.length > 300) samples.shift();
}
setInterval(() => {
  if (!lastActivity || $("tabs").hidden) return;
  sample();
  drawActivity(lastActivity.a, lastActivity.nodes);
}, 1000);

function activity(a, nodes) {
  lastActivity = { streamed_tokens: a.streamed_tokens, requests: a.requests, a, nodes };
  sample();
  drawActivity(a, nodes);
}

function drawActivity(a, nodes) {
  const rate = (k, i) => {
    const [p, q] = [samples[i - 1], samples[i]];
    return q.t > p.t ? Math.max(0, (q[k] - p[k]) / (q.t - p.t)) : 0;
  };
  const times = samples.slice(1).map((s) => s.t);
  const tokens = samples.slice(1).map((_, i) => rate("tokens", i + 1));
  const now = tokens.length ? tokens[tokens.length - 1] : 0;
  const tile = (title, value, note) => {
    const c = el("div", "card");
    c.append(el("strong", "", title), el("p", "big", value));
    if (note) c.append(el("p", "facts", note));
    return c;
  };
  $("rates").replaceChildren(
    tile("Tokens/s now", now.toFixed(1)),
    tile("Streaming now", String(a.in_flight)),
    tile("Requests answered", String(a.requests), `${a.failed_requests} refused or failed`),
  );
  const box = $("chart");
  if (window.uPlot && !$("activity").hidden) {
    const width = Math.max(280, box.clientWidth);
    if (!chart) {
      const accent = getComputedStyle(document.documentElement).getPropertyValue("--accent").trim() || "#0b6e99";
      const fg = getComputedStyle(document.documentElement).getPropertyValue("--muted").trim() || "#555";
      chart = new window.uPlot({
        width, height: 220,
        series: [{}, { label: "tokens/s", stroke: accent, fill: accent + "22", width: 2 }],
        axes: [{ stroke: fg }, { stroke: fg }],
        scales: { y: { range: (u, min, max) => [0, Math.max(1, max)] } },
      }, [times, tokens], box);
    } else {
      if (chart.width !== width) chart.setSize({ width, height: 220 });
      chart.setData([times, tokens]);
    }
  } else if (!window.uPlot) {
    box.textContent = `Tokens/s over the last ${times.length} samples: ${tokens.map((v) => v.toFixed(0)).join(" ")}`;
  }
  const names = new Map(nodes.map((n) => [n.id, n.name]));
  renderIf($("hops").tBodies[0], a.hops, () => a.hops.length ? a.hops.map((h) => {
    const tr = el("tr");
    const us = (v) => (v >= 1000 ? `${(v / 1000).toFixed(1)} ms` : `${v} µs`);
    tr.append(el("td", "", h.model), el("td", "", `${names.get(h.node) || h.node.slice(0, 8)}, ${h.end - h.first === 1 ? `layer ${h.first}` : `layers ${h.first}–${h.end - 1}`}`),
      el("td", "", h.class), el("td", "", String(h.frames)), el("td", "", us(h.p50_us)), el("td", "", us(h.p99_us)),
      el("td", "", String(h.replays)), el("td", "", String(h.link_connects)));
    return tr;
  }) : [(() => { const tr = el("tr"); const td = el("td", "muted", "No model is running."); td.colSpan = 8; tr.append(td); return tr; })()]);
}

// ---- machines ----

async function join(kind) {
  const r = await act({ action: kind }, $("machines-error"));
  if (!r) return;
  $("join-out").hidden = false;
  $("join-command").value = r.command;
  $("join-note").textContent = kind === "join_token"
    ? `One use, valid ${Math.round(r.valid_s / 3600)} hours. For a service install: ${r.service}`
    : `Valid ${Math.round(r.valid_s / 60)} minutes.`;
  $("join-command").select();
}
$("make-token").addEventListener("click", () => join("join_token"));
$("make-code").addEventListener("click", () => join("pairing_code"));

// ---- models ----

$("add-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const path = $("add-path").value.trim();
  const name = $("add-name").value.trim();
  $("add-status").textContent = "Adding (the file is hashed: large files take a while)…";
  const r = await act({ action: "model_add", path, name: name || undefined }, $("models-error"));
  $("add-status").textContent = r ? `Added ${r.added}.` : "";
  if (r) $("add-form").reset();
});

$("upload-send").addEventListener("click", () => {
  const file = $("upload-file").files[0];
  if (!file) { $("upload-status").textContent = "Choose a .gguf file first."; return; }
  const bar = $("upload-progress");
  const status = $("upload-status");
  const xhr = new XMLHttpRequest(); // fetch cannot report an upload's progress
  xhr.open("POST", `/admin/api/upload?name=${encodeURIComponent(file.name)}`);
  xhr.setRequestHeader("X-CSRF-Token", csrf);
  xhr.setRequestHeader("Content-Type", "application/octet-stream");
  xhr.upload.onprogress = (e) => {
    if (!e.lengthComputable) return;
    bar.value = e.loaded / e.total;
    status.textContent = `${bytes(e.loaded)} of ${bytes(e.total)}`;
  };
  xhr.upload.onload = () => { status.textContent = "Checking the file (it is hashed: large files take a while)…"; };
  xhr.onload = () => {
    let r = {}; try { r = JSON.parse(xhr.responseText); } catch { /* not JSON */ }
    bar.hidden = true;
    $("upload-send").disabled = false;
    status.textContent = xhr.status === 200 ? `Added ${r.added}.` : `Refused: ${r.error || xhr.status}`;
  };
  xhr.onerror = () => { bar.hidden = true; $("upload-send").disabled = false; status.textContent = "The upload broke off."; };
  bar.hidden = false;
  bar.value = 0;
  $("upload-send").disabled = true;
  xhr.send(file);
});

$("download-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const r = await act({ action: "model_download", source: $("download-source").value.trim() }, $("models-error"));
  if (r) $("download-form").reset();
});

for (const b of document.querySelectorAll("[data-import]")) {
  b.addEventListener("click", async () => {
    $("import-status").textContent = "Looking…";
    b.disabled = true;
    const r = await act({ action: "model_import", from: b.dataset.import }, $("models-error"));
    b.disabled = false;
    if (!r) { $("import-status").textContent = ""; return; }
    const refused = r.refused.map(([n, why]) => `${n} (${why})`).join("; ");
    $("import-status").textContent = (r.added.length ? `Added ${r.added.join(", ")}.` : "Nothing new found.")
      + (refused ? ` Not added: ${refused}` : "");
  });
}

// ---- settings ----

$("name-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const r = await act({ action: "cluster_name", name: $("cluster-name").value }, $("settings-error"));
  if (r) $("settings-status").textContent = `The cluster is called ${r.name}.`;
});

$("api-open").addEventListener("change", async (e) => {
  const open = e.target.checked;
  if (open && !confirm("Every machine that reaches this network will be able to run models here without a key. Go on?")) {
    e.target.checked = false;
    return;
  }
  const r = await act({ action: "api_open", open }, $("settings-error"));
  if (r) $("settings-status").textContent = open ? "Other machines need no key now." : "Other machines need a key now.";
  else e.target.checked = !open;
});

$("keepalive").addEventListener("change", async (e) => {
  const r = await act({ action: "keep_alive", mode: e.target.value }, $("settings-error"));
  if (r) $("settings-status").textContent = "Saved: stages started from now on follow it.";
});

$("key-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const r = await act({ action: "key_create", name: $("key-name").value.trim() }, $("settings-error"));
  if (!r) return;
  $("key-form").reset();
  $("key-out").hidden = false;
  $("key-secret").value = r.secret;
  $("key-secret").select();
});

$("password-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  $("settings-error").textContent = "";
  const [status, r] = await call("POST", "/admin/api/password", { current: $("password-current").value, new: $("password-new").value });
  if (status !== 200) { $("settings-error").textContent = r.error || `Refused (${status}).`; return; }
  csrf = r.csrf;
  $("password-form").reset();
  $("settings-status").textContent = "The password is changed; every other session has ended.";
  enter(); // the live stream belonged to the old session
});

// ---- the hub box's system (appliance mode) ----

/** The last request this page made (its id), followed until the box reports it done. */
let sentRequest = null;
let systemTimer = null;
let systemFilled = false;

const UPDATE_STATES = {
  none: "",
  installing: "Installing the update…",
  installed: "The update is installed: the box restarts into it.",
  good: "The box runs the update.",
  failed: "The update failed",
  "rolled-back": "The update did not start, and the box went back to the version before",
};

/** Ask the node for the box's settings and status; poll while something runs. */
async function systemRefresh() {
  clearTimeout(systemTimer);
  systemTimer = null;
  let status, a;
  try { [status, a] = await call("GET", "/admin/api/appliance"); } catch { status = 0; }
  if (status === 401) { if (events) { events.close(); events = null; } csrf = ""; start(); return; }
  if (status !== 200) {
    // Restarting (a reboot, an update): ask again until it answers.
    if (sentRequest) { $("system-request").textContent = "The box is restarting…"; systemTimer = setTimeout(systemRefresh, 3000); }
    return;
  }
  $("system-card").hidden = !a.appliance;
  if (!a.appliance) return;
  timeZones();
  const st = a.status;
  const set = a.settings || {};
  $("system-facts").textContent = st
    ? [st.booted ? `slot ${st.booted}` : "", st.version ? `version ${st.version}` : "",
      st.hardware_watchdog != null ? `hardware watchdog ${st.hardware_watchdog ? "on" : "off"}` : "",
      st.data_bytes ? `data partition ${bytes(st.data_bytes)}` : ""].filter(Boolean).join(" · ")
      || "The system reported nothing yet."
    : "The system has not reported yet.";
  const joined = st && st.wifi ? `Joined: ${st.wifi}.` : "";
  const chosen = set.wifi ? `Chosen: ${set.wifi.ssid}.` : "No WiFi network chosen: the box uses its cable.";
  $("wifi-now").textContent = `${chosen} ${joined}`.trim();
  if (!systemFilled) {
    $("system-timezone").value = set.timezone || (st && st.timezone) || "";
    $("wifi-ssid").value = set.wifi ? set.wifi.ssid : "";
    systemFilled = true;
  }
  const u = st && st.update;
  $("update-status").textContent = u && UPDATE_STATES[u.state] !== undefined
    ? `${UPDATE_STATES[u.state]}${u.message && UPDATE_STATES[u.state] ? `: ${u.message}` : ""}`
    : (u ? `${u.state} ${u.message || ""}` : "");
  const r = st && st.request;
  let running = Boolean(u && u.state === "installing");
  if (sentRequest && Date.now() / 1000 - sentRequest.at > 15 * 60) {
    // Followed long enough: a request the box never reports on is not waited for forever.
    $("system-request").textContent = "The box said nothing more about the last request.";
    sentRequest = null;
  }
  if (sentRequest) {
    if (r && r.id === sentRequest.id) {
      const what = { running: "Working", done: "Done", failed: "Failed" }[r.state] || r.state;
      $("system-request").textContent = `${what}${r.message ? `: ${r.message}` : "."}`;
      running = running || r.state === "running";
      if (r.state !== "running") sentRequest = null;
    } else {
      $("system-request").textContent = "Asked; waiting for the box…";
      running = true;
    }
  }
  if (running) systemTimer = setTimeout(systemRefresh, 3000);
}

/** Do an appliance action; follows the request it makes. */
async function systemAct(body) {
  const r = await act(body, $("system-error"));
  if (!r) return null;
  if (r.request) sentRequest = r.request;
  systemRefresh();
  return r;
}

$("timezone-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const r = await systemAct({ action: "appliance_settings", timezone: $("system-timezone").value.trim() });
  if (r) $("settings-status").textContent = `The time zone is now ${r.settings.timezone}.`;
});

$("wifi-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const ssid = $("wifi-ssid").value;
  const passphrase = $("wifi-passphrase").value;
  let wifi = null;
  if (ssid) {
    const problem = wifiProblem(ssid, passphrase);
    if (problem) { $("system-error").textContent = problem; return; }
    wifi = { ssid, passphrase };
  } else if (!confirm("Forget the WiFi network? The box will be reachable by cable only.")) return;
  const r = await systemAct({ action: "appliance_settings", wifi });
  if (r) { $("wifi-passphrase").value = ""; $("settings-status").textContent = wifi ? `The box joins ${ssid}.` : "The box uses its cable only."; }
});

$("bundle-send").addEventListener("click", () => {
  const file = $("bundle-file").files[0];
  const status = $("update-status");
  if (!file) { status.textContent = "Choose an update bundle (.raucb) first."; return; }
  const bar = $("bundle-progress");
  const send = $("bundle-send");
  $("system-error").textContent = "";
  const xhr = new XMLHttpRequest(); // fetch cannot report an upload's progress
  xhr.open("POST", "/admin/api/appliance/bundle");
  xhr.setRequestHeader("X-CSRF-Token", csrf);
  xhr.setRequestHeader("Content-Type", "application/octet-stream");
  xhr.upload.onprogress = (e) => {
    if (!e.lengthComputable) return;
    bar.value = e.loaded / e.total;
    status.textContent = `Uploading: ${bytes(e.loaded)} of ${bytes(e.total)}`;
  };
  const done = () => { bar.hidden = true; send.disabled = false; };
  xhr.onload = async () => {
    done();
    let r = {}; try { r = JSON.parse(xhr.responseText); } catch { /* not JSON */ }
    if (xhr.status !== 200) { status.textContent = `Refused: ${r.error || xhr.status}`; return; }
    status.textContent = "Uploaded; asking the box to install it…";
    if (await systemAct({ action: "appliance_update" })) $("bundle-file").value = "";
  };
  xhr.onerror = () => { done(); status.textContent = "The upload broke off."; };
  bar.hidden = false;
  bar.value = 0;
  send.disabled = true;
  xhr.send(file);
});

$("reboot").addEventListener("click", async () => {
  if (!confirm("Reboot the box? The models it runs stop until it is back, in a minute or two.")) return;
  await systemAct({ action: "appliance_reboot" });
});

$("factory-reset").addEventListener("click", async () => {
  if (!confirm("Factory reset the box? Everything on it is erased: its place in the cluster and the cluster's admin password and API keys as this box holds them, the models and shards stored on it, its WiFi network and time zone. It restarts as it came, to be set up again.")) return;
  await systemAct({ action: "appliance_reset" });
});

// ---- chat ----

let conversation = [];
let running = null;

function bubble(role, text) {
  const m = el("div", `msg ${role}`);
  m.append(el("span", "who", role === "user" ? "You" : "Model"), el("span", "text", text));
  $("chat-log").append(m);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return m.querySelector(".text");
}

$("chat-reset").addEventListener("click", () => { conversation = []; $("chat-log").replaceChildren(); $("chat-stats").textContent = ""; });
$("chat-stop").addEventListener("click", () => { if (running) running.abort(); });

$("chat-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const model = $("chat-model").value;
  const text = $("chat-input").value;
  if (!model || !text.trim() || running) return;
  $("chat-error").textContent = "";
  conversation.push({ role: "user", content: text });
  bubble("user", text);
  $("chat-input").value = "";
  const out = bubble("assistant", "");
  out.parentElement.setAttribute("aria-busy", "true");
  running = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  const t0 = performance.now();
  let first = null, tokens = 0, answer = "", failure = "";
  try {
    const res = await fetch("/admin/api/llm/v1/chat/completions", {
      method: "POST", signal: running.signal, credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
      body: JSON.stringify({
        model, messages: conversation, stream: true, stream_options: { include_usage: true },
        temperature: Number($("chat-temperature").value), max_tokens: Number($("chat-max").value),
      }),
    });
    if (!res.ok) {
      let body = {}; try { body = await res.json(); } catch { /* not JSON */ }
      throw new Error((body.error && (body.error.message || body.error)) || `refused (${res.status})`);
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const j = JSON.parse(line.slice(6));
          if (j.error) failure = j.error.message || String(j.error);
          const delta = j.choices && j.choices[0] && j.choices[0].delta && j.choices[0].delta.content;
          if (delta) { if (first === null) first = performance.now(); answer += delta; out.textContent = answer; }
          if (j.usage) tokens = j.usage.completion_tokens;
        }
      }
    }
    if (failure) throw new Error(failure);
  } catch (err) {
    if (err.name === "AbortError") out.textContent = answer + " [stopped]";
    else $("chat-error").textContent = `The model did not answer: ${err.message}`;
  } finally {
    const end = performance.now();
    out.parentElement.removeAttribute("aria-busy");
    if (answer) conversation.push({ role: "assistant", content: answer });
    if (first !== null) {
      const rate = tokens > 1 && end > first ? ((tokens - 1) * 1000) / (end - first) : 0;
      $("chat-stats").textContent = `first token ${Math.round(first - t0)} ms` + (rate ? ` · ${rate.toFixed(1)} tokens/s` : "");
    }
    running = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
});

start();
