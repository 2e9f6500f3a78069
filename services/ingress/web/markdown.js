// A small markdown renderer for model answers. It builds DOM nodes and only ever sets
// text through text nodes, so HTML or script inside a message stays visible text and never
// runs. It covers what models write: headings, paragraphs, lists, quotes, fenced code,
// tables and rules; inline code, emphasis, strikethrough and links (http(s) and mailto).

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?/;
const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])[ \t]+(.*)$/;
const TABLE_DIVIDER = /^ *\|? *:?-+:? *(\| *:?-+:? *)*\|? *$/;

const blank = (l) => l.trim() === '';
const indentOf = (l) => l.length - l.trimStart().length;

function el(tag, ...children) {
  const node = document.createElement(tag);
  node.append(...children);
  return node;
}

/** The rendered `text` as a DocumentFragment. */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  fragment.append(...blocks(String(text ?? '').replace(/\r\n?/g, '\n').split('\n')));
  return fragment;
}

function startsBlock(line, next) {
  return (
    FENCE.test(line) ||
    HEADING.test(line) ||
    RULE.test(line) ||
    QUOTE.test(line) ||
    LIST_ITEM.test(line) ||
    isTableStart(line, next)
  );
}

function isTableStart(line, next) {
  return line.includes('|') && next !== undefined && next.includes('-') && TABLE_DIVIDER.test(next);
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (blank(line)) {
      i++;
      continue;
    }
    let m;
    if ((m = FENCE.exec(line))) {
      const [, fence, lang] = m;
      const body = [];
      const indent = indentOf(line);
      i++;
      // An unclosed fence runs to the end: a streaming answer is often mid-block.
      while (i < lines.length && !isClosingFence(lines[i], fence)) {
        body.push(lines[i].slice(Math.min(indent, indentOf(lines[i]))));
        i++;
      }
      i++;
      const code = el('code', body.join('\n'));
      if (lang) code.dataset.lang = lang;
      out.push(el('pre', code));
    } else if ((m = HEADING.exec(line))) {
      out.push(el(`h${m[1].length}`, ...inline(m[2])));
      i++;
    } else if (RULE.test(line)) {
      out.push(el('hr'));
      i++;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && !blank(lines[i]) && (QUOTE.test(lines[i]) || body.length)) {
        body.push(lines[i].replace(QUOTE, ''));
        i++;
      }
      out.push(el('blockquote', ...blocks(body)));
    } else if (LIST_ITEM.test(line)) {
      const [list, next] = listAt(lines, i);
      out.push(list);
      i = next;
    } else if (isTableStart(line, lines[i + 1])) {
      const [table, next] = tableAt(lines, i);
      out.push(table);
      i = next;
    } else {
      const para = [];
      while (i < lines.length && !blank(lines[i]) && (para.length === 0 || !startsBlock(lines[i], lines[i + 1]))) {
        para.push(lines[i].trim());
        i++;
      }
      const p = el('p');
      para.forEach((l, n) => {
        if (n) p.append(el('br'));
        p.append(...inline(l));
      });
      out.push(p);
    }
  }
  return out;
}

function isClosingFence(line, fence) {
  const t = line.trim();
  return t.length >= fence.length && t[0] === fence[0] && [...t].every((c) => c === fence[0]);
}

/** The list starting at lines[start]; items' own lines are rendered as blocks, so lists nest. */
function listAt(lines, start) {
  const first = LIST_ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const list = el(ordered ? 'ol' : 'ul');
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  let i = start;
  while (i < lines.length) {
    const m = LIST_ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const contentIndent = m[1].length + m[2].length + 1;
    const body = [m[3]];
    i++;
    while (i < lines.length) {
      const l = lines[i];
      if (blank(l)) {
        let j = i + 1;
        while (j < lines.length && blank(lines[j])) j++;
        if (j < lines.length && indentOf(lines[j]) > indent) {
          body.push('');
          i++;
          continue;
        }
        break;
      }
      const sub = LIST_ITEM.exec(l);
      if (indentOf(l) > indent) {
        body.push(l.slice(Math.min(indentOf(l), contentIndent)));
      } else if (sub || startsBlock(l, lines[i + 1])) {
        break;
      } else {
        body.push(l); // a lazy continuation of the item's paragraph
      }
      i++;
    }
    // A blank line between two items of the same list keeps the list going.
    let j = i;
    while (j < lines.length && blank(lines[j])) j++;
    const sibling = j < lines.length && LIST_ITEM.exec(lines[j]);
    if (j > i && sibling && sibling[1].length === indent) i = j;
    list.append(el('li', ...blocks(body)));
  }
  return [list, i];
}

function cells(row) {
  let t = row.trim();
  if (t.startsWith('|')) t = t.slice(1);
  if (t.endsWith('|') && !t.endsWith('\\|')) t = t.slice(0, -1);
  return t.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, '|'));
}

function tableAt(lines, start) {
  const head = cells(lines[start]);
  const align = cells(lines[start + 1]).map((c) =>
    c.startsWith(':') && c.endsWith(':') ? 'center' : c.endsWith(':') ? 'right' : c.startsWith(':') ? 'left' : '',
  );
  const row = (values, tag) =>
    el(
      'tr',
      ...head.map((_, n) => {
        const cell = el(tag, ...inline(values[n] ?? ''));
        if (align[n]) cell.dataset.align = align[n];
        return cell;
      }),
    );
  const body = el('tbody');
  let i = start + 2;
  while (i < lines.length && !blank(lines[i]) && lines[i].includes('|')) {
    body.append(row(cells(lines[i]), 'td'));
    i++;
  }
  const table = el('table', el('thead', row(head, 'th')), body);
  return [el('div', table), i];
}

// Inline spans: the earliest match wins, ties go to the earlier rule (code first, so
// nothing inside backticks is read as markup).
const INLINE = [
  { re: /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/, make: (m) => el('code', m[2].trim() || m[2]) },
  { re: /(?<!\\)\*\*(?=\S)([\s\S]*?\S)\*\*/, make: (m) => el('strong', ...inline(m[1])) },
  { re: /(?<![\w])__(?=\S)([\s\S]*?\S)__(?![\w])/, make: (m) => el('strong', ...inline(m[1])) },
  { re: /~~(?=\S)([\s\S]*?\S)~~/, make: (m) => el('del', ...inline(m[1])) },
  { re: /!?\[([^\]\n]*)\]\(\s*<?([^\s()<>]*(?:\([^\s()<>]*\)[^\s()<>]*)*)>?(?:\s+"[^"]*")?\s*\)/, make: link },
  { re: /(?<![\w*\\])\*(?=[^\s*])([^*\n]*?[^\s*\\])\*(?![\w*])/, make: (m) => el('em', ...inline(m[1])) },
  { re: /(?<![\w_\\])_(?=[^\s_])([^_\n]*?[^\s_\\])_(?![\w_])/, make: (m) => el('em', ...inline(m[1])) },
  { re: /\bhttps?:\/\/[^\s<>"]*[^\s<>".,;:!?'")\]]/, make: (m) => safeLink(m[0], m[0]) },
];

function link(m) {
  // An image is shown as its link: the app loads nothing from elsewhere.
  return safeLink(m[2], m[1] || m[2]);
}

/** A link for http(s) and mailto targets; any other target (javascript:, data:) is text. */
function safeLink(href, label) {
  let url;
  try {
    url = new URL(href);
  } catch {
    return document.createTextNode(label);
  }
  if (!['http:', 'https:', 'mailto:'].includes(url.protocol)) return document.createTextNode(label);
  const a = el('a', ...(label === href ? [label] : inline(label)));
  a.href = url.href;
  a.target = '_blank';
  a.rel = 'noopener noreferrer nofollow';
  return a;
}

/** Inline markup of one line (or span) as nodes. */
export function inline(text) {
  const out = [];
  let rest = text;
  while (rest) {
    let best = null;
    for (const rule of INLINE) {
      const m = rule.re.exec(rest);
      if (m && (!best || m.index < best.m.index)) best = { m, rule };
    }
    if (!best) {
      out.push(document.createTextNode(unescape(rest)));
      break;
    }
    if (best.m.index) out.push(document.createTextNode(unescape(rest.slice(0, best.m.index))));
    out.push(best.rule.make(best.m));
    rest = rest.slice(best.m.index + best.m[0].length);
  }
  return out;
}

/** Backslash escapes of markdown punctuation: `\*` is a literal star. */
function unescape(s) {
  return s.replace(/\\([\\`*_{}[\]()#+\-.!|~>])/g, '$1');
}
