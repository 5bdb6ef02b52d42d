// The bastion console's page: shows what the gateway sends, and answers with it.
// Every value is put on the page as text (textContent), never as markup: a card's
// command, path or label is the agent's text.
"use strict";

const $ = (selector, root = document) => root.querySelector(selector);
const state = { csrf: null, name: null, snapshot: null, stream: null, tab: "cards", activityAt: 0 };

// -- WebAuthn's JSON forms (the browser's own parsers where it has them) ------------------

function fromB64url(text) {
  const b64 = text.replace(/-/g, "+").replace(/_/g, "/") + "===".slice((text.length + 3) % 4);
  return Uint8Array.from(atob(b64), (c) => c.charCodeAt(0)).buffer;
}

function toB64url(buffer) {
  let s = "";
  for (const byte of new Uint8Array(buffer)) s += String.fromCharCode(byte);
  return btoa(s).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function requestOptions(json) {
  if (PublicKeyCredential.parseRequestOptionsFromJSON) {
    return PublicKeyCredential.parseRequestOptionsFromJSON(json);
  }
  return {
    ...json,
    challenge: fromB64url(json.challenge),
    allowCredentials: (json.allowCredentials || []).map((c) => ({ ...c, id: fromB64url(c.id) })),
  };
}

function creationOptions(json) {
  if (PublicKeyCredential.parseCreationOptionsFromJSON) {
    return PublicKeyCredential.parseCreationOptionsFromJSON(json);
  }
  return {
    ...json,
    challenge: fromB64url(json.challenge),
    user: { ...json.user, id: fromB64url(json.user.id) },
    excludeCredentials: (json.excludeCredentials || []).map((c) => ({ ...c, id: fromB64url(c.id) })),
  };
}

function credentialJSON(cred) {
  if (cred.toJSON) return cred.toJSON();
  const r = cred.response;
  const response = { clientDataJSON: toB64url(r.clientDataJSON) };
  if (r.attestationObject) {
    response.attestationObject = toB64url(r.attestationObject);
    response.transports = r.getTransports ? r.getTransports() : [];
  } else {
    response.authenticatorData = toB64url(r.authenticatorData);
    response.signature = toB64url(r.signature);
    response.userHandle = r.userHandle ? toB64url(r.userHandle) : null;
  }
  return { id: cred.id, rawId: toB64url(cred.rawId), type: cred.type, response,
           clientExtensionResults: cred.getClientExtensionResults() };
}

async function assertion(options) {
  const cred = await navigator.credentials.get({ publicKey: requestOptions(options) });
  return credentialJSON(cred);
}

// -- the gateway's API -----------------------------------------------------------------

async function call(method, path, body) {
  const response = await fetch(path, {
    method,
    headers: { "Content-Type": "application/json", "X-CSRF-Token": state.csrf || "" },
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "same-origin",
    cache: "no-store",
  });
  let data = {};
  try { data = await response.json(); } catch (_) { /* no body */ }
  if (!response.ok) throw new Error(data.error || `the console answered ${response.status}`);
  return data;
}

function notice(text, bad) {
  const p = $("#notice");
  p.textContent = text;
  p.classList.toggle("error", Boolean(bad));
  p.hidden = !text;
}

function show(id, visible) { $(id).hidden = !visible; }

// -- starting: enrolment page, login, or the console -------------------------------------

async function start() {
  if (location.pathname === "/enroll") { showEnroll(); return; }
  let st;
  try { st = await call("GET", "/api/state"); } catch (e) { notice(e.message, true); return; }
  $("#vault").textContent = st.locked ? "vault locked" : "vault unlocked";
  $("#vault").className = "pill " + (st.locked ? "locked" : "open");
  if (st.login) { loggedIn(st.login.name, st.login.csrf); return; }
  showLogin(st);
}

function showLogin(st) {
  show("#app", false); show("#lock", false); show("#logout", false); show("#terminate-box", false);
  $("#who").textContent = "";
  show("#login", true);
  const words = $("#login-words");
  const button = $("#login-button");
  button.disabled = false;
  if (st.locked) {
    words.textContent = "The vault is locked. Unlock it at your terminal (bastion unlock), then log in here.";
    button.disabled = true;
  } else if (!st.enrolled) {
    words.textContent = "No authenticator is enrolled yet. Run `bastion operator enroll` at your terminal.";
    button.disabled = true;
  }
}

async function login() {
  notice("");
  try {
    const begun = await call("POST", "/api/login/begin", {});
    const signed = await assertion(begun.options);
    const done = await call("POST", "/api/login/finish", { nonce: begun.nonce, assertion: signed });
    loggedIn(done.name, done.csrf);
  } catch (e) { notice(`Login failed: ${e.message}`, true); }
}

function loggedIn(name, csrf) {
  state.csrf = csrf; state.name = name;
  show("#login", false); show("#app", true);
  show("#lock", true); show("#logout", true); show("#terminate-box", true);
  $("#who").textContent = `logged in: ${name}`;
  listen();
}

function listen() {
  if (state.stream) state.stream.close();
  const stream = new EventSource("/api/events");
  state.stream = stream;
  stream.addEventListener("snapshot", (e) => render(JSON.parse(e.data)));
  stream.addEventListener("activity", () => { if (state.tab === "activity") loadActivity(false); });
  stream.onerror = async () => {
    stream.close();
    state.stream = null;
    const st = await call("GET", "/api/state").catch(() => null);
    if (st && st.login) { setTimeout(listen, 1000); return; }
    state.csrf = null;
    start();
  };
}

// -- enrolling ----------------------------------------------------------------------------

function showEnroll() {
  // `bastion operator enroll` again in the same tab changes only the fragment: start over
  window.addEventListener("hashchange", () => location.reload());
  show("#enroll", true);
  $("#enroll-button").addEventListener("click", enroll);
}

async function enroll() {
  const token = location.hash.slice(1);
  notice("");
  try {
    const options = await call("POST", "/api/enroll/options", { token });
    const cred = await navigator.credentials.create({ publicKey: creationOptions(options) });
    const done = await call("POST", "/api/enroll/register", { token, registration: credentialJSON(cred) });
    const code = $("#enroll-code");
    code.textContent = done.code;
    code.hidden = false;
    $("#enroll-button").disabled = true;
    notice("Registered. Type this code at the terminal that ran `bastion operator enroll`.");
  } catch (e) { notice(`Enrolment failed: ${e.message}`, true); }
}

// -- what the gateway says ----------------------------------------------------------------

function render(snap) {
  state.snapshot = snap;
  $("#vault").textContent = snap.locked ? "vault locked" : `vault unlocked · epoch ${snap.vault_epoch}`;
  $("#vault").className = "pill " + (snap.locked ? "locked" : "open");
  renderCards(snap.cards);
  renderSessions(snap.sessions);
}

function field(dl, label, value, cls) {
  const dt = document.createElement("dt");
  dt.textContent = label;
  const dd = document.createElement("dd");
  if (value instanceof Node) dd.appendChild(value); else dd.textContent = value;
  if (cls) dd.className = cls;
  dl.append(dt, dd);
  return dd;
}

function commandNode(card) {
  const box = document.createElement("div");
  if (card.argv) {
    const p = document.createElement("p");
    p.textContent = `${card.argv.length} word(s), run as this argv (no shell syntax):`;
    const ol = document.createElement("ol");
    ol.className = "argv";
    ol.start = 0;
    for (const word of card.argv) {
      const li = document.createElement("li");
      const code = document.createElement("code");
      code.textContent = word;
      li.appendChild(code);
      ol.appendChild(li);
    }
    box.append(p, ol);
    return box;
  }
  const warn = document.createElement("p");
  warn.className = "warn";
  warn.textContent = "USES SHELL SYNTAX: the target's shell decides what runs.";
  box.appendChild(warn);
  const ul = document.createElement("ul");
  for (const c of card.shell_syntax || []) {
    const li = document.createElement("li");
    li.textContent = `${JSON.stringify(c.text)} at byte ${c.offset}: ${c.what}`;
    ul.appendChild(li);
  }
  box.appendChild(ul);
  const pre = document.createElement("pre");
  pre.className = "command";
  const text = card.command || "";
  const marks = (card.command_marks || []).map(([a, b]) => [Number(a), Number(b)]).sort((x, y) => x[0] - y[0]);
  let at = 0;
  for (const [a, b] of marks) {
    if (a < at) continue;
    pre.appendChild(document.createTextNode(text.slice(at, a)));
    const mark = document.createElement("mark");
    mark.textContent = text.slice(a, b);
    pre.appendChild(mark);
    at = b;
  }
  pre.appendChild(document.createTextNode(text.slice(at)));
  box.appendChild(pre);
  return box;
}

function stdinNode(stdin) {
  const box = document.createElement("div");
  const p = document.createElement("p");
  if (stdin.size === 0) {
    p.textContent = stdin.end === "silent" ? "none yet: still open, nothing sent; the command gets none" : "none (closed empty)";
    box.appendChild(p);
    return box;
  }
  p.className = "warn";
  p.textContent = `${stdin.size} bytes -- the command reads these:`;
  box.appendChild(p);
  if (stdin.preview !== undefined) {
    const pre = document.createElement("pre");
    pre.textContent = stdin.preview;
    box.appendChild(pre);
    const more = stdin.size - (stdin.preview_bytes || stdin.size);
    if (more > 0) {
      const m = document.createElement("p");
      m.textContent = `... and ${more} more bytes (not shown)`;
      box.appendChild(m);
    }
  }
  const d = document.createElement("p");
  d.className = "digest";
  d.textContent = `sha256 ${stdin.sha256}`;
  box.appendChild(d);
  return box;
}

function when(ts) { return ts ? new Date(ts * 1000).toLocaleString() : ""; }

function who(subject) {
  if (!subject) return "";
  return subject.run ? `run ${subject.run}` : `pid ${subject.pid} ${subject.exe}`;
}

function renderCards(cards) {
  const box = $("#cards");
  $("#card-count").textContent = String(cards.length);
  show("#no-cards", cards.length === 0);
  const keep = new Set(cards.map((c) => c.id));
  for (const el of [...box.children]) if (!keep.has(el.dataset.card)) el.remove();
  for (const card of cards) {
    let el = box.querySelector(`[data-card="${CSS.escape(card.id)}"]`);
    if (!el) {
      el = buildCard(card);
      box.appendChild(el);
    }
    updatePresence(el, card);
  }
}

function buildCard(card) {
  const el = $("#card-template").content.firstElementChild.cloneNode(true);
  el.dataset.card = card.id;
  const what = card.file ? "change a file" : card.kind === "command" ? "run a command" : "use this host and account";
  $(".kind", el).textContent = `${card.kind} approval -- ${what}`;
  $(".card-id", el).textContent = card.id;
  $(".expires", el).textContent = `expires ${new Date(card.expires_at * 1000).toLocaleTimeString()}`;
  const dl = $(".fields", el);
  const s = card.subject;
  field(dl, "target", `${card.user}@${card.host} (${card.address}:${card.port}, host key ${card.host_key_fingerprint})`);
  field(dl, "key", card.credential);
  field(dl, "asked by", `pid ${s.pid}  ${s.exe}${s.kind ? `  (${s.kind})` : ""}${s.exe_deleted ? "  [executable deleted or replaced]" : ""}`);
  field(dl, "", `uid ${s.uid}, started ${when(s.start_time)}`);
  if (s.run) field(dl, "run", s.run);
  else if (s.sandboxed) field(dl, "sandbox", "the asking process is in another namespace than the gateway's");
  if (s.exec_watch === "nothing") field(dl, "exec", "not visible for this process: approving covers this request only", "warn");
  if (card.reason) field(dl, "changed", `an earlier approval ended: ${card.reason}`, "warn");
  if (card.conversation) field(dl, "conversation", `(the agent's claim, not checked) ${card.conversation}`);
  if (card.command !== null && card.command !== undefined) field(dl, "command", commandNode(card));
  if (card.stdin) field(dl, "stdin", stdinNode(card.stdin));
  if (card.file) {
    const f = card.file;
    field(dl, "file", `${f.op} ${f.path}${f.to ? ` to ${f.to}` : ""}`);
    if (f.size !== null && f.size !== undefined) field(dl, "size", `${f.size} bytes`);
    if (f.sha256) field(dl, "sha256", f.sha256, "digest");
    if (f.mode !== null && f.mode !== undefined) field(dl, "mode", String(f.mode));
  }
  if (card.terminal) field(dl, "terminal", "runs with a terminal (its stdout and stderr arrive merged)", "warn");
  const details = document.createElement("details");
  const summary = document.createElement("summary");
  summary.textContent = "details";
  const inner = document.createElement("dl");
  field(inner, "exe sha256", s.exe_sha256, "digest");
  if (card.command_sha256) field(inner, card.file ? "file op digest" : "command sha256", card.command_sha256, "digest");
  field(inner, "request", `${card.request_id} (vault epoch ${card.vault_epoch})`);
  for (const p of card.chain || []) field(inner, `pid ${p.pid}`, `uid ${p.uid} ${p.exe} ${(p.cmdline || []).join(" ").slice(0, 120)}`);
  details.append(summary, inner);
  dl.after(details);
  if (card.grantable) {
    const g = $(".grant", el);
    g.hidden = false;
    $(".grant-pattern", el).value = (card.argv || []).join(" ");
    $(".grant-on", el).addEventListener("change", (e) => { $(".grant-fields", el).hidden = !e.target.checked; });
  }
  $(".approve", el).addEventListener("click", () => approve(card.id, el));
  $(".deny", el).addEventListener("click", () => deny(card.id, el));
  return el;
}

function updatePresence(el, card) {
  const box = $(".presence", el);
  const p = card.presence;
  if (!p) { $(".approve", el).textContent = "Approve"; return; }
  const names = (card.signed || []).map((x) => x.name);
  box.hidden = false;
  box.textContent = `Presence required: ${p.approvers} signature(s) by enrolled authenticators` +
    (p.user_verification ? " (each with user verification)" : "") +
    `. Signed: ${names.length ? names.join(", ") : "nobody yet"} (${names.length} of ${p.approvers}).`;
  $(".approve", el).textContent = names.length ? `Sign (${names.length + 1} of ${p.approvers})` : "Approve with authenticator";
}

function grantOf(el) {
  if (el.querySelector(".grant").hidden || !$(".grant-on", el).checked) return null;
  const n = (input) => (input.value === "" ? null : Number(input.value));
  return { pattern: $(".grant-pattern", el).value, uses: n($(".grant-uses", el)), minutes: n($(".grant-minutes", el)) };
}

function cardError(el, text) {
  const p = $(".card-error", el);
  p.textContent = text;
  p.hidden = !text;
}

async function approve(id, el) {
  cardError(el, "");
  const card = (state.snapshot.cards || []).find((c) => c.id === id);
  const grant = grantOf(el);
  const body = grant ? { grant } : {};
  el.classList.add("busy");
  try {
    if (card && card.presence) {
      const ask = await call("POST", `/api/cards/${encodeURIComponent(id)}/challenge`, body);
      const signed = await assertion(ask.options);
      const done = await call("POST", `/api/cards/${encodeURIComponent(id)}/sign`, { nonce: ask.nonce, assertion: signed });
      notice(done.approved ? `Approved ${id}.` : `Signed ${id}: ${done.signed.length} of ${card.presence.approvers}.`);
    } else {
      await call("POST", `/api/cards/${encodeURIComponent(id)}/approve`, body);
      notice(`Approved ${id}.`);
    }
  } catch (e) { cardError(el, e.message); }
  el.classList.remove("busy");
}

async function deny(id, el) {
  cardError(el, "");
  try {
    await call("POST", `/api/cards/${encodeURIComponent(id)}/deny`, {});
    notice(`Denied ${id}.`);
  } catch (e) { cardError(el, e.message); }
}

function renderSessions(sessions) {
  const box = $("#sessions");
  $("#session-count").textContent = String(sessions.length);
  show("#no-sessions", sessions.length === 0);
  box.replaceChildren();
  for (const ses of sessions) {
    const el = document.createElement("article");
    el.className = "card session";
    el.dataset.session = ses.id;
    const h = document.createElement("header");
    h.textContent = `${ses.id}  ${ses.user}@${ses.host}`;
    const dl = document.createElement("dl");
    dl.className = "fields";
    field(dl, "for", who(ses.subject));
    field(dl, "approved", `${when(ses.approved_at)}${ses.signed_by && ses.signed_by.length ? `, signed by ${ses.signed_by.join(", ")}` : ses.approved_by ? `, by uid ${ses.approved_by.uid} pid ${ses.approved_by.pid}` : ""}`);
    for (const g of ses.grants || []) {
      const left = g.uses_left === null || g.uses_left === undefined ? "no use limit" : `${g.uses_left} use(s) left`;
      const until = g.expires_at ? `, until ${new Date(g.expires_at * 1000).toLocaleTimeString()}` : "";
      field(dl, `grant ${g.id}`, `${g.pattern} (${left}${until})`);
    }
    const actions = document.createElement("div");
    actions.className = "actions";
    const revoke = document.createElement("button");
    revoke.className = "revoke danger";
    revoke.textContent = "Revoke";
    revoke.addEventListener("click", async () => {
      try { await call("POST", `/api/sessions/${encodeURIComponent(ses.id)}/revoke`, {}); notice(`Revoked ${ses.id}.`); }
      catch (e) { notice(e.message, true); }
    });
    actions.appendChild(revoke);
    el.append(h, dl, actions);
    box.appendChild(el);
  }
}

// -- activity -----------------------------------------------------------------------------

async function loadActivity(now) {
  const due = state.activityAt + 2000 - Date.now();
  if (!now && due > 0) { setTimeout(() => loadActivity(true), due); return; }
  state.activityAt = Date.now();
  const form = $("#filters");
  const q = new URLSearchParams();
  for (const h of form.host.value.split(",")) if (h.trim()) q.append("host", h.trim());
  if (form.run.value) q.set("run", form.run.value);
  for (const name of ["since", "until"]) {
    if (form[name].value) q.set(name, String(new Date(form[name].value).getTime() / 1000));
  }
  for (const o of form.outcome.selectedOptions) q.append("outcome", o.value);
  if (form.grep.value) q.set("grep", form.grep.value);
  try {
    const rows = await call("GET", `/api/activity?${q}`);
    const body = $("#activity tbody");
    body.replaceChildren();
    for (const r of rows.reverse()) {
      const tr = document.createElement("tr");
      tr.dataset.request = r.request_id;
      const outcome = r.outcome === "completed" ? `completed (exit ${r.exit_status})` : r.code ? `${r.outcome} (${r.code})` : r.outcome;
      const what = r.file ? `${r.file.op} ${r.file.path}` : r.command;
      for (const text of [when(r.received_at), r.run ? `run ${r.run}` : `pid ${r.subject ? r.subject.pid : "?"}`, `${r.user}@${r.host}`, outcome, what]) {
        const td = document.createElement("td");
        td.textContent = text === null || text === undefined ? "" : String(text);
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
  } catch (e) { notice(e.message, true); }
}

function selectTab(name) {
  state.tab = name;
  for (const b of document.querySelectorAll("[data-tab]")) b.setAttribute("aria-selected", String(b.dataset.tab === name));
  for (const t of ["cards", "sessions", "activity"]) show(`#tab-${t}`, t === name);
  if (name === "activity") loadActivity(true);
}

// -- wiring -------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("#login-button").addEventListener("click", login);
  $("#lock").addEventListener("click", async () => {
    try {
      const r = await call("POST", "/api/lock", { terminate: $("#terminate").checked });
      notice(`Locked (vault epoch ${r.vault_epoch}).`);
    } catch (e) { notice(e.message, true); }
  });
  $("#logout").addEventListener("click", async () => {
    await call("POST", "/api/logout", {}).catch(() => null);
    if (state.stream) state.stream.close();
    state.stream = null; state.csrf = null;
    start();
  });
  for (const b of document.querySelectorAll("[data-tab]")) b.addEventListener("click", () => selectTab(b.dataset.tab));
  $("#filters").addEventListener("submit", (e) => { e.preventDefault(); loadActivity(true); });
  start();
});
