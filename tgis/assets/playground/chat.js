// The chat view: conversations through /v1/chat/completions, streamed. Reasoning shows in a
// collapsible block, tool calls as structured blocks, text as safe markdown. Stop, regenerate
// and edit a turn; conversations stay in this browser and export to / import from JSON.

import { stream } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { chatFields, current } from "./params.js";
import { copyText, download, el, load, notify, save } from "./store.js";

const FORMAT = "tgis-playground";

let conversations = [];
let active = null; // the conversation shown
let running = null; // {controller, conversation, message} while a reply streams
const $ = (id) => document.getElementById(id);

export function initChat() {
  conversations = load("conversations", []).filter(validConversation);
  active = conversations[0] ?? newConversation();
  $("new-chat").addEventListener("click", () => {
    if (running) return;
    active = newConversation();
    render();
    $("message-input").focus();
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("message-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop-chat").addEventListener("click", () => running?.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("system-prompt").addEventListener("input", (e) => {
    active.system = e.target.value;
    persist();
  });
  $("chat-tools").addEventListener("input", (e) => {
    active.tools = e.target.value;
    persist();
  });
  $("export-chats").addEventListener("click", () => {
    const body = { format: FORMAT, version: 1, conversations };
    download(`tgis-conversations-${new Date().toISOString().slice(0, 10)}.json`, JSON.stringify(body, null, 2));
  });
  $("import-chats").addEventListener("change", async (e) => {
    const file = e.target.files[0];
    e.target.value = "";
    if (file) importConversations(await file.text());
  });
  // Another tab of this page saved its conversations: show them (not while a reply streams,
  // whose end saves this tab's).
  window.addEventListener("storage", (e) => {
    if (e.key !== "tgis.playground.conversations" || running) return;
    conversations = load("conversations", []).filter(validConversation);
    active = conversations.find((c) => c.id === active.id) ?? conversations[0] ?? newConversation();
    render();
  });
  render();
}

function newId() {
  return crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`;
}

function newConversation() {
  const conversation = { id: newId(), title: "New chat", system: "", tools: "", messages: [], updated: Date.now() };
  conversations.unshift(conversation);
  persist();
  return conversation;
}

const isString = (v) => typeof v === "string";
const optional = (v, check) => v === undefined || v === null || check(v);

function validMessage(m) {
  return (
    m &&
    typeof m === "object" &&
    ["user", "assistant", "tool"].includes(m.role) &&
    optional(m.content, isString) &&
    optional(m.reasoning, isString) &&
    optional(m.tool_call_id, isString) &&
    optional(m.tool_calls, (calls) => Array.isArray(calls) && calls.every((c) => c && isString(c.name) && isString(c.arguments)))
  );
}

// A conversation as this page stores and exports it (an import is checked against it).
function validConversation(c) {
  return (
    c &&
    typeof c === "object" &&
    isString(c.id) &&
    optional(c.title, isString) &&
    optional(c.system, isString) &&
    optional(c.tools, isString) &&
    Array.isArray(c.messages) &&
    c.messages.every(validMessage)
  );
}

function persist() {
  const saved = save("conversations", conversations);
  if (!saved) notify("This browser refused to store the conversations (storage full?): export them to keep them.");
  return saved;
}

export function importConversations(text) {
  if (running) {
    notify("Wait for the reply, or stop it, before importing.");
    return 0;
  }
  let data;
  try {
    data = JSON.parse(text);
  } catch (e) {
    notify(`The file is not JSON: ${e.message}`);
    return 0;
  }
  const list = Array.isArray(data) ? data : data?.conversations;
  if (!Array.isArray(list) || !list.every(validConversation)) {
    notify(`The file is not a conversations export: expected {"format": "${FORMAT}", "conversations": [...]} with messages of a role and a content`);
    return 0;
  }
  const known = new Set(conversations.map((c) => c.id));
  for (const c of list.slice().reverse()) {
    const copy = { ...c, title: c.title || "Imported chat", system: c.system ?? "", tools: c.tools ?? "", updated: Date.now() };
    if (known.has(copy.id)) copy.id = newId();
    conversations.unshift(copy);
  }
  active = conversations[0];
  render();
  if (persist()) notify(`Imported ${list.length} conversation${list.length === 1 ? "" : "s"}.`, "info");
  return list.length;
}

function render() {
  renderList();
  $("system-prompt").value = active.system ?? "";
  $("chat-tools").value = active.tools ?? "";
  const list = $("messages");
  list.replaceChildren(...active.messages.map((m, i) => messageItem(m, i)));
  list.scrollTop = list.scrollHeight;
  updateButtons();
}

function renderList() {
  $("conversation-list").replaceChildren(
    ...conversations.map((c) =>
      el(
        "li",
        { class: c === active ? "current" : null },
        el("button", {
          type: "button",
          class: "conv",
          "aria-current": c === active ? "true" : null,
          text: c.title,
          onclick: () => {
            if (running) return;
            active = c;
            render();
            $("message-input").focus();
          },
        }),
        el("button", {
          type: "button",
          class: "delete",
          "aria-label": `Delete conversation: ${c.title}`,
          text: "×",
          onclick: () => {
            if (running?.conversation === c) return;
            conversations = conversations.filter((x) => x !== c);
            persist();
            if (active !== c) {
              renderList(); // the shown conversation, perhaps streaming, stays as it is
              return;
            }
            active = conversations[0] ?? newConversation();
            render();
            document.querySelector("#conversation-list .conv")?.focus();
          },
        }),
      ),
    ),
  );
}

function updateButtons() {
  $("send").disabled = Boolean(running);
  $("stop-chat").disabled = !running;
  $("regenerate").disabled = Boolean(running) || !active.messages.some((m) => m.role !== "assistant");
  const pending = pendingCall();
  const option = $("send-as").querySelector('option[value="tool"]');
  option.disabled = !pending;
  option.textContent = pending ? `tool result (${pending.name})` : "tool result";
  if (!pending) $("send-as").value = "user";
}

// The last assistant turn's first tool call that no tool message answers yet.
function pendingCall() {
  const msgs = active.messages;
  const last = msgs.findLastIndex((m) => m.role === "assistant");
  if (last < 0) return null;
  const answered = new Set(msgs.slice(last + 1).filter((m) => m.role === "tool").map((m) => m.tool_call_id));
  return (msgs[last].tool_calls ?? []).find((c) => !answered.has(c.id)) ?? null;
}

function messageItem(m, index) {
  const item = el("li", { class: `msg ${m.role}`, "data-index": index });
  fillMessage(item, m, index);
  return item;
}

function fillMessage(item, m, index) {
  const label = m.role === "tool" ? "tool result" : m.role;
  const head = el("div", { class: "msg-head" }, el("span", { class: "role", text: label }));
  if (m.role === "user" && !running) {
    head.append(el("button", { type: "button", class: "link", text: "Edit", onclick: () => editTurn(item, index) }));
  }
  if (m.role === "assistant" && m.content && !(running && running.message === m)) {
    head.append(
      el("button", {
        type: "button",
        class: "link",
        text: "Copy",
        onclick: (e) => copyText(m.content, e.target),
      }),
    );
  }
  const body = [];
  if (m.reasoning) {
    const streamingThought = running?.message === m && !m.content && !m.tool_calls?.length;
    body.push(
      el(
        "details",
        { class: "reasoning", open: streamingThought || m.reasoningOpen ? true : null },
        el("summary", { text: streamingThought ? "Reasoning…" : "Reasoning" }),
        el("div", { class: "md" }, renderMarkdown(m.reasoning)),
      ),
    );
  }
  if (m.role === "tool") {
    body.push(el("div", { class: "tool-for", text: `for call ${m.tool_call_id}` }), el("pre", { text: m.content }));
  } else if (m.content) {
    body.push(el("div", { class: "md" }, renderMarkdown(m.content)));
  }
  for (const call of m.tool_calls ?? []) body.push(toolCallBlock(call));
  if (m.error) body.push(el("p", { class: "error", text: m.error }));
  if (m.finish) body.push(el("p", { class: "meta", text: m.finish }));
  if (running?.message === m && !m.content && !m.reasoning && !m.tool_calls?.length && !m.error) {
    body.push(el("p", { class: "meta", text: "waiting for the first token…" }));
  }
  item.replaceChildren(head, ...body);
  // Kept open or folded as the user left it (a click, or Enter/Space on the summary).
  const details = item.querySelector("details.reasoning");
  details?.querySelector("summary").addEventListener("click", () => (m.reasoningOpen = !details.open));
}

function toolCallBlock(call) {
  let args = call.arguments;
  try {
    args = JSON.stringify(JSON.parse(call.arguments), null, 2);
  } catch {
    // still streaming, or not JSON: shown as written
  }
  return el(
    "div",
    { class: "tool-call", role: "group", "aria-label": `Tool call ${call.name}` },
    el("div", { class: "tool-name" }, el("span", { text: "call " }), el("code", { text: call.name || "…" }), el("span", { class: "muted", text: ` ${call.id ?? ""}` })),
    el("pre", { text: args }),
  );
}

function editTurn(item, index) {
  const m = active.messages[index];
  const area = el("textarea", { rows: 3, "aria-label": "Edit the message" });
  area.value = m.content;
  const save_ = () => {
    const fields = requestFields(active);
    if (fields === null) return;
    m.content = area.value;
    active.messages = active.messages.slice(0, index + 1);
    persist();
    reply(fields);
  };
  item.replaceChildren(
    el("div", { class: "msg-head" }, el("span", { class: "role", text: "user (editing)" })),
    area,
    el(
      "div",
      { class: "row" },
      el("button", { type: "button", text: "Cancel", onclick: () => render() }),
      el("button", { type: "button", class: "primary", text: "Save and send", onclick: save_ }),
    ),
  );
  area.addEventListener("keydown", (e) => {
    if (e.key === "Escape") render();
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      save_();
    }
  });
  area.focus();
}

function send() {
  if (running) return;
  const input = $("message-input");
  const text = input.value;
  if (!text.trim()) return;
  const fields = requestFields(active);
  if (fields === null) return; // the message stays in the box, to send once fixed
  const last = active.messages.at(-1);
  if (last?.role === "assistant" && last.error && !last.content && !last.tool_calls?.length) {
    // A reply that failed: its question and the error give way to the new message, so that
    // turns keep alternating (strict chat templates refuse two user turns in a row).
    active.messages.pop();
    if (active.messages.at(-1)?.role === "user") active.messages.pop();
  }
  const asTool = $("send-as").value === "tool" && pendingCall();
  const message = asTool ? { role: "tool", content: text, tool_call_id: asTool.id } : { role: "user", content: text };
  active.messages.push(message);
  if (active.title === "New chat" && message.role === "user") active.title = text.trim().slice(0, 40);
  input.value = "";
  reply(fields);
}

function regenerate() {
  if (running) return;
  const fields = requestFields(active);
  if (fields === null) return;
  while (active.messages.length && active.messages.at(-1).role === "assistant") active.messages.pop();
  if (active.messages.length) reply(fields);
}

// The request's fields other than its messages, from the parameters panel and the
// conversation's tools; null (and the reason shown) when one of them is wrong.
function requestFields(conversation) {
  try {
    const fields = { ...chatFields(current()), stream: true, stream_options: { include_usage: true } };
    const t = tools(conversation);
    if (t) fields.tools = t;
    return fields;
  } catch (e) {
    notify(e instanceof SyntaxError ? `The tools are not JSON: ${e.message}` : e.message);
    return null;
  }
}

// The request's messages: the system prompt, then every turn (failed replies left out).
function requestMessages(conversation) {
  const out = [];
  if (conversation.system) out.push({ role: "system", content: conversation.system });
  for (const m of conversation.messages) {
    if (m.role === "assistant") {
      if (m.error && !m.content && !m.tool_calls?.length) continue;
      const turn = { role: "assistant", content: m.content ?? "" };
      if (m.tool_calls?.length) {
        turn.tool_calls = m.tool_calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
      }
      out.push(turn);
    } else if (m.role === "tool") {
      out.push({ role: "tool", content: m.content, tool_call_id: m.tool_call_id });
    } else {
      out.push({ role: "user", content: m.content });
    }
  }
  return out;
}

function tools(conversation) {
  const text = (conversation.tools ?? "").trim();
  if (!text) return undefined;
  const parsed = JSON.parse(text);
  if (!Array.isArray(parsed)) throw new Error("Tools must be a JSON array of {\"type\": \"function\", \"function\": {...}}");
  return parsed;
}

async function reply(fields) {
  const conversation = active;
  const message = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
  const body = { ...fields, messages: requestMessages(conversation) };
  notify("");
  conversation.messages.push(message);
  conversation.updated = Date.now();
  persist(); // the question is kept even if the page goes before the reply ends
  running = { controller: new AbortController(), conversation, message };
  render();
  $("chat-status").textContent = "Generating a reply";
  const item = $("messages").lastElementChild;
  let frame = 0;
  const redraw = () => {
    if (frame) return;
    frame = requestAnimationFrame(() => {
      frame = 0;
      if (active === conversation) {
        const list = $("messages");
        const following = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
        fillMessage(item, message, conversation.messages.length - 1);
        if (following) list.scrollTop = list.scrollHeight; // unless the reader scrolled up
      }
    });
  };
  const started = performance.now();
  let first = null;
  let usage = null;
  try {
    await stream(
      "v1/chat/completions",
      body,
      (chunk) => {
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices?.[0];
        if (!choice) return;
        const d = choice.delta ?? {};
        const thought = d.reasoning_content ?? d.reasoning;
        if ((d.content || thought || d.tool_calls) && first === null) first = performance.now();
        if (thought) message.reasoning += thought;
        if (d.content) message.content += d.content;
        for (const t of d.tool_calls ?? []) {
          const call = (message.tool_calls[t.index ?? 0] ??= { id: "", name: "", arguments: "" });
          if (t.id) call.id = t.id;
          if (t.function?.name) call.name += t.function.name;
          if (t.function?.arguments) call.arguments += t.function.arguments;
        }
        if (choice.finish_reason) message.finish = finishText(choice.finish_reason);
        redraw();
      },
      running.controller.signal,
    );
  } catch (e) {
    if (e.name === "AbortError") message.finish = "stopped";
    else {
      message.error = e.message;
      notify(e.message);
    }
  }
  message.tool_calls = message.tool_calls.filter(Boolean);
  if (!message.reasoning) delete message.reasoning;
  if (!message.tool_calls.length) delete message.tool_calls;
  running = null;
  // Screen readers hear the whole reply once, not every token.
  $("chat-status").textContent = message.error
    ? `The reply failed: ${message.error}`
    : `Reply: ${[message.reasoning ? "(reasoning) " : "", message.content, ...(message.tool_calls ?? []).map((c) => ` call ${c.name}`)].join("")}`;
  const seconds = (performance.now() - started) / 1000;
  $("chat-usage").textContent = usage ? usageText(usage, seconds, first === null ? null : (first - started) / 1000) : "";
  persist();
  if (active === conversation) render();
  else renderList();
}

function finishText(reason) {
  return { length: "stopped at max_new_tokens", stop: "", tool_calls: "" }[reason] ?? reason;
}

function usageText(usage, seconds, ttft) {
  const parts = [`${usage.prompt_tokens} prompt + ${usage.completion_tokens} generated tokens`];
  if (ttft !== null) parts.push(`first token ${Math.round(ttft * 1000)} ms`);
  if (ttft !== null && usage.completion_tokens > 1 && seconds > ttft) {
    parts.push(`${((usage.completion_tokens - 1) / (seconds - ttft)).toFixed(1)} tokens/s`);
  }
  return parts.join(" · ");
}
