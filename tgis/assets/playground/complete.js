// Raw completion through /generate_stream with TGI's parameters. With token details on, each
// generated token shows its logprob and the top-n alternatives on hover or keyboard focus.
// "Compare with" runs the same prompt a second time, at once, with some parameters changed.

import { stream } from "./api.js";
import { current, generateParameters, ParamError } from "./params.js";
import { el, load, notify, save } from "./store.js";

let controllers = [];
let maxTopN = 0;
const $ = (id) => document.getElementById(id);

export function setMaxTopN(n) {
  maxTopN = Number(n) || 0;
}

export function initComplete() {
  const prompt = $("prompt-input");
  prompt.value = load("prompt", "The capital of France is");
  $("compare-with").value = load("compare", "");
  prompt.addEventListener("input", () => save("prompt", prompt.value));
  $("compare-with").addEventListener("input", (e) => save("compare", e.target.value));
  $("complete-form").addEventListener("submit", (e) => {
    e.preventDefault();
    run();
  });
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      run();
    }
  });
  $("stop-complete").addEventListener("click", () => controllers.forEach((c) => c.abort()));
  const tooltip = $("tooltip");
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape") tooltip.hidden = true;
  });
}

function overrides() {
  const text = $("compare-with").value.trim();
  if (!text) return null;
  let parsed;
  try {
    parsed = JSON.parse(text);
  } catch (e) {
    throw new ParamError(`"Compare with" must be a JSON object of parameters: ${e.message}`);
  }
  if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) {
    throw new ParamError('"Compare with" must be a JSON object of parameters, e.g. {"temperature": 0}');
  }
  return parsed;
}

async function run() {
  if (controllers.length) return;
  const inputs = $("prompt-input").value;
  const details = $("show-details").checked;
  let sets;
  try {
    const p = current();
    const other = overrides();
    sets = [generateParameters(p)];
    if (other) sets.push(generateParameters(p, other));
  } catch (e) {
    notify(e.message);
    return;
  }
  notify("");
  const runs = $("runs");
  runs.replaceChildren();
  runs.classList.toggle("compare", sets.length > 1);
  $("run-complete").disabled = true;
  $("stop-complete").disabled = false;
  controllers = sets.map(() => new AbortController());
  await Promise.all(
    sets.map((parameters, i) => {
      if (details) {
        parameters.details = true;
        if (maxTopN > 0) parameters.top_n_tokens = maxTopN;
      }
      const view = runView(sets.length > 1 ? "AB"[i] : null, parameters, inputs);
      runs.append(view.root);
      return generate(inputs, parameters, view, controllers[i].signal);
    }),
  );
  controllers = [];
  $("run-complete").disabled = false;
  $("stop-complete").disabled = true;
}

function runView(label, parameters, inputs) {
  const shown = Object.entries(parameters)
    .filter(([k]) => !["details", "top_n_tokens"].includes(k))
    .map(([k, v]) => `${k}=${JSON.stringify(v)}`)
    .join(" ");
  const output = el("div", {
    class: "output",
    tabindex: 0,
    role: "group",
    "aria-label": "Generated tokens (arrow keys step through their details)",
  });
  output.append(el("span", { class: "prompt", text: inputs }));
  output.addEventListener("keydown", stepTokens);
  const root = el(
    "article",
    { class: "run" },
    el("header", {}, label ? el("strong", { text: `${label} ` }) : null, el("code", { text: shown })),
    output,
  );
  const footer = el("footer", { class: "muted", "aria-live": "polite" });
  root.append(footer);
  return { root, output, footer };
}

async function generate(inputs, parameters, view, signal) {
  const started = performance.now();
  let first = null;
  let count = 0;
  try {
    await stream(
      "generate_stream",
      { inputs, parameters },
      (event) => {
        if (!event.token) return;
        first ??= performance.now();
        count += 1;
        view.output.append(tokenSpan(event.token, event.top_tokens, parameters.details));
        if (event.details) view.footer.textContent = summary(event.details, started, first, count);
      },
      signal,
    );
  } catch (e) {
    if (e.name === "AbortError") view.footer.textContent = `stopped after ${count} tokens`;
    else {
      view.root.append(el("p", { class: "error", text: e.message }));
      notify(e.message);
    }
  }
}

function summary(details, started, first, count) {
  const seconds = (performance.now() - started) / 1000;
  const parts = [
    `finish: ${details.finish_reason}`,
    `${details.generated_tokens} tokens`,
    `input ${details.input_length} tokens`,
  ];
  if (details.seed !== null && details.seed !== undefined) parts.push(`seed ${details.seed}`);
  const ttft = (first - started) / 1000;
  parts.push(`first token ${Math.round(ttft * 1000)} ms`);
  if (count > 1 && seconds > ttft) parts.push(`${((count - 1) / (seconds - ttft)).toFixed(1)} tokens/s`);
  return parts.join(" · ");
}

function probabilityClass(logprob) {
  if (logprob === null || logprob === undefined || Number.isNaN(logprob)) return "p-none";
  const p = Math.exp(logprob);
  return p >= 0.9 ? "p-4" : p >= 0.6 ? "p-3" : p >= 0.3 ? "p-2" : p >= 0.1 ? "p-1" : "p-0";
}

function tokenSpan(token, top, details) {
  const span = el("span", {
    class: details ? `tok ${probabilityClass(token.logprob)}${token.special ? " special" : ""}` : "tok",
    text: token.text,
  });
  if (!details) return span;
  span.tabIndex = -1;
  span.tokenInfo = { token, top: top ?? [] };
  const show = () => showTooltip(span);
  span.addEventListener("mouseenter", show);
  span.addEventListener("focus", show);
  span.addEventListener("mouseleave", () => ($("tooltip").hidden = true));
  span.addEventListener("blur", () => ($("tooltip").hidden = true));
  return span;
}

function visible(text) {
  return JSON.stringify(text); // spaces and newlines shown: "\n", " the"
}

function percent(logprob) {
  return `${(Math.exp(logprob) * 100).toFixed(logprob > -4.6 ? 1 : 3)}%`;
}

export function showTooltip(span) {
  const { token, top } = span.tokenInfo;
  const tooltip = $("tooltip");
  const rows = top.map((t) =>
    el(
      "tr",
      { class: t.id === token.id ? "chosen" : null },
      el("td", {}, el("code", { text: visible(t.text) })),
      el("td", { class: "num", text: t.logprob.toFixed(3) }),
      el("td", { class: "num", text: percent(t.logprob) }),
    ),
  );
  tooltip.replaceChildren(
    el("div", {}, el("code", { text: visible(token.text) }), ` id ${token.id}${token.special ? " (special)" : ""}`),
    el("div", { text: `logprob ${token.logprob.toFixed(3)} · p ${percent(token.logprob)}` }),
    rows.length
      ? el(
          "table",
          {},
          el("caption", { text: "top alternatives" }),
          el("tbody", {}, rows),
        )
      : el("div", { class: "muted", text: "no alternatives (the server's --max-top-n-tokens is 0)" }),
  );
  tooltip.hidden = false;
  // Below the token, or above it near the window's bottom; always inside the window.
  const box = span.getBoundingClientRect();
  const { offsetWidth: width, offsetHeight: height } = tooltip;
  const below = box.bottom + 6 + height <= innerHeight;
  tooltip.style.left = `${Math.max(4, Math.min(box.left, innerWidth - width - 8))}px`;
  tooltip.style.top = `${Math.max(4, below ? box.bottom + 6 : box.top - height - 6)}px`;
  span.setAttribute("aria-describedby", "tooltip");
}

// Left/Right (and Home/End) move between the generated tokens of an output.
function stepTokens(e) {
  const tokens = [...e.currentTarget.querySelectorAll(".tok[tabindex]")];
  if (!tokens.length || !["ArrowLeft", "ArrowRight", "Home", "End"].includes(e.key)) return;
  e.preventDefault();
  const at = tokens.indexOf(document.activeElement);
  const last = tokens.length - 1;
  const moves = {
    Home: 0,
    End: last,
    ArrowRight: at < 0 ? 0 : Math.min(last, at + 1),
    ArrowLeft: at < 0 ? last : Math.max(0, at - 1),
  };
  tokens[moves[e.key]].focus();
}
