// Markdown to DOM nodes, safely: every piece of model output becomes a text node or an element
// built here, never HTML, so no output can inject markup or script. Links keep http(s) and
// mailto targets only; images are shown as links (the page loads nothing from elsewhere).
// Covers what chat models write: paragraphs, headings, fenced code, lists, quotes, tables,
// rules, and inline code, bold, italic, strike-through, links.

import { copyText, el } from "./store.js";

const FENCE = /^(\s*)(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
// Quotes and lists nest this deep; deeper text is shown as written (a runaway model cannot
// exhaust the stack).
const MAX_DEPTH = 16;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s*>\s?/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

export function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  const lines = String(text ?? "").replace(/\r\n?/g, "\n").split("\n");
  try {
    root.append(...blocks(lines, 0));
  } catch {
    root.append(el("p", { class: "plain", text: lines.join("\n") }));
  }
  return root;
}

// A table starts at a row with pipes followed by a rule of dashes.
function tableAt(line, next) {
  return line.includes("|") && next !== undefined && TABLE_RULE.test(next) && next.includes("-");
}

function startsBlock(line, next) {
  return [FENCE, HEADING, RULE, QUOTE, ITEM].some((re) => re.test(line)) || tableAt(line, next);
}

function blocks(lines, depth) {
  if (depth > MAX_DEPTH) return [el("p", { class: "plain", text: lines.join("\n") })];
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (line.trim() === "") {
      i += 1;
      continue;
    }
    const fence = FENCE.exec(line);
    if (fence) {
      const body = [];
      const indent = fence[1].length; // an indented fence's lines lose as much indent
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[2])) {
        const l = lines[i++];
        body.push(l.slice(Math.min(indent, leading(l))));
      }
      i += 1; // the closing fence (absent while a reply still streams)
      out.push(codeBlock(body.join("\n"), fence[3]));
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      out.push(el(`h${Math.min(heading[1].length + 2, 6)}`, {}, inline(heading[2])));
      i += 1;
      continue;
    }
    if (RULE.test(line)) {
      out.push(el("hr"));
      i += 1;
      continue;
    }
    if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && QUOTE.test(lines[i])) body.push(lines[i++].replace(QUOTE, ""));
      out.push(el("blockquote", {}, blocks(body, depth + 1)));
      continue;
    }
    if (ITEM.test(line)) {
      const [list, next] = listAt(lines, i, depth);
      out.push(list);
      i = next;
      continue;
    }
    if (tableAt(line, lines[i + 1])) {
      const rows = [line];
      i += 2;
      while (i < lines.length && lines[i].includes("|") && lines[i].trim() !== "") rows.push(lines[i++]);
      out.push(table(rows));
      continue;
    }
    const para = [line];
    i += 1;
    while (i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i], lines[i + 1])) {
      para.push(lines[i++]);
    }
    const p = el("p");
    para.forEach((l, n) => {
      if (n) p.append(el("br"));
      p.append(...inline(l));
    });
    out.push(p);
  }
  return out;
}

// A list and the index of the line after it; lines indented past the marker belong to the item
// (a nested list among them becomes a nested list).
function listAt(lines, start, depth) {
  const first = ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const list = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) list.setAttribute("start", String(parseInt(first[2], 10)));
  let i = start;
  while (i < lines.length) {
    const m = ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const body = [m[3]];
    const column = lines[i].length - m[3].length; // where the item's text starts
    i += 1;
    while (i < lines.length) {
      const l = lines[i];
      const nested = ITEM.exec(l);
      if (l.trim() === "") {
        const after = lines[i + 1];
        if (after !== undefined && leading(after) > indent) {
          body.push("");
          i += 1;
          continue;
        }
        break;
      }
      if (nested && nested[1].length <= indent) break;
      if (!nested && leading(l) <= indent && startsBlock(l, lines[i + 1])) break;
      body.push(l.slice(Math.min(leading(l), column)));
      i += 1;
    }
    const content = blocks(body, depth + 1);
    // A single paragraph item shows its text without the paragraph's margins.
    if (content.length === 1 && content[0].tagName === "P") list.append(el("li", {}, [...content[0].childNodes]));
    else list.append(el("li", {}, content));
  }
  return [list, i];
}

function leading(line) {
  return line.length - line.trimStart().length;
}

function cells(row) {
  return row.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

function table(rows) {
  const [head, ...body] = rows.map(cells);
  return el(
    "div",
    { class: "table" },
    el(
      "table",
      {},
      el("thead", {}, el("tr", {}, head.map((c) => el("th", { scope: "col" }, inline(c))))),
      el("tbody", {}, body.map((r) => el("tr", {}, r.map((c) => el("td", {}, inline(c)))))),
    ),
  );
}

function codeBlock(code, lang) {
  const copy = el("button", { type: "button", class: "copy", text: "Copy", "aria-label": "Copy code" });
  copy.addEventListener("click", () => copyText(code, copy));
  return el(
    "div",
    { class: "code" },
    el("div", { class: "code-head" }, el("span", { text: lang || "code" }), copy),
    el("pre", {}, el("code", { "data-lang": lang || null, text: code })),
  );
}

const INLINE = [
  ["code", /`([^`\n]+)`/],
  ["link", /(!?)\[([^\]\n]*)\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"\n]*")?\s*\)/],
  ["autolink", /<((?:https?:\/\/|mailto:)[^\s>]+)>/],
  ["strong", /\*\*(?=\S)([^\n]*?\S)\*\*|__(?=\S)([^\n]*?\S)__/],
  ["del", /~~(?=\S)([^\n]*?\S)~~/],
  ["em", /\*(?=[^\s*])([^*\n]*?[^\s*])\*|(?<![\w])_(?=\S)([^_\n]*?\S)_(?![\w])/],
];

// Inline markup of one line, as nodes.
export function inline(text) {
  const out = [];
  let rest = text;
  const absent = new Set(); // patterns that found nothing stay absent from the rest
  while (rest) {
    let best = null;
    for (const [kind, re] of INLINE) {
      if (absent.has(kind)) continue;
      const m = re.exec(rest);
      if (!m) absent.add(kind);
      if (m && (best === null || m.index < best.m.index)) best = { kind, m };
    }
    if (best === null) {
      out.push(document.createTextNode(rest));
      break;
    }
    const { kind, m } = best;
    if (m.index) out.push(document.createTextNode(rest.slice(0, m.index)));
    out.push(inlineNode(kind, m));
    rest = rest.slice(m.index + m[0].length);
  }
  return out;
}

function inlineNode(kind, m) {
  switch (kind) {
    case "code":
      return el("code", { text: m[1] });
    case "link": {
      const label = m[1] ? `image: ${m[2] || m[3]}` : m[2];
      return link(m[3], label ? inline(label) : [m[3]]);
    }
    case "autolink":
      return link(m[1], [m[1]]);
    case "strong":
      return el("strong", {}, inline(m[1] ?? m[2]));
    case "del":
      return el("del", {}, inline(m[1]));
    default:
      return el("em", {}, inline(m[1] ?? m[2]));
  }
}

export function safeUrl(href) {
  try {
    const url = new URL(href, document.baseURI);
    return ["http:", "https:", "mailto:"].includes(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

function link(href, label) {
  const url = safeUrl(href);
  if (url === null) return el("span", {}, label);
  return el("a", { href: url, rel: "noopener noreferrer nofollow", target: "_blank" }, label);
}
