// Rollouts: the filter form and the table (paged on the server, GET /api/inspect/rollouts), and the
// group view (GET /api/inspect/groups/{id}): a GRPO group's rollouts side by side.

import {
  api, badge, contentText, fmtNum, fmtSecs, fmtTime, h, link, navigate, section, shortId, table,
} from "./core.js";

const FILTERS = ["run", "status", "task_id", "group_id", "weight_version", "reward_min", "reward_max",
  "has_errors", "has_drift", "q"];
const STATUSES = ["", "queued", "running", "completed", "failed", "adhoc"];

export async function renderRollouts(params) {
  const query = Object.fromEntries(FILTERS.map((k) => [k, params.get(k) || ""]));
  const cursor = params.get("cursor") || "";
  const [page, runs, versions] = await Promise.all([
    api("/api/inspect/rollouts", { ...query, cursor, limit: 50 }),
    api("/api/runs"), api("/api/weight_versions")]);
  const node = h("div", { class: "page" },
    filterForm(query, runs.runs, versions.weight_versions),
    section(h("span", {}, "Rollouts ", h("span", { class: "muted" }, pageNote(page, cursor))),
      page.rollouts.length ? rolloutTable(page.rollouts) : h("p", { class: "muted empty" },
        page.partial ? "No match in the rollouts searched so far." : "No rollout matches these filters."),
      pager(params, page)));
  return { node };
}

function pageNote(page, cursor) {
  const parts = [`${page.rollouts.length} shown`, `${page.scanned.toLocaleString("en")} read`];
  if (cursor) parts.push("(a later page)");
  if (page.partial) parts.push("· search stopped at its time budget");
  return `· ${parts.join(" ")}`;
}

function filterForm(query, runs, versions) {
  const input = (name, attrs = {}) => h("input", { name, value: query[name], ...attrs });
  const select = (name, options) => h("select", { name }, options.map(([value, label]) => h("option",
    { value, selected: query[name] === value }, label)));
  const tri = (name, yes, no) => select(name, [["", "any"], ["true", yes], ["false", no]]);
  const form = h("form", { class: "card filters", id: "filters", onsubmit: (e) => {
    e.preventDefault();
    const data = new FormData(form);
    const params = new URLSearchParams();
    for (const [k, v] of data.entries()) if (v !== "") params.set(k, v);
    navigate(`/ui/rollouts${params.toString() ? `?${params}` : ""}`);
  } },
  h("label", {}, "run ", select("run", [["", "any"], ...runs.map((r) => [r.run, r.run])])),
  h("label", {}, "status ", select("status", STATUSES.map((s) => [s, s || "any"]))),
  h("label", {}, "task ", input("task_id", { size: 12 })),
  h("label", {}, "group ", input("group_id", { size: 12 })),
  h("label", {}, "weight version ", input("weight_version", { size: 6, list: "versions" })),
  h("datalist", { id: "versions" }, versions.map((v) => h("option", { value: v.version }))),
  h("label", {}, "reward ", input("reward_min", { size: 4, type: "number", step: "any", placeholder: "min" }),
    "–", input("reward_max", { size: 4, type: "number", step: "any", placeholder: "max" })),
  h("label", {}, "errors ", tri("has_errors", "with", "without")),
  h("label", {}, "drift ", tri("has_drift", "with", "without")),
  h("label", { class: "grow" }, "search ", input("q", { type: "search", placeholder: "id or text in the calls" })),
  h("button", { type: "submit" }, "Filter"), " ",
  link("/ui/rollouts", "clear"));
  return form;
}

function rolloutTable(rows) {
  return table(["rollout", "status", "reward", "task", "group", "calls", "errors", "drift", "weight",
    "created", "calls took"], rows.map((r) => h("tr", { "data-rollout": r.rollout_id },
    h("td", {}, link(`/ui/rollouts/${encodeURIComponent(r.rollout_id)}`, shortId(r.rollout_id, 20))),
    h("td", {}, badge(r.status), r.attempt > 1 ? h("span", { class: "muted" }, ` try ${r.attempt}`) : null),
    h("td", { class: "num" }, fmtNum(r.reward)),
    h("td", { title: r.task_id || "" }, shortId(r.task_id, 16)),
    h("td", {}, r.group_id ? link(`/ui/groups/${encodeURIComponent(r.group_id)}`, shortId(r.group_id, 12)) : "–"),
    h("td", { class: "num" }, r.calls),
    h("td", { class: "num", title: r.error || "" }, r.call_errors || "", r.error ? badge("rollout", "failed") : null),
    h("td", { class: "num" }, r.drifted_calls ? badge(String(r.drifted_calls), "realigned") : ""),
    h("td", {}, r.weight_version ?? "–"),
    h("td", {}, fmtTime(r.created_at)),
    h("td", { class: "num" }, fmtSecs(r.calls_seconds)))), { class: "rollouts" });
}

// Next page by the server's cursor; "first page" drops it (keyset paging has no page numbers).
function pager(params, page) {
  const next = new URLSearchParams(params);
  next.set("cursor", page.next_cursor || "");
  const first = new URLSearchParams(params);
  first.delete("cursor");
  return h("p", { class: "pager" },
    params.get("cursor") ? link(`/ui/rollouts?${first}`, "← first page") : null, " ",
    page.next_cursor ? link(`/ui/rollouts?${next}`, page.partial ? "search further →" : "next page →") : null);
}

export async function renderGroup(groupId) {
  const g = await api(`/api/inspect/groups/${encodeURIComponent(groupId)}`);
  const cards = g.rollouts.map((r) => {
    const reply = r.last_reply && r.last_reply.message;
    const text = reply ? contentText(reply.content ?? reply.text) : "";
    const calls = reply && reply.tool_calls ? reply.tool_calls.map((c) => `${c.function?.name}(${c.function?.arguments})`) : [];
    return h("div", { class: "card member", "data-rollout": r.rollout_id },
      h("h3", {}, link(`/ui/rollouts/${encodeURIComponent(r.rollout_id)}`, shortId(r.rollout_id, 22))),
      h("p", {}, badge(r.status), " reward ", h("b", {}, fmtNum(r.reward)), " · advantage ",
        h("b", { class: r.advantage > 0 ? "pos" : r.advantage < 0 ? "neg" : "" }, fmtNum(r.advantage, 3))),
      h("p", { class: "muted" }, `${r.calls} calls`, r.call_errors ? ` · ${r.call_errors} errors` : "",
        r.drifted_calls ? ` · ${r.drifted_calls} drifted` : "", ` · weights ${r.weight_version ?? "–"}`),
      r.error ? h("pre", { class: "error-text" }, r.error) : null,
      h("div", { class: "msg assistant" }, h("div", { class: "role" }, "last reply"),
        h("pre", {}, text || (calls.length ? "" : "(empty)")), calls.map((c) => h("pre", { class: "tool-call" }, c))));
  });
  const node = h("div", { class: "page" }, section(
    h("span", {}, `Group ${g.group_id} `, h("span", { class: "muted" }, `· task ${g.task_id ?? "–"} · mean reward ${fmtNum(g.reward_mean)}`)),
    h("p", { class: "muted" }, "Advantages as the trainer's GRPO computes them: (reward − group mean) / (unbiased std + 1e-6) ",
      "over the completed rollouts (a missing reward counts as 0)."),
    h("div", { class: "group" }, cards)));
  return { node };
}
