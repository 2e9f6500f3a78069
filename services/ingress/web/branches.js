// Branches (DESIGN §10): a fork shares its parent's messages through its fork point. Where
// branches part, a switcher lists the original and its branches; moving between them keeps
// the last shared message where it was on screen.

import { api } from './api.js';
import { $, h, toast } from './dom.js';
import { markCurrentRow, updateListRow } from './session-list.js';
import { state } from './state.js';
import { autosize, runTurn, whenFree } from './turn.js';

/** The points where the open session parts from others: its own fork point (its parent and
 * the parent's branches) and those its branches start from. */
function branchPoints() {
  const c = state.current;
  if (!c?.session) return [];
  const points = [];
  const from = c.session.forked_from;
  if (from && c.parent !== undefined) {
    points.push({ seq: from.through_seq, original: c.parent && { id: from.session_id, ...c.parent }, mine: false });
  }
  for (const seq of new Set(c.forks.map((f) => f.through_seq))) {
    points.push({ seq, original: { id: c.id, session: c.session, forks: c.forks }, mine: true });
  }
  return points;
}

/** The switcher at a point: the original and its branches (on the original, those that part
 * at this point), the open session marked. */
function branchNav({ seq, original, mine }) {
  const here = state.current.id;
  const link = (id, text, through, title) =>
    h('a', {
      href: `#/s/${id}`,
      class: 'branch',
      text,
      title,
      'aria-current': id === here ? 'page' : null,
      onclick: (e) => {
        if (e.button || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return; // a new tab
        e.preventDefault();
        if (id !== here) openBranch(id, Math.min(seq, through));
      },
    });
  let label = `Branched after #${seq} from a session that is no longer available`;
  const links = [];
  if (original) {
    const forks = mine ? original.forks.filter((f) => f.through_seq === seq) : original.forks;
    label = mine ? `Branches after #${seq}:` : `Branched after #${seq}:`;
    const name = original.session.title || 'Untitled';
    links.push(link(original.id, 'Original', seq, `${name}, at #${seq}`));
    for (const f of forks) {
      const n = original.forks.indexOf(f) + 1;
      let text = f.title && f.title !== original.session.title ? f.title : `Branch ${n}`;
      if (f.through_seq !== seq) text += ` (after #${f.through_seq})`;
      links.push(link(f.id, text, f.through_seq, `Branch ${n}, after #${f.through_seq}`));
    }
  }
  return h(
    'nav',
    { class: 'branches', 'aria-label': `Branches after #${seq}`, dataset: { through: seq } },
    h('span', { class: 'branches-label', text: label }),
    links.length ? h('ul', {}, links.map((a) => h('li', {}, a))) : null,
  );
}

/** Puts each switcher after the item at its point (at the top when the point comes before
 * every item); one whose point is not loaded yet waits for its page. */
export function placeBranchNavs() {
  const transcript = $('#transcript');
  for (const nav of transcript.querySelectorAll(':scope > .branches')) nav.remove();
  for (const point of branchPoints()) {
    const nav = branchNav(point);
    const item = itemNodeAt(point.seq);
    if (item) item.after(nav);
    else if (!state.current.earlier) $('#earlier').after(nav);
  }
}

/** The stored item shown for `seq`: the newest one at or before it. */
function itemNodeAt(seq) {
  const nodes = [...$('#transcript').querySelectorAll(':scope > [data-seq]')];
  return nodes.findLast((n) => Number(n.dataset.seq) > 0 && Number(n.dataset.seq) <= seq) ?? null;
}

/** Opens another branch with the message at `seq`, which both share, where it is now. */
function openBranch(id, seq) {
  const node = itemNodeAt(seq);
  const top = node && node.getBoundingClientRect().top - $('#transcript').getBoundingClientRect().top;
  state.anchor = node ? { id, seq, top } : null;
  location.hash = `#/s/${id}`;
}

/** Scrolls the message at `seq` to `top` pixels below the transcript's top, with room added
 * after the last item when the transcript ends too soon for that. */
export function keepOnScreen({ seq, top }) {
  const transcript = $('#transcript');
  const node = itemNodeAt(seq);
  if (!node) return;
  const off = () => node.getBoundingClientRect().top - transcript.getBoundingClientRect().top - top;
  transcript.scrollTop += off();
  let room = null;
  for (let tries = 0; off() > 1 && tries < 3; tries++) {
    room ??= transcript.appendChild(h('div', { class: 'anchor-room', 'aria-hidden': 'true' }));
    room.style.height = `${room.offsetHeight + off()}px`;
    transcript.scrollTop += off();
  }
}

/** "Branch from here": a fork through an answer, opened. */
export async function branchFrom(item) {
  const id = state.current?.id;
  if (!id || state.turn) return;
  let fork;
  try {
    fork = await api(`/v1/sessions/${id}/fork`, { method: 'POST', body: { through_seq: item.seq } });
  } catch (e) {
    toast(`Could not branch: ${e.message}`);
    return;
  }
  updateListRow(fork, { toTop: true });
  if (state.current?.id === id) openBranch(fork.id, item.seq);
}

/** Opens a sent message for editing in place; sending it runs it in a new branch. */
export function editMessage(item, node) {
  if (state.turn || node.classList.contains('editing')) return;
  const bubble = node.querySelector('.bubble');
  const input = h('textarea', { rows: 1, 'aria-label': `Edit message #${item.seq}` });
  input.value = item.text ?? '';
  const close = () => {
    form.replaceWith(bubble);
    node.classList.remove('editing');
  };
  const submit = (e) => {
    e?.preventDefault();
    if (input.value.trim()) sendEdit(item, input.value);
  };
  const form = h(
    'form',
    { class: 'edit', onsubmit: submit },
    input,
    h(
      'div',
      { class: 'actions' },
      h('button', { type: 'button', class: 'quiet', text: 'Cancel', onclick: close }),
      h('button', { type: 'submit', class: 'primary', text: 'Send as a new branch' }),
    ),
  );
  input.addEventListener('input', () => autosize(input));
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) submit(e);
    else if (e.key === 'Escape') close();
  });
  bubble.replaceWith(form);
  node.classList.add('editing');
  autosize(input);
  input.focus();
}

/** The edited message goes with the attachments it had. */
function sendEdit(item, text) {
  const id = state.current.id;
  const files = { images: item.images ?? [], documents: item.documents ?? [] };
  const body = { text, edit_of: item.seq, ...attachmentIds(files) };
  branchTurn(item.seq - 1, text, (signal) => api(`/v1/sessions/${id}/messages`, { method: 'POST', body, raw: true, signal }), files);
}

/** A message's attachments as a request names them: the ids of its files, none when empty. */
export function attachmentIds({ images, documents }) {
  return {
    ...(images.length && { images: images.map((i) => i.id) }),
    ...(documents.length && { documents: documents.map((d) => d.id) }),
  };
}

export function regenerate(item) {
  const id = state.current.id;
  const question = state.current.items.findLast((i) => i.kind === 'user' && i.seq < item.seq);
  branchTurn(question?.seq ?? item.seq - 1, null, (signal) =>
    api(`/v1/sessions/${id}/retry`, { method: 'POST', body: { of: item.seq }, raw: true, signal }),
  );
}

/** Runs a turn the server starts in a new branch through `through` (an edit, a
 * regenerate): the view keeps what the branch inherits and follows it once the stream's
 * `meta` names it (see followBranch). */
function branchTurn(through, text, request, files = null) {
  const c = state.current;
  if (!c?.session || state.turn || state.pendingText !== null) return;
  // Until the branch is named, no switcher: the open session's are not the branch's.
  state.current = { ...c, items: c.items.filter((i) => i.seq <= through), forks: [], parent: undefined };
  state.pendingText = text;
  state.pendingFiles = files;
  runTurn(c.id, (signal, turn) => whenFree(turn, request), { through });
}

/** The stream of an edit or a regenerate named its branch: the open view becomes it. */
export function followBranch(turn, id) {
  const from = turn.sessionId;
  turn.sessionId = id;
  const c = state.current;
  if (c?.id !== from) return;
  c.id = id;
  c.session = { ...c.session, id, forked_from: { session_id: from, through_seq: turn.through } };
  location.hash = `#/s/${id}`; // the route finds it open already
  markCurrentRow();
}
