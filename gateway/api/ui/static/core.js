// Shared helpers of the inspector's pages: the JSON API client (with the admin key from the login form),
// a small DOM builder that never parses HTML (rollout content is untrusted text), and formatters.

const KEY = "tracegym.admin_key";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function adminKey() {
  return sessionStorage.getItem(KEY);
}

export function setAdminKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

// GET a JSON route; params with empty values are left out. A 401/403 raises ApiError, which the router
// turns into the login form.
export async function api(path, params = {}) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined && v !== null && v !== "" && v !== false) url.searchParams.set(k, v);
  }
  const headers = { Accept: "application/json" };
  const key = adminKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  const resp = await fetch(url, { headers });
  if (!resp.ok) {
    let message = `${resp.status} ${resp.statusText}`;
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not JSON: keep the status line */ }
    throw new ApiError(resp.status, message);
  }
  return resp.json();
}

// h("a", {href: "/x", class: "c", onclick: fn}, "text", child, [more children]) -> an element.
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (v === true) el.setAttribute(k, "");
    else el.setAttribute(k, String(v));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === undefined || c === null || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else el.append(c instanceof Node ? c : String(c));
  }
}

// An in-app link (the router handles the click without reloading the page).
export function link(href, ...children) {
  return h("a", { href, "data-link": true }, ...children);
}

export function fmtNum(v, digits = 4) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return v.toLocaleString("en");
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return String(Number(v.toPrecision(digits)));
}

export function fmtTime(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return d.toLocaleString("en-GB", { hour12: false });
}

export function fmtSecs(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(2)} s`;
  return `${Math.floor(s / 60)}m${String(Math.round(s % 60)).padStart(2, "0")}s`;
}

export function shortId(id, n = 14) {
  if (!id) return "–";
  return id.length > n ? `${id.slice(0, n)}…` : id;
}

export function badge(text, kind = text) {
  return h("span", { class: `badge b-${String(kind).replace(/[^a-z0-9_-]/gi, "")}` }, text);
}

export function table(headers, rows, attrs = {}) {
  return h("table", attrs,
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows));
}

export function section(title, ...children) {
  return h("section", { class: "card" }, h("h2", {}, title), ...children);
}

export function errorBox(err) {
  return h("div", { class: "error-box" }, err instanceof Error ? err.message : String(err));
}

// Message content as text: strings, or the text parts of a content list.
export function contentText(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content.map((p) => (p && typeof p === "object" ? (p.text ?? JSON.stringify(p)) : String(p))).join("");
  }
  return JSON.stringify(content, null, 2);
}

// Go to an in-app URL (app.js redraws on the "tg:navigate" event).
export function navigate(url) {
  history.pushState(null, "", url);
  window.dispatchEvent(new Event("tg:navigate"));
}
