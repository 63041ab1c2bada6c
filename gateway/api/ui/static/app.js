// The inspector's router: one HTML shell for every /ui/... path; this script reads the path, draws the
// page from the JSON routes, and handles in-app links without reloading. A page may return a cleanup
// function (stop polling) that runs when the user leaves it.

import { ApiError, adminKey, errorBox, h, navigate, setAdminKey } from "./core.js";
import { renderRollout } from "./rollout.js";
import { renderGroup, renderRollouts } from "./rollouts.js";
import { renderRuns } from "./runs.js";
import { renderSystem } from "./system.js";

const ROUTES = [
  [/^\/ui\/?$/, "runs", () => renderRuns(null)],
  [/^\/ui\/runs\/?$/, "runs", () => renderRuns(null)],
  [/^\/ui\/runs\/(.+)$/, "runs", (m) => renderRuns(decodeURIComponent(m[1]))],
  [/^\/ui\/rollouts\/?$/, "rollouts", () => renderRollouts(new URLSearchParams(location.search))],
  [/^\/ui\/rollouts\/(.+)$/, "rollouts", (m) => renderRollout(decodeURIComponent(m[1]),
    new URLSearchParams(location.search))],
  [/^\/ui\/groups\/(.+)$/, "rollouts", (m) => renderGroup(decodeURIComponent(m[1]))],
  [/^\/ui\/system\/?$/, "system", () => renderSystem()],
];

let cleanup = null;
let generation = 0;

async function render() {
  if (cleanup) cleanup();
  cleanup = null;
  const mine = ++generation;
  document.body.dataset.ready = "0"; // set again once this page has drawn (tests and scripts wait for it)
  const app = document.getElementById("app");
  const path = location.pathname;
  const route = ROUTES.find(([re]) => re.test(path));
  document.querySelectorAll("[data-nav]").forEach((a) => a.classList.toggle("active",
    Boolean(route) && a.dataset.nav === route[1]));
  if (!route) {
    app.replaceChildren(h("p", {}, `No page at ${path}.`));
    return;
  }
  try {
    const page = await route[2](path.match(route[0]));
    if (mine !== generation) { // the user moved on while this page loaded
      if (page && page.cleanup) page.cleanup();
      return;
    }
    app.replaceChildren(page.node);
    cleanup = page.cleanup || null;
    document.body.dataset.page = route[1];
    document.body.dataset.ready = "1";
  } catch (err) {
    if (mine !== generation) return;
    if (err instanceof ApiError && (err.status === 401 || err.status === 403)) {
      app.replaceChildren(loginForm(err.message));
    } else {
      console.warn(err);
      app.replaceChildren(errorBox(err));
    }
    document.body.dataset.ready = "1";
  }
}

function loginForm(message) {
  const input = h("input", { type: "password", name: "key", placeholder: "admin key", autocomplete: "off",
    required: true });
  const form = h("form", { class: "card login", onsubmit: (e) => {
    e.preventDefault();
    setAdminKey(input.value.trim());
    drawAuth();
    render();
  } },
  h("h2", {}, "Admin key"),
  message ? h("p", { class: "muted" }, message) : null,
  h("p", {}, "This gateway needs its admin key. It is kept in this browser tab only (sessionStorage)."),
  input, " ", h("button", { type: "submit" }, "Open"));
  return form;
}

function drawAuth() {
  const el = document.getElementById("auth");
  const key = adminKey();
  el.replaceChildren(key
    ? h("button", { class: "link", title: "forget the admin key", onclick: () => {
      setAdminKey(null);
      drawAuth();
      render();
    } }, "key set · forget")
    : h("button", { class: "link", title: "enter an admin key", onclick: () => {
      document.getElementById("app").replaceChildren(loginForm(null));
    } }, "admin key…"));
}

document.addEventListener("click", (e) => {
  const a = e.target.closest("a[data-link]");
  if (!a || e.ctrlKey || e.metaKey || e.shiftKey || e.button !== 0) return;
  e.preventDefault();
  navigate(a.getAttribute("href"));
});
window.addEventListener("popstate", render);
window.addEventListener("tg:navigate", render);
drawAuth();
render();
