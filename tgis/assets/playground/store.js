// Values kept in this browser (localStorage), as JSON under "tgis.playground.*" keys.

const PREFIX = "tgis.playground.";

export function load(name, fallback) {
  try {
    const raw = localStorage.getItem(PREFIX + name);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

// Returns false when the browser refused (storage full or disabled).
export function save(name, value) {
  try {
    localStorage.setItem(PREFIX + name, JSON.stringify(value));
    return true;
  } catch {
    return false;
  }
}

// Small helpers to build DOM nodes without HTML strings: model output never becomes markup.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// Show a message in the page's alert region (role=alert: screen readers announce it).
export function notify(message, kind = "error") {
  const box = document.getElementById("notice");
  box.textContent = message;
  box.dataset.kind = kind;
  box.hidden = !message;
}

// Copy `text` to the clipboard, saying on `button` how it went. Browsers offer the clipboard
// on https and localhost only.
export function copyText(text, button) {
  if (!navigator.clipboard) {
    button.textContent = "Copy needs https";
    return;
  }
  navigator.clipboard.writeText(text).then(
    () => (button.textContent = "Copied"),
    () => (button.textContent = "Copy refused"),
  );
}

// Save `text` as a file download named `name`.
export function download(name, text, type = "application/json") {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = el("a", { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}
