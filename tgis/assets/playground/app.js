// The playground's entry point: tabs, the API key field, and what the page reads at load
// (/info for the model and limits, /v1/models for the LoRA adapters).

import { apiKey, get, keyRemembered, setApiKey } from "./api.js";
import { initChat } from "./chat.js";
import { initComplete, setMaxTopN } from "./complete.js";
import { initParams, loadAdapters } from "./params.js";
import { showInfo, watch } from "./server.js";
import { load, notify, save } from "./store.js";

const $ = (id) => document.getElementById(id);
const TABS = ["chat", "complete", "server"];

function select(name, focus = false) {
  for (const tab of TABS) {
    const on = tab === name;
    const button = $(`tab-${tab}`);
    button.setAttribute("aria-selected", String(on));
    button.tabIndex = on ? 0 : -1;
    $(`view-${tab}`).hidden = !on;
    if (on && focus) button.focus();
  }
  // The parameters apply to chat and completion; the server panel has the width to itself.
  $("params").hidden = name === "server";
  watch(name === "server");
  save("tab", name);
}

function initTabs() {
  for (const tab of TABS) $(`tab-${tab}`).addEventListener("click", () => select(tab));
  // Arrow keys move between tabs (the tablist pattern), Home/End to the ends.
  $("tabs").addEventListener("keydown", (e) => {
    const at = TABS.findIndex((t) => $(`tab-${t}`) === document.activeElement);
    if (at < 0) return;
    const to = { ArrowRight: at + 1, ArrowLeft: at - 1, Home: 0, End: TABS.length - 1 }[e.key];
    if (to === undefined) return;
    e.preventDefault();
    select(TABS[(to + TABS.length) % TABS.length], true);
  });
  select(TABS.includes(load("tab", "chat")) ? load("tab", "chat") : "chat");
}

function initKey() {
  const field = $("api-key");
  const remember = $("remember-key");
  field.value = apiKey();
  remember.checked = keyRemembered();
  const store = () => setApiKey(field.value.trim(), remember.checked);
  const use = () => {
    store();
    refreshModels();
  };
  field.addEventListener("change", use);
  remember.addEventListener("change", store);
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    use();
  });
}

async function refreshModels() {
  try {
    await loadAdapters();
  } catch (e) {
    // /v1/models needs the key when the server has one; chat and completion say so too.
    if (e.status === 401) notify(`The server wants an API key (${e.message}): type it in the API key field.`);
  }
}

async function start() {
  initTabs();
  initKey();
  initParams();
  initChat();
  initComplete();
  try {
    const info = await get("info");
    $("model-name").textContent = info.model_id;
    $("model-name").title = `${info.backend} · ${info.model_dtype}`;
    document.title = `tgis · ${info.model_id.split("/").pop()}`;
    setMaxTopN(info.max_top_n_tokens);
    showInfo(info);
  } catch (e) {
    $("model-name").textContent = "server unreachable";
    notify(`/info failed: ${e.message}`);
  }
  await refreshModels();
}

start();
