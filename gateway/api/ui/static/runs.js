// Runs: every training run in the store, and one run's curves against step or time, redrawn every few
// seconds while the page is open (a run in progress grows live). Weight versions are vertical lines on
// the time axis.

import { api, fmtNum, fmtTime, h, link, section, table } from "./core.js";

const POLL_MS = 5000;
// Each chart: a title and its series (metric keys as the trainer stores them: "train/..." per step,
// "eval/..." at evaluations). Other numeric metrics get charts of their own under "More metrics".
const CHARTS = [
  ["Reward mean", ["train/reward_mean", "eval/reward_mean"]],
  ["Pass rate", ["train/pass_rate", "eval/pass_rate"]],
  ["Held-out eval reward", ["eval/reward_mean"]],
  ["Loss", ["train/loss"]],
  ["KL", ["train/kl"]],
  ["Clip fraction", ["train/clip_frac"]],
  ["Engine/trainer logprob mismatch", ["train/mismatch"]],
  ["Tokens/s", ["train/tokens_per_s"]],
  ["Swap seconds", ["train/swap_s"]],
];
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#db2777"];

export async function renderRuns(run) {
  const { runs } = await api("/api/runs");
  const node = h("div", { class: "page" });
  if (!runs.length) {
    node.append(section("Runs", h("p", { class: "muted" },
      "No training run has reported metrics to this store yet. `tracegym train` posts each step's metrics ",
      "to POST /api/runs/{run}/metrics; its first lines print this page's address.")));
    return { node };
  }
  const current = run || runs[0].run;
  node.append(section("Runs", table(["run", "metric rows", "last step", "reward mean", "pass rate", "started",
    "updated"], runs.map((r) => h("tr", { class: r.run === current ? "selected" : "" },
    h("td", {}, link(`/ui/runs/${encodeURIComponent(r.run)}`, r.run)),
    h("td", {}, r.steps), h("td", {}, r.last_step),
    h("td", {}, fmtNum((r.latest || {})["train/reward_mean"] ?? (r.latest || {})["eval/reward_mean"])),
    h("td", {}, fmtNum((r.latest || {})["train/pass_rate"] ?? (r.latest || {})["eval/pass_rate"])),
    h("td", {}, fmtTime(r.started_at)), h("td", {}, fmtTime(r.updated_at)))), { class: "runs" })));
  if (!runs.some((r) => r.run === current)) {
    node.append(section(current, h("p", {}, `No run named ${current} in this store.`)));
    return { node };
  }
  const view = await runView(current);
  node.append(view.node);
  return { node, cleanup: view.cleanup };
}

async function fetchRun(run) {
  const [metrics, versions] = await Promise.all([
    api(`/api/runs/${encodeURIComponent(run)}/metrics`), api("/api/weight_versions")]);
  return { rows: metrics.metrics, versions: versions.weight_versions };
}

async function runView(run) {
  let data = await fetchRun(run);
  let axis = "step";
  const grid = h("div", { class: "charts" });
  const more = h("div", { class: "charts" });
  const status = h("span", { class: "muted" });
  const axisPick = h("span", { class: "axis-pick" }, "x axis: ", ["step", "time"].map((a) => h("label", {},
    h("input", { type: "radio", name: "axis", value: a, checked: a === axis, onchange: () => {
      axis = a;
      draw();
    } }), ` ${a} `)));
  const node = section(h("span", {}, `Run ${run} `, status),
    h("p", {}, axisPick, " ", link(`/ui/rollouts?run=${encodeURIComponent(run)}`, "this run's rollouts →")),
    grid, h("details", { class: "more" }, h("summary", {}, "More metrics"), more));
  let charts = [];

  function draw() {
    charts.forEach((c) => c.destroy());
    charts = [];
    grid.replaceChildren();
    more.replaceChildren();
    const width = chartWidth();
    const keys = new Set(data.rows.flatMap((r) => Object.keys(r.metrics)));
    const shown = new Set(CHARTS.flatMap(([, ks]) => ks));
    for (const [title, series] of CHARTS) {
      charts.push(chart(grid, title, series, data, axis, width));
    }
    [...keys].filter((k) => !shown.has(k)).sort().forEach((k) => {
      charts.push(chart(more, k, [k], data, axis, width));
    });
    status.textContent = `· ${data.rows.length} metric rows · updated ${new Date().toLocaleTimeString("en-GB")}`;
  }

  draw();
  const timer = setInterval(async () => {
    if (document.hidden) return;
    try {
      data = await fetchRun(run);
      draw();
    } catch (err) {
      status.textContent = `· update failed: ${err.message}`;
    }
  }, POLL_MS);
  let resizing = null;
  const onResize = () => {
    clearTimeout(resizing);
    resizing = setTimeout(draw, 200);
  };
  window.addEventListener("resize", onResize);
  return { node, cleanup: () => {
    clearInterval(timer);
    window.removeEventListener("resize", onResize);
    charts.forEach((c) => c.destroy());
  } };
}

// Three charts a row (two on narrow screens), as .charts lays them out: the card's inner width less the
// gaps, less each chart box's padding and border.
function chartWidth() {
  const app = document.getElementById("app");
  const w = (app ? app.clientWidth : 900) - 2 * 20 - 2 * 17;
  const columns = w > 1000 ? 3 : 2;
  return Math.max(240, Math.floor((w - (columns - 1) * 12) / columns) - 18);
}

// One chart of `keys` against step or time; the container says how many points it drew (data-points).
function chart(parent, title, keys, data, axis, width) {
  const rows = data.rows;
  const xs = rows.map((r) => (axis === "step" ? r.step : Date.parse(r.time) / 1000));
  const ys = keys.map((k) => rows.map((r) => {
    const v = r.metrics[k];
    return typeof v === "number" ? v : null;
  }));
  const points = ys.reduce((n, s) => n + s.filter((v) => v !== null).length, 0);
  const box = h("div", { class: "chart", "data-metric": title, "data-points": points });
  parent.append(box);
  if (!points) {
    box.append(h("h3", {}, title), h("p", { class: "muted empty" }, "no data yet"));
    return { destroy() {} };
  }
  box.append(h("h3", {}, title));
  const opts = {
    width, height: 180,
    scales: { x: { time: axis === "time" } },
    axes: [{ label: axis === "time" ? "" : "step" }, { size: 60, values: (u, vals) => vals.map((v) => fmtNum(v, 3)) }],
    series: [{ label: axis }, ...keys.map((k, i) => ({
      label: k.split("/")[0], stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
      points: { show: k.startsWith("eval/") || rows.length < 40, size: 5 },
    }))],
    legend: { live: true },
    hooks: axis === "time" ? { draw: [(u) => drawVersions(u, data.versions)] } : {},
  };
  return new uPlot(opts, [xs, ...ys], box);
}

// Weight versions as dashed vertical lines with their names, at the time each was loaded.
function drawVersions(u, versions) {
  const ctx = u.ctx;
  const { left, top, width, height } = u.bbox;
  ctx.save();
  ctx.strokeStyle = "rgba(120,120,120,0.55)";
  ctx.fillStyle = "rgba(90,90,90,0.9)";
  ctx.setLineDash([4, 4]);
  ctx.font = `${10 * devicePixelRatio}px sans-serif`;
  for (const v of versions) {
    const x = u.valToPos(Date.parse(v.created_at) / 1000, "x", true);
    if (x < left || x > left + width) continue;
    ctx.beginPath();
    ctx.moveTo(x, top);
    ctx.lineTo(x, top + height);
    ctx.stroke();
    ctx.fillText(`v${v.version}`, x + 3, top + 10 * devicePixelRatio);
  }
  ctx.restore();
}
