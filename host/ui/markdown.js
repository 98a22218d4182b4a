// A small Markdown renderer for model replies: fenced code (highlighted, with a copy
// button), inline code, headings, emphasis, lists, quotes, rules, links and tables' text.
// Everything is escaped first: a reply is untrusted text, and only the tags made here reach
// the page. Images are shown as links (the page loads nothing from elsewhere).

const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export const escape = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);

const KEYWORDS = new Set(
  ("as async await break case catch class const continue def default del do elif else enum export extends false " +
    "finally fn for from func function go if impl import in interface is lambda let loop match mod mut new nil " +
    "none None not null of or pass pub raise return self Self static struct super switch this throw trait true " +
    "True try type typeof use var void where while with yield int float str bool char double long unsigned " +
    "void package public private protected final").split(" "),
);

// Highlights code by token class: comments, strings, numbers, keywords.
export function highlight(code) {
  const re =
    /(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/|--[^\n]*)|("(?:\\.|[^"\\])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|(\b\d[\d_]*(?:\.\d+)?(?:e[+-]?\d+)?\b)|([A-Za-z_][A-Za-z0-9_]*)/g;
  let out = "";
  let last = 0;
  for (const m of code.matchAll(re)) {
    out += escape(code.slice(last, m.index));
    last = m.index + m[0].length;
    if (m[1]) out += `<span class="tok-comment">${escape(m[1])}</span>`;
    else if (m[2]) out += `<span class="tok-string">${escape(m[2])}</span>`;
    else if (m[3]) out += `<span class="tok-number">${escape(m[3])}</span>`;
    else if (KEYWORDS.has(m[4])) out += `<span class="tok-keyword">${m[4]}</span>`;
    else out += escape(m[4]);
  }
  return out + escape(code.slice(last));
}

function safeUrl(url) {
  const u = url.trim();
  return /^(https?:|mailto:)/i.test(u) ? u : null;
}

// Inline spans of one line of (unescaped) text.
function inline(text) {
  const parts = [];
  // Code spans first: nothing inside them is Markdown.
  const re = /(`+)([\s\S]*?[^`])\1(?!`)/g;
  let last = 0;
  for (const m of text.matchAll(re)) {
    parts.push(spans(text.slice(last, m.index)));
    parts.push(`<code>${escape(m[2].trim())}</code>`);
    last = m.index + m[0].length;
  }
  parts.push(spans(text.slice(last)));
  return parts.join("");
}

function spans(text) {
  let s = escape(text);
  s = s.replace(/!?\[([^\]]*)\]\(([^)\s]+)(?:\s+&quot;[^&]*&quot;)?\)/g, (all, label, url) => {
    const href = safeUrl(url.replace(/&amp;/g, "&"));
    return href ? `<a href="${escape(href)}" rel="noopener noreferrer" target="_blank">${label || escape(href)}</a>` : all;
  });
  s = s.replace(/\*\*([^*]+)\*\*|__([^_]+)__/g, (_, a, b) => `<strong>${a || b}</strong>`);
  s = s.replace(/(^|[^*\w])\*([^*\s][^*]*?)\*(?!\w)/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^_\w])_([^_\s][^_]*?)_(?!\w)/g, "$1<em>$2</em>");
  s = s.replace(/~~([^~]+)~~/g, "<del>$1</del>");
  return s;
}

export function render(markdown) {
  const lines = String(markdown).replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  const para = [];
  const flush = () => {
    if (para.length) out.push(`<p>${para.map(inline).join("<br>")}</p>`);
    para.length = 0;
  };
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```+|~~~+)\s*([\w+#.-]*)/);
    if (fence) {
      flush();
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i++; // the closing fence (or the end of a reply still streaming)
      const lang = fence[2] ? `<span class="lang">${escape(fence[2])}</span>` : "";
      out.push(
        `<div class="code">${lang}<button class="copy" type="button">Copy</button><pre><code>${highlight(body.join("\n"))}</code></pre></div>`,
      );
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      flush();
      const n = heading[1].length;
      out.push(`<h${n}>${inline(heading[2].replace(/\s+#+\s*$/, ""))}</h${n}>`);
      i++;
      continue;
    }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      flush();
      out.push("<hr>");
      i++;
      continue;
    }
    if (/^\s*>/.test(line)) {
      flush();
      const body = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) body.push(lines[i++].replace(/^\s*>\s?/, ""));
      out.push(`<blockquote>${render(body.join("\n"))}</blockquote>`);
      continue;
    }
    const item = line.match(/^(\s*)([-*+]|\d+[.)])\s+(.*)$/);
    if (item) {
      flush();
      const ordered = /\d/.test(item[2]);
      const items = [];
      while (i < lines.length) {
        const m = lines[i].match(/^(\s*)([-*+]|\d+[.)])\s+(.*)$/);
        if (m && /\d/.test(m[2]) === ordered) {
          items.push(m[3]);
          i++;
        } else if (items.length && /^\s{2,}\S/.test(lines[i])) {
          items[items.length - 1] += "\n" + lines[i++].trim();
        } else break;
      }
      const tag = ordered ? "ol" : "ul";
      out.push(`<${tag}>${items.map((t) => `<li>${t.split("\n").map(inline).join("<br>")}</li>`).join("")}</${tag}>`);
      continue;
    }
    if (!line.trim()) {
      flush();
      i++;
      continue;
    }
    para.push(line);
    i++;
  }
  flush();
  return out.join("\n");
}
