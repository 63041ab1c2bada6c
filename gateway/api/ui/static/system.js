// Queue and system (GET /api/inspect/system): tasks and rollouts by status, lease holders, failed
// rollouts with tracebacks, the span recorder's counters, and the upstream with its weight version.

import { api, badge, fmtNum, fmtSecs, fmtTime, h, link, section, shortId, table } from "./core.js";

const POLL_MS = 5000;
const STATUSES = ["queued", "running", "completed", "failed", "adhoc"];

export async function renderSystem() {
  const node = h("div", { class: "page" });
  const draw = (s) => {
    // a redraw keeps the tracebacks the user opened open
    const open = new Set([...node.querySelectorAll("details.failure[open]")].map((d) => d.dataset.rollout));
    node.replaceChildren(queue(s.queue), leases(s.leases), spans(s.spans), upstream(s.upstream), failed(s.failed));
    node.querySelectorAll("details.failure").forEach((d) => { d.open = open.has(d.dataset.rollout); });
  };
  draw(await api("/api/inspect/system"));
  const timer = setInterval(async () => {
    if (document.hidden) return;
    try { draw(await api("/api/inspect/system")); } catch (err) { console.warn(err); }
  }, POLL_MS);
  return { node, cleanup: () => clearInterval(timer) };
}

function queue(q) {
  const splits = [...new Set(q.active_by_split.map((r) => r.split ?? ""))];
  const count = (split, status) => q.active_by_split.filter((r) => (r.split ?? "") === split && r.status === status)
    .reduce((n, r) => n + r.rollouts, 0);
  return section("Queue",
    h("div", { class: "stats" }, STATUSES.map((s) => h("div", { class: "stat", "data-status": s },
      h("div", { class: "n" }, (q.rollouts[s] || 0).toLocaleString("en")),
      link(`/ui/rollouts?status=${s}`, badge(s))))),
    h("p", { class: "muted" }, `${q.retried} rollouts are on a retry after a failed attempt. Tasks: `,
      Object.entries(q.tasks).map(([split, n]) => `${n} ${split || "(no split)"}`).join(", ") || "none"),
    splits.length ? table(["split", "queued", "running"], splits.map((sp) => h("tr", {}, h("td", {}, sp || "(no split)"),
      ["queued", "running"].map((st) => h("td", { class: "num" }, count(sp, st) || ""))))) : null);
}

function leases(rows) {
  return section("Lease holders", rows.length ? table(["worker", "running", "leases expire"],
    rows.map((w) => h("tr", {}, h("td", { class: "mono" }, w.worker_id ?? "–"), h("td", { class: "num" }, w.running),
      h("td", {}, `${fmtTime(w.lease_expires_min)} … ${fmtTime(w.lease_expires_max)}`))))
    : h("p", { class: "muted empty" }, "No rollout is running."));
}

function spans(s) {
  const dropped = Object.entries(s.dropped);
  const total = dropped.reduce((n, [, v]) => n + v, 0);
  return section("Span recorder (this gateway since it started)",
    h("div", { class: "stats" },
      h("div", { class: "stat" }, h("div", { class: "n" }, fmtNum(s.recorded)), "recorded"),
      h("div", { class: "stat" }, h("div", { class: "n" }, fmtNum(s.exported)), "stored"),
      h("div", { class: "stat" }, h("div", { class: "n" }, fmtNum(s.queue_size)), "queued"),
      h("div", { class: `stat ${total ? "bad" : ""}`, id: "dropped" }, h("div", { class: "n" }, fmtNum(total)), "dropped")),
    dropped.length ? table(["reason", "dropped"], dropped.map(([k, v]) => h("tr", {}, h("td", {}, k),
      h("td", { class: "num" }, fmtNum(v))))) : null);
}

function upstream(u) {
  const health = u.health || {};
  const last = u.last_swap;
  return section("Upstream", h("dl", { class: "facts" },
    h("dt", {}, "kind"), h("dd", {}, u.kind), h("dt", {}, "url"), h("dd", { class: "mono" }, u.url ?? "–"),
    h("dt", {}, "model"), h("dd", {}, u.model),
    h("dt", {}, "reachable"), h("dd", {}, health.reachable === undefined ? "–" : badge(health.reachable ? "yes" : "no",
      health.reachable ? "completed" : "failed")),
    h("dt", {}, "weight version"), h("dd", { id: "upstream-version" }, u.weight_version ?? "–"),
    h("dt", {}, "swapping"), h("dd", {}, u.swapping === null ? "–" : String(u.swapping)),
    h("dt", {}, "last swap"), h("dd", {}, last ? `${last.weight_version} (${last.success ? "ok" : "failed"}, ${fmtSecs(last.swap_seconds)})` : "–")),
  (u.engines || []).length > 1 ? engines(u.engines) : null,
  u.error ? h("div", { class: "error-box" }, u.error) : null);
}

// A fleet (--upstream repeated): each engine as its last health check saw it.
function engines(rows) {
  return table(["engine", "healthy", "in flight", "calls", "failovers", "weight version", "error"],
    rows.map((e) => h("tr", { class: "engine", "data-url": e.url },
      h("td", { class: "mono" }, e.url), h("td", {}, badge(e.healthy ? "yes" : "no", e.healthy ? "completed" : "failed")),
      h("td", { class: "num" }, fmtNum(e.inflight)), h("td", { class: "num" }, fmtNum(e.calls)),
      h("td", { class: "num" }, fmtNum(e.failovers)), h("td", {}, e.weight_version ?? "–"),
      h("td", { class: "error-text" }, e.error ?? ""))));
}

function failed(rows) {
  return section(`Failed rollouts (${rows.length}${rows.length >= 50 ? "+" : ""})`, rows.length
    ? rows.map((r) => h("details", { class: "failure", "data-rollout": r.rollout_id },
      h("summary", {}, link(`/ui/rollouts/${encodeURIComponent(r.rollout_id)}`, shortId(r.rollout_id, 22)),
        ` · task ${r.task_id ?? "–"} · attempt ${r.attempt}/${r.max_attempts} · ${fmtTime(r.finished_at)} · `,
        h("span", { class: "error-text" }, r.error ?? "")),
      h("pre", {}, r.traceback || "(no traceback stored)")))
    : h("p", { class: "muted empty" }, "No rollout has failed."));
}
