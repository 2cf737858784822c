// The parameters panel: its values, remembered in this browser, as the fields of TGI's
// `parameters` (raw completion) and of an OpenAI chat request (chat).

import { get } from "./api.js";
import { el, load, save } from "./store.js";

const FIELDS = [
  "adapter",
  "max_new_tokens",
  "temperature",
  "top_p",
  "top_k",
  "repetition_penalty",
  "seed",
  "stop",
  "grammar_type",
  "grammar",
  "prefix_id",
];

let form = null;
let defaults = {};

export function initParams() {
  form = document.getElementById("params-form");
  defaults = readForm();
  writeForm({ ...defaults, ...load("params", {}) });
  form.addEventListener("input", () => save("params", readForm()));
  form.addEventListener("change", () => save("params", readForm()));
  document.getElementById("reset-params").addEventListener("click", () => {
    writeForm(defaults);
    save("params", readForm());
  });
}

function readForm() {
  const values = {};
  for (const name of FIELDS) values[name] = form.elements[name].value;
  return values;
}

function writeForm(values) {
  for (const name of FIELDS) {
    const field = form.elements[name];
    if (values[name] === undefined) continue;
    if (field.tagName === "SELECT" && ![...field.options].some((o) => o.value === values[name])) {
      // An adapter the server no longer serves (or not yet listed): keep it selectable.
      field.append(el("option", { value: values[name], text: values[name] }));
    }
    field.value = values[name];
  }
}

// The adapters from /v1/models (the first entry is the base model), added to the picker.
export async function loadAdapters() {
  const models = await get("v1/models");
  const select = form.elements.adapter;
  const current = select.value;
  const ids = (models.data ?? []).slice(1).map((m) => m.id);
  select.replaceChildren(
    el("option", { value: "", text: "base model" }),
    ...ids.map((id) => el("option", { value: id, text: id })),
  );
  if (current && !ids.includes(current)) select.append(el("option", { value: current, text: `${current} (not served)` }));
  select.value = current;
  return ids;
}

export class ParamError extends Error {}

function number(name, value, integer) {
  if (form.elements[name].validity?.badInput) throw new ParamError(`${name} is not a number`);
  if (value.trim() === "") return undefined;
  const n = Number(value);
  if (!Number.isFinite(n) || (integer && !Number.isInteger(n))) {
    throw new ParamError(`${name} must be ${integer ? "a whole number" : "a number"}, not "${value}"`);
  }
  return n;
}

// The panel's values, checked and typed (absent when blank).
export function current() {
  const v = readForm();
  const stop = v.stop.split("\n").filter((s) => s !== "");
  let grammar;
  if (v.grammar_type === "json") {
    try {
      grammar = { type: "json", value: JSON.parse(v.grammar) };
    } catch (e) {
      throw new ParamError(`The grammar's JSON schema does not parse: ${e.message}`);
    }
  } else if (v.grammar_type === "regex") {
    if (!v.grammar) throw new ParamError("The regex grammar is empty: write a pattern or choose none");
    grammar = { type: "regex", value: v.grammar };
  }
  return {
    adapter: v.adapter || undefined,
    max_new_tokens: number("max_new_tokens", v.max_new_tokens, true),
    // Blank or 0: greedy, for chat and completion alike.
    temperature: number("temperature", v.temperature, false) ?? 0,
    top_p: number("top_p", v.top_p, false),
    top_k: number("top_k", v.top_k, true),
    repetition_penalty: number("repetition_penalty", v.repetition_penalty, false),
    seed: number("seed", v.seed, true),
    stop: stop.length ? stop : undefined,
    grammar,
    prefix_id: v.prefix_id.trim() || undefined,
  };
}

function defined(obj) {
  return Object.fromEntries(Object.entries(obj).filter(([, value]) => value !== undefined));
}

// TGI's `parameters` of /generate_stream; `overrides` (the compare field) win. Sampling is
// on when the temperature is above 0 (unless `do_sample` is overridden); greedy requests carry
// no sampling fields, which TGI would take as asking to sample.
export function generateParameters(p, overrides = {}) {
  const out = defined({
    max_new_tokens: p.max_new_tokens,
    temperature: p.temperature,
    top_p: p.top_p !== undefined && p.top_p < 1 ? p.top_p : undefined,
    top_k: p.top_k,
    repetition_penalty: p.repetition_penalty,
    seed: p.seed,
    stop: p.stop,
    grammar: p.grammar,
    adapter_id: p.adapter,
    prefix_id: p.prefix_id,
    ...overrides,
  });
  if (!("do_sample" in overrides)) out.do_sample = (out.temperature ?? 0) > 0;
  if (!out.do_sample) {
    delete out.temperature;
    delete out.top_p;
    delete out.top_k;
  }
  return out;
}

// The sampling fields of an OpenAI chat request (`model` picks a LoRA adapter, "tgi" the base).
export function chatFields(p) {
  if (p.grammar?.type === "regex") {
    throw new ParamError("A regex grammar applies to raw completion; chat takes a JSON schema (or none)");
  }
  const greedy = p.temperature === 0; // top_p or top_k would make the server sample
  return defined({
    model: p.adapter ?? "tgi",
    max_tokens: p.max_new_tokens,
    temperature: p.temperature,
    top_p: greedy ? undefined : p.top_p,
    top_k: greedy ? undefined : p.top_k,
    repetition_penalty: p.repetition_penalty,
    seed: p.seed,
    stop: p.stop,
    prefix_id: p.prefix_id,
    response_format: p.grammar
      ? { type: "json_schema", json_schema: { name: "playground", schema: p.grammar.value } }
      : undefined,
  });
}
