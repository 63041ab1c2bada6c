// One rollout (GET /api/inspect/rollouts/{id}): its header and export command, its calls in order with
// their messages, and its trajectory as tokens coloured by loss mask, with a hover card per token.

import {
  api, badge, contentText, fmtNum, fmtSecs, fmtTime, h, link, navigate, section, table,
} from "./core.js";

const DRIFT_LABEL = {
  none: "rendered whole", clean: "continued", realigned: "realigned", forked: "forked",
};
const DRIFT_HELP = {
  none: "no earlier call of the rollout was a prefix: the prompt was rendered and tokenized whole",
  clean: "reused the earlier call's exact ids; re-rendering gave the same ids",
  realigned: "reused the earlier ids, but re-rendering them differed: the sampled ids were kept",
  forked: "the earlier reply was edited: the prompt was rendered whole and starts a new sequence",
};
const KIND_LABEL = {
  prompt: "prompt", tool: "tool result", user: "user turn", context: "context", sampled: "sampled",
};

export async function renderRollout(rolloutId, params) {
  const mode = params.get("mode") || "merge";
  const v = await api(`/api/inspect/rollouts/${encodeURIComponent(rolloutId)}`, { mode });
  const node = h("div", { class: "page" }, header(v), callsSection(v.calls), trajectorySection(v, mode),
    v.other_spans.length ? otherSpans(v.other_spans) : null);
  return { node, cleanup: hideTip };
}

function header(v) {
  const r = v.rollout;
  const cmd = h("code", { class: "cmd", id: "export-cmd" }, v.export.command);
  const copied = h("span", { class: "muted" });
  const copy = h("button", { id: "copy-export", onclick: () => copyText(v.export.command, copied) },
    "copy export command");
  const facts = [
    ["status", h("span", {}, badge(r.status), ` attempt ${r.attempt}/${r.max_attempts}`)],
    ["reward", fmtNum(r.reward)],
    ["task", r.task_id ? link(`/ui/rollouts?task_id=${encodeURIComponent(r.task_id)}`, r.task_id) : "–"],
    ["group", r.group_id ? link(`/ui/groups/${encodeURIComponent(r.group_id)}`, r.group_id) : "–"],
    ["split", r.split ?? "–"], ["weight version", r.weight_version ?? "–"], ["worker", r.worker_id ?? "–"],
    ["created", fmtTime(r.created_at)], ["started", fmtTime(r.started_at)], ["finished", fmtTime(r.finished_at)],
  ];
  return section(h("span", {}, "Rollout ", h("span", { class: "mono" }, r.rollout_id)),
    h("dl", { class: "facts" }, facts.map(([k, val]) => [h("dt", {}, k), h("dd", {}, val)])),
    r.error ? h("div", { class: "error-box" }, h("b", {}, "error: "), r.error,
      r.traceback ? h("details", {}, h("summary", {}, "traceback"), h("pre", {}, r.traceback)) : null) : null,
    r.rewards.length || r.events.length ? h("details", {}, h("summary", {},
      `${r.rewards.length} reward and ${r.events.length} other events`),
    table(["kind", "name", "value", "call", "at"], [...r.rewards, ...r.events].map((e) => h("tr", {},
      h("td", {}, e.kind), h("td", {}, e.name ?? "–"),
      h("td", { class: "mono" }, typeof e.value === "object" ? JSON.stringify(e.value).slice(0, 200) : String(e.value)),
      h("td", {}, e.call_index ?? "–"), h("td", {}, fmtTime(e.created_at)))))) : null,
    h("p", { class: "export" }, cmd, " ", copy, " ", copied));
}

async function copyText(text, note) {
  try {
    await navigator.clipboard.writeText(text);
    note.textContent = "copied";
  } catch (_) { // no clipboard permission (e.g. plain http on another host): select it for Ctrl-C
    const range = document.createRange();
    range.selectNodeContents(document.getElementById("export-cmd"));
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    note.textContent = "selected: press Ctrl-C to copy";
  }
}

function callsSection(calls) {
  if (!calls.length) return section("Calls", h("p", { class: "muted empty" }, "This rollout has no LLM calls."));
  const rows = calls.flatMap((c) => {
    const detail = h("tr", { class: "call-detail", hidden: true }, h("td", { colspan: 11 }, callDetail(c)));
    const toggle = () => { detail.hidden = !detail.hidden; };
    return [h("tr", { class: `call ${c.status === "error" ? "err" : ""}`, "data-call": c.index, onclick: toggle },
      h("td", {}, h("button", { class: "link" }, `#${c.index}`)), h("td", {}, c.api),
      h("td", {}, c.agent_name ?? "–"), h("td", { class: "num" }, fmtSecs(c.latency_s)),
      h("td", {}, c.weight_version ?? "–"),
      h("td", { title: DRIFT_HELP[c.drift] || c.drift }, badge(DRIFT_LABEL[c.drift] || c.drift, `drift-${c.drift}`)),
      h("td", {}, badge(c.tool_parse, `tp-${c.tool_parse}`)),
      h("td", { class: "num" }, `${c.input_tokens ?? "–"} → ${c.output_tokens ?? "–"}`),
      h("td", {}, c.status === "error" ? badge("error", "failed") : "ok"),
      h("td", {}, c.excluded.length ? badge(`excluded: ${c.excluded.map((e) => e.reason).join(", ")}`, "excluded") : ""),
      h("td", { class: "error-text" }, c.error ?? "")), detail];
  });
  return section(h("span", {}, "Calls ", h("span", { class: "muted" }, "· click a call for its messages")),
    table(["#", "API", "agent", "latency", "weights", "drift", "tool parse", "tokens in → out", "status",
      "training", "error"], rows, { class: "calls" }));
}

function callDetail(c) {
  return h("div", { class: "conversation" },
    c.messages_from ? h("p", { class: "muted" },
      `${c.messages_from} earlier messages as in the call before (${c.messages_total} sent in all)`) : null,
    c.tools.length ? h("p", { class: "muted" }, `tools offered: ${c.tools.join(", ")}`) : null,
    c.messages.map((m) => message(m)),
    c.replies.map((r) => message(r.message || {}, `reply${c.replies.length > 1 ? ` ${r.index}` : ""} · ${r.finish_reason ?? "–"} · ${r.output_tokens} tokens`)),
    c.excluded.map((e) => h("p", { class: "excluded-note" }, `choice ${e.choice_index} not trained: ${e.explanation}`)),
    c.error ? h("pre", { class: "error-text" }, c.error) : null);
}

function message(m, label) {
  if (!m || typeof m !== "object") return h("div", { class: "msg" }, h("pre", {}, String(m)));
  const role = m.role || "assistant";
  const calls = m.tool_calls || [];
  return h("div", { class: `msg ${role}` },
    h("div", { class: "role" }, label ? `${role} · ${label}` : role, m.tool_call_id ? ` · for ${m.tool_call_id}` : "",
      m.name ? ` · ${m.name}` : ""),
    h("pre", {}, contentText(m.content ?? m.text)),
    m.reasoning_content ? h("details", {}, h("summary", {}, "reasoning"), h("pre", {}, m.reasoning_content)) : null,
    calls.map((tc) => h("pre", { class: "tool-call" },
      `→ ${tc.function?.name ?? "?"}(${prettyArgs(tc.function?.arguments)})${tc.id ? `  [${tc.id}]` : ""}`)));
}

function prettyArgs(args) {
  if (typeof args !== "string") return JSON.stringify(args);
  try { return JSON.stringify(JSON.parse(args)); } catch (_) { return args; }
}

function trajectorySection(v, mode) {
  const t = v.trajectory;
  const modePick = h("span", {}, "assembly: ", ["merge", "per_call"].map((m) => h("label", {},
    h("input", { type: "radio", name: "mode", value: m, checked: m === mode, onchange: () => {
      navigate(`${location.pathname}?mode=${m}`);
    } }), ` ${m} `)));
  const legend = h("p", { class: "legend" }, ["sampled", "prompt", "tool", "user", "context"].map((k) => h("span",
    { class: `tok k-${k} ${k === "sampled" ? "s" : ""}` }, KIND_LABEL[k])), " ",
  h("span", { class: "mark" }, "▸ a call joins"), " hover a token for its id and logprobs");
  const excluded = t.excluded.length ? h("div", { class: "excluded" }, h("h3", {}, "Calls excluded from training"),
    table(["call", "choice", "reason"], t.excluded.map((e) => h("tr", {}, h("td", {}, `#${e.call_index ?? "?"} ${e.call_id}`),
      h("td", {}, e.choice_index), h("td", {}, badge(e.reason, "excluded"), " ",
        v.calls[e.call_index]?.excluded.find((x) => x.choice_index === e.choice_index)?.explanation ?? ""))))) : null;
  return section(h("span", {}, "Trajectory ", h("span", { class: "muted" },
    `· ${t.sequences.length} sequence(s) · reward ${fmtNum(t.reward)}`)),
  h("p", {}, modePick), legend,
  t.sequences.length ? t.sequences.map((s) => sequenceView(s, v.calls)) : h("p", { class: "muted empty" },
    "No sequence: no call of this rollout can be trained."),
  excluded);
}

function sequenceView(s, calls) {
  const n = s.n_tokens;
  const kinds = new Array(n).fill("prompt");
  const callAt = new Array(n).fill(null);
  for (const seg of s.segments) {
    for (let i = seg.start; i < seg.end; i++) { kinds[i] = seg.kind; callAt[i] = seg.call_index; }
  }
  const versionAt = new Array(n).fill(null);
  const versionNames = [];
  for (const r of s.versions) {
    if (!versionNames.includes(r.version)) versionNames.push(r.version);
    for (let i = r.start; i < r.end; i++) versionAt[i] = r.version;
  }
  const markersAt = new Map(s.markers.map((m) => [m.pos, m]));
  const box = h("div", { class: "tokens", "data-seq": s.index });
  for (let i = 0; i < n; i++) {
    const m = markersAt.get(i);
    if (m) {
      box.append(h("span", { class: `mark drift-${m.drift}`, title: DRIFT_HELP[m.drift] || m.drift },
        `▸ call #${m.call_index} · ${DRIFT_LABEL[m.drift] || m.drift}`));
    }
    const vi = versionAt[i] === null ? "" : ` v${versionNames.indexOf(versionAt[i]) % 6}`;
    const text = s.text ? s.text[i] : `[${s.token_ids[i]}]`;
    box.append(h("span", { class: `tok k-${kinds[i]}${s.loss_mask[i] ? " s" : ""}${vi}`, "data-i": i },
      text.replace(/\n/g, "↵\n")));
  }
  box.addEventListener("mouseover", (e) => {
    const el = e.target.closest(".tok");
    if (!el) return;
    const i = Number(el.dataset.i);
    showTip(e, tokenCard(s, i, kinds[i], callAt[i], versionAt[i], calls));
  });
  box.addEventListener("mouseleave", hideTip);
  const trained = s.trainer_logprobs ? "trainer logprobs reported" : "no trainer logprobs reported";
  return h("div", { class: "sequence" },
    h("h3", {}, `Sequence ${s.index}`, h("span", { class: "muted" },
      ` · agent ${s.agent_name ?? "–"} · ${n} tokens · ${s.n_sampled} sampled · reward ${fmtNum(s.reward)}`,
      ` · weights ${s.weight_versions.join(", ") || "–"} · ${trained}`, s.retokenized ? " · retokenized" : "")),
    versionNames.length > 1 ? h("p", { class: "legend" }, "weight versions: ", versionNames.map((name, k) => h("span",
      { class: `tok s v${k % 6}` }, name))) : null,
    box);
}

function tokenCard(s, i, kind, callIndex, version, calls) {
  const lp = s.logprobs[i];
  const tlp = s.trainer_logprobs ? s.trainer_logprobs[i] : null;
  const rows = [
    [`token #${i}`, `id ${s.token_ids[i]}`],
    ["text", JSON.stringify(s.text ? s.text[i] : null)],
    ["loss mask", `${s.loss_mask[i]} (${KIND_LABEL[kind] || kind})`],
  ];
  if (callIndex !== null) rows.push(["call", `#${callIndex} ${calls[callIndex]?.agent_name ?? ""}`]);
  if (version !== null) rows.push(["weight version", version]);
  if (lp !== null) rows.push(["engine logprob", fmtNum(lp, 5)]);
  if (tlp !== null) rows.push(["trainer logprob", fmtNum(tlp, 5)]);
  if (lp !== null && tlp !== null) rows.push(["trainer − engine", fmtNum(tlp - lp, 3)]);
  return h("table", {}, rows.map(([k, val]) => h("tr", {}, h("th", {}, k), h("td", {}, val))));
}

function showTip(e, content) {
  const tip = document.getElementById("tip");
  tip.replaceChildren(content);
  tip.hidden = false;
  const x = Math.min(e.clientX + 14, innerWidth - tip.offsetWidth - 8);
  const y = e.clientY + 16 + tip.offsetHeight > innerHeight ? e.clientY - tip.offsetHeight - 10 : e.clientY + 16;
  tip.style.left = `${x}px`;
  tip.style.top = `${y}px`;
}

function hideTip() {
  const tip = document.getElementById("tip");
  if (tip) tip.hidden = true;
}

function otherSpans(spans) {
  return section("Agent spans (OTLP)", table(["name", "status", "duration"], spans.map((s) => h("tr", {},
    h("td", {}, s.name), h("td", {}, s.status), h("td", { class: "num" }, fmtSecs(s.duration_s))))));
}
