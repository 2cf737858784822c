// Requests to this server: the API key as a Bearer header (never in a URL), server-sent
// events read from fetch, and the error message of any of the server's three error shapes.

const KEY = "tgis.playground.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY) ?? localStorage.getItem(KEY) ?? "";
}

// Keep the key for this tab only, or in this browser too when `remember` is set.
export function setApiKey(key, remember) {
  sessionStorage.removeItem(KEY);
  localStorage.removeItem(KEY);
  if (!key) return;
  (remember ? localStorage : sessionStorage).setItem(KEY, key);
}

export function keyRemembered() {
  return localStorage.getItem(KEY) !== null;
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// The message of an error body: TGI's {"error": "...", "error_type"}, OpenAI's
// {"error": {"message"}}, Anthropic's {"type": "error", "error": {"message"}}.
export function errorMessage(body) {
  if (body && typeof body === "object") {
    const e = body.error;
    if (typeof e === "string") return e;
    if (e && typeof e.message === "string") return e.message;
  }
  return null;
}

function headers(json) {
  const h = { accept: json ? "application/json" : "text/event-stream" };
  const key = apiKey();
  if (key) h.authorization = `Bearer ${key}`;
  return h;
}

async function failure(response) {
  let message = null;
  const text = await response.text();
  try {
    message = errorMessage(JSON.parse(text));
  } catch {
    message = text.trim() || null;
  }
  return new ApiError(response.status, `${response.status}: ${message ?? response.statusText}`);
}

// GET a JSON (or, with `text`, a plain-text) resource.
export async function get(path, { text = false, signal } = {}) {
  const response = await fetch(path, { headers: headers(true), signal, cache: "no-store" });
  if (!response.ok) throw await failure(response);
  return text ? response.text() : response.json();
}

// POST `body` as JSON and call `onEvent` with each server-sent event's parsed data until the
// stream ends ("[DONE]" is not passed on). An error event ends it with an ApiError.
export async function stream(path, body, onEvent, signal) {
  const h = headers(false);
  h["content-type"] = "application/json";
  const response = await fetch(path, { method: "POST", headers: h, body: JSON.stringify(body), signal });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const events = new EventParser();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      for (const data of events.push(value)) deliver(data, onEvent);
    }
    for (const data of events.push("\n\n")) deliver(data, onEvent);
  } finally {
    // An error event or a failing handler ends the request too: the server stops generating.
    reader.cancel().catch(() => {});
  }
}

function deliver(data, onEvent) {
  if (data === "[DONE]") return;
  const parsed = JSON.parse(data);
  const message = parsed && parsed.error !== undefined ? errorMessage(parsed) : null;
  if (message !== null) throw new ApiError(0, message);
  onEvent(parsed);
}

// Server-sent events to their data fields: `data:` with or without a space (TGI writes none),
// several data lines of one event joined by newlines, other fields and comments skipped;
// lines end in LF or CRLF.
export class EventParser {
  constructor() {
    this.buffer = "";
    this.data = [];
  }

  push(chunk) {
    this.buffer += chunk;
    const out = [];
    let end;
    while ((end = this.buffer.indexOf("\n")) >= 0) {
      // CRLF endings, a CR and its LF possibly in different chunks.
      const line = this.buffer.slice(0, end).replace(/\r$/, "");
      this.buffer = this.buffer.slice(end + 1);
      if (line === "") {
        if (this.data.length) out.push(this.data.join("\n"));
        this.data = [];
      } else if (line.startsWith("data:")) {
        this.data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
      }
    }
    return out;
  }
}
