// turnlog's web client: the session list, search (hits with their matched words, opening
// the session at the message found), a transcript of every item kind (a page at a time,
// older ones as it scrolls up), a composer that streams turns (and picks a running turn up
// again after a reload) and takes attachments (attachments.js), branches (DESIGN §10:
// branch, edit, regenerate, and a switcher where branches part), and a context inspector
// (the next request, or what an answer was sent, §11), export of a session as a file and
// import of other apps' exports. Plain DOM, no framework; text from messages reaches the
// page only as text.

import { api, ApiError, download, sendForm, setupTokenDialog } from './api.js';
import { restoreTray, setupAttachments, takeTray, trayContents } from './attachments.js';
import { $, ask, fmt, h, marked, sleep, time, toast } from './dom.js';
import { renderMarkdown } from './markdown.js';
import { readEvents } from './sse.js';
import { liveView, renderItem } from './transcript.js';

const PAGE_SIZE = 30;
const HITS_PAGE = 20;
// Transcript items per request; older ones load as the transcript scrolls up.
const TRANSCRIPT_PAGE = 50;
// The turn being streamed, kept per tab so a reload continues after its last event.
const SNAPSHOT_KEY = 'turnlog.turn';
const SNAPSHOT_MAX_AGE_MS = 120_000;
const SNAPSHOT_EVERY_MS = 250;
const RECONNECTS = 3;
const TITLE_CHARS = 60;
// A session's turn lease outlives its turn when the holder died (it expires by itself in
// about 10 s), so a send refused while nothing streams is tried again for this long.
const BUSY_WAIT_MS = 15_000;

// ---------------------------------------------------------------------------------------
// State.

const state = {
  /** The open session: {id, session, items, earlier, forks, parent}; null for a new chat.
   * `items` are the pages loaded so far; `earlier` is the cursor of the older ones (null:
   * none left); `forks` are its branches; `parent`, for a branch, is `{session, forks}` of
   * the session it branched from (null when that is gone, undefined when not loaded). */
  current: null,
  /** Where the next session opened keeps a message on screen: {id, seq, top}; without
   * `top`, a search hit's message, shown and highlighted. */
  anchor: null,
  /** Older items are on their way. */
  loadingEarlier: false,
  /** The turn being streamed in the open session, if any. */
  turn: null,
  /** The message just sent, shown until the transcript has it, and its attachments
   * (`{images, documents}` as the transcript has them). */
  pendingText: null,
  pendingFiles: null,
  opening: 0,
  inspectorOpen: false,
  /** The attempt whose request the inspector shows, `{sessionId, item}`; null: the next
   * request. */
  inspecting: null,
};

const list = { sessions: [], next: null, done: false, loading: false, gen: 0, archived: false };
/** The search shown instead of the list while the search box holds words. */
const search = { q: '', next: null, gen: 0 };

function showPane(pane) {
  document.body.dataset.pane = pane;
}

/** The session actions' menu (a phone folds them under ⋯). */
function showMenu(open) {
  $('#chat-header').classList.toggle('menu-open', open);
  $('#more').setAttribute('aria-expanded', String(open));
}

// ---------------------------------------------------------------------------------------
// The session list: newest first, a page at a time as the list scrolls.

function reloadList() {
  list.gen++;
  list.sessions = [];
  list.next = null;
  list.done = false;
  list.loading = false;
  $('#session-list').replaceChildren();
  $('#list-status').textContent = '';
  return loadMore();
}

async function loadMore() {
  if (list.loading || list.done) return;
  const gen = list.gen;
  list.loading = true;
  $('#list-status').textContent = 'Loading…';
  $('#load-more').hidden = true;
  const params = new URLSearchParams({ limit: String(PAGE_SIZE) });
  if (list.archived) params.set('archived', 'true');
  if (list.next) {
    params.set('before', list.next.before);
    params.set('before_id', list.next.before_id);
  }
  let page;
  try {
    page = await api(`/v1/sessions?${params}`);
  } catch (e) {
    if (gen === list.gen) {
      list.loading = false;
      $('#list-status').textContent = `Could not load sessions: ${e.message}`;
      $('#load-more').hidden = false;
    }
    return;
  }
  if (gen !== list.gen) return; // the view changed while this page was on its way
  list.loading = false;
  const known = new Set(list.sessions.map((s) => s.id));
  const fresh = page.sessions.filter((s) => !known.has(s.id));
  list.sessions.push(...fresh);
  $('#session-list').append(...fresh.map(sessionRow));
  list.next = page.next;
  list.done = !page.next;
  $('#load-more').hidden = list.done;
  showListStatus();
  $('#session-list').dataset.complete = String(list.done);
  maybeLoadMore();
}

function showListStatus() {
  const n = list.sessions.length;
  let text = '';
  if (!n && list.done) text = list.archived ? 'No archived sessions.' : 'No sessions yet.';
  else if (list.done && n > PAGE_SIZE) text = `All ${fmt(n)} sessions shown.`;
  $('#list-status').textContent = text;
}

/** Loads the next page when the end of the list is in view (also when a page did not fill it). */
function maybeLoadMore() {
  if (search.q) return; // the list is hidden behind the search's hits
  const scroller = $('#session-scroll');
  if (scroller.scrollTop + scroller.clientHeight >= scroller.scrollHeight - 200) loadMore();
}

function sessionRow(s) {
  const current = s.id === state.current?.id;
  return h(
    'li',
    { class: 'session', dataset: { id: s.id } },
    h(
      'a',
      { href: `#/s/${s.id}`, 'aria-current': current ? 'page' : null },
      h('span', { class: 'title', text: s.title || 'Untitled' }),
      h(
        'span',
        { class: 'sub' },
        // When it was last active: for an imported session, in the app it came from.
        time(s.active_at ?? s.updated_at),
        s.archived ? h('span', { class: 'badge', text: 'archived' }) : null,
        s.forked_from ? h('span', { class: 'badge', text: 'branch' }) : null,
        s.last_category ? h('span', { class: 'badge', text: s.last_category }) : null,
      ),
    ),
  );
}

/** Shows a changed session in the list: in place, at the top after a turn, or not at all
 * when it no longer belongs to the view. */
function updateListRow(session, { toTop = false } = {}) {
  const ul = $('#session-list');
  const old = ul.querySelector(`li[data-id="${session.id}"]`);
  const belongs = session.archived === list.archived;
  list.sessions = list.sessions.filter((s) => s.id !== session.id);
  if (!belongs) {
    old?.remove();
    return;
  }
  const row = sessionRow(session);
  if (toTop || !old) {
    old?.remove();
    ul.prepend(row);
    list.sessions.unshift(session);
  } else {
    old.replaceWith(row);
    list.sessions.push(session);
  }
  showListStatus();
}

function markCurrentRow() {
  for (const a of document.querySelectorAll('#session-list a')) {
    const current = a.parentElement.dataset.id === state.current?.id;
    if (current) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
}

function setupList() {
  let debounce = 0;
  $('#search').addEventListener('input', (e) => {
    clearTimeout(debounce);
    debounce = setTimeout(() => startSearch(e.target.value.trim()), 250);
  });
  $('#more-hits').addEventListener('click', loadHits);
  for (const tab of document.querySelectorAll('[data-archived]')) {
    tab.addEventListener('click', () => {
      list.archived = tab.dataset.archived === 'true';
      for (const t of document.querySelectorAll('[data-archived]')) {
        t.setAttribute('aria-pressed', String(t === tab));
      }
      reloadList();
    });
  }
  $('#session-scroll').addEventListener('scroll', maybeLoadMore, { passive: true });
  $('#load-more').addEventListener('click', loadMore);
  window.addEventListener('resize', maybeLoadMore);
}

// ---------------------------------------------------------------------------------------
// Search (DESIGN §2): the owner's messages, answers and titles, best first, a page at a
// time. The index trails the log by about a second.

const HIT_KINDS = { user: 'your message', assistant: 'answer', title: 'title' };

/** Shows the hits for `q` in place of the session list; blank shows the list again. */
function startSearch(q) {
  search.gen++;
  search.q = q;
  search.next = null;
  document.body.classList.toggle('searching', !!q);
  $('#session-scroll').scrollTop = 0;
  $('#hit-list').replaceChildren();
  $('#more-hits').hidden = true;
  $('#search-status').textContent = '';
  if (q) loadHits();
  else maybeLoadMore();
}

async function loadHits() {
  const gen = search.gen;
  const params = new URLSearchParams({ q: search.q, limit: String(HITS_PAGE) });
  if (search.next) params.set('cursor', search.next);
  $('#more-hits').hidden = true;
  $('#search-status').textContent = 'Searching…';
  let page;
  try {
    page = await api(`/v1/search?${params}`);
  } catch (e) {
    if (gen !== search.gen) return;
    $('#search-status').textContent = `Could not search: ${e.message}`;
    $('#more-hits').hidden = !search.next;
    return;
  }
  if (gen !== search.gen) return; // the words changed while this page was on its way
  $('#hit-list').append(...page.hits.map(hitRow));
  search.next = page.next;
  $('#more-hits').hidden = !page.next;
  $('#search-status').textContent = $('#hit-list').childElementCount ? '' : 'Nothing matches.';
}

/** A hit: its session, what matched and when, and the matched words marked. A title hit
 * shows the title marked. */
function hitRow(hit) {
  const title = hit.kind === 'title' ? marked(hit.snippet) : hit.session_title || 'Untitled';
  return h(
    'li',
    { class: 'hit', dataset: { kind: hit.kind, session: hit.session_id, ...(hit.seq !== null && { seq: hit.seq }) } },
    h(
      'a',
      { href: `#/s/${hit.session_id}`, onclick: (e) => openHit(e, hit) },
      h('span', { class: 'title' }, title),
      h('span', { class: 'sub' }, h('span', { class: 'badge', text: HIT_KINDS[hit.kind] ?? hit.kind }), time(hit.created_at)),
      hit.kind === 'title' ? null : h('span', { class: 'snippet' }, marked(hit.snippet)),
    ),
  );
}

/** Opens a hit's session, at its message (loaded and highlighted) unless it is a title. */
function openHit(e, hit) {
  if (e.button || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return; // a new tab
  e.preventDefault();
  const id = hit.session_id;
  state.anchor = hit.seq === null ? null : { id, seq: hit.seq };
  if (location.hash !== `#/s/${id}`) {
    location.hash = `#/s/${id}`; // the route opens it at the anchor
    return;
  }
  showPane('chat');
  const anchor = state.anchor;
  if (!anchor) return;
  if (state.current?.id === id && reveal(anchor.seq)) state.anchor = null;
  else openSession(id); // its message is not loaded yet
}

/** Scrolls the message at `seq` to the transcript's middle and highlights it briefly (the
 * class's animation fades); false when it is not shown. */
function reveal(seq) {
  const node = $(`#transcript > [data-seq="${seq}"]`);
  if (!node) return false;
  node.scrollIntoView({ block: 'center' });
  node.classList.remove('found');
  void node.offsetWidth; // starts the fade again on a message highlighted already
  node.classList.add('found');
  node.addEventListener('animationend', function fade(e) {
    if (e.target !== node) return;
    node.classList.remove('found');
    node.removeEventListener('animationend', fade);
  });
  // Keyboard and screen reader users continue from the message found.
  node.tabIndex = -1;
  node.focus({ preventScroll: true });
  return true;
}

// ---------------------------------------------------------------------------------------
// Opening a session and drawing its transcript.

function route() {
  const match = /^#\/s\/([0-9a-f-]{36})$/i.exec(location.hash);
  if (match) {
    showPane('chat');
    if (state.current?.id !== match[1]) openSession(match[1]);
    return;
  }
  showPane(location.hash === '#/new' ? 'chat' : 'list');
  newChat();
}

function newChat() {
  leaveTurn();
  state.opening++;
  state.current = null;
  document.title = 'turnlog';
  renderHeader();
  renderTranscript();
  markCurrentRow();
  state.inspecting = null;
  if (state.inspectorOpen) loadInspector();
}

async function openSession(id) {
  leaveTurn();
  state.inspecting = null; // a request of the session left
  const opening = ++state.opening;
  const anchor = state.anchor?.id === id ? state.anchor : null;
  state.anchor = null;
  state.current = { id, session: null, items: [], earlier: null, forks: [] };
  markCurrentRow();
  renderHeader();
  $('#transcript').replaceChildren(h('p', { class: 'hint', text: 'Loading…' }));
  let detail;
  try {
    detail = await loadDetail(id, anchor?.seq);
  } catch (e) {
    if (opening !== state.opening) return;
    if (e.status === 404) {
      toast('That session does not exist (any more).');
      location.hash = '#/';
    } else {
      $('#transcript').replaceChildren(h('p', { class: 'hint', text: `Could not load the session: ${e.message}` }));
    }
    return;
  }
  if (opening !== state.opening) return;
  showDetail(detail);
  if (detail.turn_active) attach(id, snapshotFor(id, detail.items));
  else clearSnapshot();
  // After attach, whose live answer redraws the transcript.
  if (anchor?.top !== undefined) keepOnScreen(anchor);
  else if (anchor) reveal(anchor.seq);
  if (state.inspectorOpen) loadInspector();
}

/** A session's newest page, older ones too down to the item at `through` when given, and
 * for a branch its parent's title and branches (`parent`; null when it cannot be read). */
async function loadDetail(id, through) {
  const detail = await api(`/v1/sessions/${id}?limit=${TRANSCRIPT_PAGE}`);
  while (through !== undefined && detail.earlier && (detail.items[0]?.seq ?? Infinity) > through) {
    // Seqs of items are distinct, so this many reach `through` in one request.
    const limit = Math.min(1000, Math.max(TRANSCRIPT_PAGE, (detail.items[0]?.seq ?? 0) - through));
    const page = await api(`/v1/sessions/${id}?limit=${limit}&before=${detail.earlier.before}`);
    detail.items = [...page.items, ...detail.items];
    detail.earlier = page.earlier ?? null;
  }
  const from = detail.session.forked_from;
  if (from) {
    try {
      const { session, forks } = await api(`/v1/sessions/${from.session_id}?limit=1`);
      detail.parent = { session, forks };
    } catch {
      detail.parent = null; // deleted (its inherited part stays, hidden), or not readable now
    }
  }
  return detail;
}

/** Shows the newest page of a session; older pages already loaded stay above it. */
function showDetail(detail) {
  const previous = state.current?.id === detail.session.id ? state.current : null;
  let items = detail.items;
  let earlier = detail.earlier ?? null;
  const first = items[0]?.seq;
  if (previous && earlier && first !== undefined) {
    const older = previous.items.filter((i) => i.seq < first);
    if (older.length) {
      items = [...older, ...items];
      earlier = previous.earlier;
    }
  }
  state.current = {
    id: detail.session.id,
    session: detail.session,
    items,
    earlier,
    forks: detail.forks ?? [],
    parent: detail.parent,
  };
  document.title = `${detail.session.title || 'Untitled'} · turnlog`;
  renderHeader();
  renderTranscript();
}

/** Loads the page of items before the oldest one shown, keeping the view where it is. */
async function loadEarlier() {
  const current = state.current;
  if (!current?.earlier || state.loadingEarlier) return;
  state.loadingEarlier = true;
  showEarlierStatus();
  const opening = state.opening;
  let page;
  try {
    page = await api(`/v1/sessions/${current.id}?limit=${TRANSCRIPT_PAGE}&before=${current.earlier.before}`);
  } catch (e) {
    state.loadingEarlier = false;
    if (state.current === current) showEarlierStatus(`Could not load earlier messages: ${e.message}`);
    return;
  }
  state.loadingEarlier = false;
  if (opening !== state.opening || state.current !== current) return; // another session opened meanwhile
  const first = current.items[0]?.seq ?? Infinity;
  const older = page.items.filter((i) => i.seq < first);
  current.items = [...older, ...current.items];
  current.earlier = page.earlier ?? null;
  const transcript = $('#transcript');
  const fromBottom = transcript.scrollHeight - transcript.scrollTop;
  $('#earlier').after(...older.map((item) => renderItem(item, itemActions)));
  placeBranchNavs();
  transcript.scrollTop = transcript.scrollHeight - fromBottom;
  showEarlierStatus();
  maybeLoadEarlier();
}

/** The marker above the oldest item shown: a button for older items, or nothing. */
function showEarlierStatus(error = '') {
  const marker = $('#earlier');
  if (!marker) return;
  const more = !!state.current?.earlier;
  marker.hidden = !more && !error;
  marker.dataset.complete = String(!more);
  const button = marker.querySelector('button');
  button.hidden = !more || state.loadingEarlier;
  marker.querySelector('.hint').textContent = error || (state.loadingEarlier ? 'Loading earlier messages…' : '');
}

/** Loads older items when the top of the transcript is in view (also when the items shown
 * do not fill it). */
function maybeLoadEarlier() {
  const transcript = $('#transcript');
  if (state.current?.earlier && transcript.scrollTop < 200) loadEarlier();
}

/** Reads the open session again (after a turn, a permission answer, …). */
async function refreshCurrent({ toTop = false } = {}) {
  const id = state.current?.id;
  if (!id) return;
  const opening = state.opening;
  try {
    const detail = await loadDetail(id);
    if (opening !== state.opening || state.current?.id !== id) return;
    showDetail(detail);
    updateListRow(detail.session, { toTop });
  } catch (e) {
    toast(`Could not reload the session: ${e.message}`);
  }
  // A request once sent never changes; only the next one needs reading again.
  if (state.inspectorOpen && !state.inspecting) loadContext();
}

function renderHeader() {
  const session = state.current?.session;
  $('#chat-title').textContent = state.current ? session?.title || 'Untitled' : 'New chat';
  for (const id of ['#rename', '#export-wrap', '#archive', '#delete', '#more']) $(id).hidden = !session;
  showMenu(false);
  showExportMenu(false);
  $('#archive').textContent = session?.archived ? 'Unarchive' : 'Archive';
  updateComposer();
}

function lastUserSeq(items) {
  return items.findLast((i) => i.kind === 'user')?.seq ?? 0;
}

function lastAnswerSeq() {
  return state.current?.items.findLast((i) => i.kind === 'assistant')?.seq;
}

const itemActions = {
  answerPermission,
  edit: editMessage,
  branch: branchFrom,
  regenerate,
  isLastAnswer: (item) => item.seq === lastAnswerSeq(),
  showRequest: (item) => inspect(item),
};

function renderTranscript() {
  const transcript = $('#transcript');
  const items = state.current?.items ?? [];
  const nodes = items.map((item) => renderItem(item, itemActions));
  // A turn running before this page saw it has checkpoints in the log: the newest shows as
  // an `interrupted` item at the end. The live answer stands in for it once it holds the
  // same text (an earlier attempt's partial stays).
  const last = items.at(-1);
  if (state.turn?.reattached && last?.kind === 'interrupted' && last.seq > lastUserSeq(items)) {
    state.turn.checkpoint = { node: nodes.at(-1), text: last.text ?? '' };
  }
  if (state.pendingText !== null) {
    const pending = renderItem({ kind: 'user', text: state.pendingText, ...state.pendingFiles, seq: 0, created_at: new Date().toISOString() });
    pending.classList.add('pending');
    nodes.push(pending);
  }
  if (state.turn) nodes.push(state.turn.view.node);
  if (!nodes.length && !state.current?.earlier) {
    nodes.push(
      h(
        'div',
        { class: 'empty' },
        h('h2', { text: state.current ? 'Nothing here yet' : 'Start a conversation' }),
        h('p', { text: 'Type below. Enter sends, Shift+Enter adds a line, Esc stops an answer.' }),
      ),
    );
  }
  const earlier = h(
    'div',
    { id: 'earlier', class: 'earlier' },
    h('button', { type: 'button', class: 'quiet', text: 'Load earlier messages', onclick: loadEarlier }),
    h('p', { class: 'hint', 'aria-live': 'polite' }),
  );
  transcript.replaceChildren(earlier, ...nodes);
  placeBranchNavs();
  showEarlierStatus();
  transcript.scrollTop = transcript.scrollHeight;
  updateComposer();
  maybeLoadEarlier();
}

async function answerPermission(item, decision) {
  const { id, tool } = item.permission;
  const current = state.current;
  try {
    await api(`/v1/sessions/${current.id}/permissions/${encodeURIComponent(id)}`, {
      method: 'POST',
      body: { decision },
    });
    // An answered request leaves the transcript, also from an older page kept on screen.
    current.items = current.items.filter((i) => i.kind !== 'permission' || i.permission?.id !== id);
    toast(decision === 'allow' ? `Allowed ${tool}.` : `Denied ${tool}.`, 'info');
  } catch (e) {
    toast(`Could not answer: ${e.message}`);
  }
  refreshCurrent();
}

// ---------------------------------------------------------------------------------------
// Branches (DESIGN §10): a fork shares its parent's messages through its fork point. Where
// branches part, a switcher lists the original and its branches; moving between them keeps
// the last shared message where it was on screen.

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
function placeBranchNavs() {
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
function keepOnScreen({ seq, top }) {
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
async function branchFrom(item) {
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
function editMessage(item, node) {
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
function attachmentIds({ images, documents }) {
  return {
    ...(images.length && { images: images.map((i) => i.id) }),
    ...(documents.length && { documents: documents.map((d) => d.id) }),
  };
}

function regenerate(item) {
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
function followBranch(turn, id) {
  const from = turn.sessionId;
  turn.sessionId = id;
  const c = state.current;
  if (c?.id !== from) return;
  c.id = id;
  c.session = { ...c.session, id, forked_from: { session_id: from, through_seq: turn.through } };
  location.hash = `#/s/${id}`; // the route finds it open already
  markCurrentRow();
}

// ---------------------------------------------------------------------------------------
// Streaming a turn: send, retry, or re-attach to one that runs.

function scheduleRender(turn) {
  if (turn.view.frame) return;
  turn.view.frame = requestAnimationFrame(() => {
    turn.view.frame = 0;
    drawLive(turn);
  });
}

function drawLive(turn) {
  const v = turn.view;
  const transcript = $('#transcript');
  const atBottom = transcript.scrollTop + transcript.clientHeight >= transcript.scrollHeight - 80;
  v.reasoning.hidden = !turn.reasoning;
  v.reasoningText.textContent = turn.reasoning;
  v.md.replaceChildren(renderMarkdown(turn.text));
  if (turn.checkpoint) turn.checkpoint.node.hidden = turn.text.startsWith(turn.checkpoint.text);
  v.errors.replaceChildren(...turn.errors.map((e) => h('p', { class: 'error-line', text: `${e.code}: ${e.message}` })));
  const started = turn.text || turn.reasoning;
  v.status.textContent = turn.stopping
    ? 'Stopping…'
    : started
      ? 'Answering…'
      : turn.waiting
        ? 'Waiting for the previous turn to end…'
        : 'Waiting for the model…';
  if (atBottom) transcript.scrollTop = transcript.scrollHeight;
}

/** Runs one turn's stream in the open session. `open(signal)` makes the first request;
 * later ones re-attach after the last event received. Resolves with the error that kept
 * the turn from starting, if any. */
async function runTurn(sessionId, open, { resume = null, reattached = false, through } = {}) {
  const turn = {
    sessionId,
    reattached,
    through,
    checkpoint: null,
    text: resume?.text ?? '',
    reasoning: resume?.reasoning ?? '',
    lastId: resume?.lastId ?? 0,
    userSeq: resume?.userSeq ?? null,
    errors: [],
    ended: null,
    stopping: false,
    controller: new AbortController(),
    view: liveView(),
  };
  state.turn = turn;
  renderTranscript();
  drawLive(turn);

  let failed = null;
  try {
    await follow(turn, open);
  } catch (e) {
    if (turn.controller.signal.aborted) return null; // the user left; the turn goes on without us
    failed = e;
  }
  if (state.turn !== turn) return failed;
  state.turn = null;
  state.pendingText = null;
  state.pendingFiles = null;
  clearSnapshot();
  updateComposer();
  if (failed) toast(failed instanceof ApiError ? failed.message : `The answer stream was lost: ${failed.message}`);
  await refreshCurrent({ toTop: true });
  return failed;
}

async function follow(turn, open) {
  const { signal } = turn.controller;
  const onEvent = (e) => onTurnEvent(turn, e);
  let res = await open(signal, turn); // an error here (409, 503, …) means no turn started
  for (let failures = 0; ; ) {
    if (res?.status === 204) return; // no turn runs (any more)
    if (res) {
      try {
        await readEvents(res.body, onEvent);
      } catch (e) {
        if (signal.aborted) throw e;
      }
    }
    if (turn.ended) return;
    // The connection dropped before `end`; the turn goes on at the server.
    if (++failures > RECONNECTS) throw new Error('the server stopped answering');
    await sleep(400 * failures);
    try {
      res = await api(`/v1/sessions/${turn.sessionId}/stream`, {
        raw: true,
        signal,
        headers: turn.lastId ? { 'Last-Event-ID': String(turn.lastId) } : {},
      });
    } catch (e) {
      if (signal.aborted) throw e;
      res = null;
    }
  }
}

/** Makes a send or retry request, again while the session's lease is held by a turn that
 * no longer streams (see BUSY_WAIT_MS). A turn that does stream belongs to someone else:
 * its 409 stands. */
async function whenFree(turn, request) {
  const { signal } = turn.controller;
  const until = Date.now() + BUSY_WAIT_MS;
  for (;;) {
    try {
      return await request(signal);
    } catch (e) {
      if (!(e instanceof ApiError && e.status === 409) || Date.now() > until) throw e;
      const running = await api(`/v1/sessions/${turn.sessionId}/stream`, { raw: true, signal });
      if (running.status !== 204) {
        running.body?.cancel();
        throw e;
      }
      const { turn_active: held } = await api(`/v1/sessions/${turn.sessionId}?limit=1`, { signal });
      if (!held) throw e; // a conflict of another kind, such as nothing to retry
      turn.waiting = true;
      scheduleRender(turn);
      await sleep(1000);
    }
  }
}

function onTurnEvent(turn, event) {
  const id = Number(event.id);
  if (Number.isFinite(id) && id > 0) {
    if (id <= turn.lastId) return; // already have it
    turn.lastId = id;
  }
  let data = {};
  try {
    data = JSON.parse(event.data);
  } catch {
    return;
  }
  switch (event.event) {
    case 'meta':
      turn.userSeq = data.user_seq ?? null;
      if (turn.through !== undefined && data.session_id && data.session_id !== turn.sessionId) followBranch(turn, data.session_id);
      break;
    case 'delta':
      turn.text += data.text ?? '';
      break;
    case 'reasoning':
      turn.reasoning += data.text ?? '';
      break;
    case 'error':
      turn.errors.push(data);
      break;
    case 'end':
      turn.ended = data;
      break;
    default:
      return;
  }
  saveSnapshotSoon(turn);
  scheduleRender(turn);
}

/** Stops reading the open session's stream (the turn itself goes on at the server). */
function leaveTurn() {
  state.pendingText = null;
  state.pendingFiles = null;
  const turn = state.turn;
  if (!turn) return;
  state.turn = null;
  turn.controller.abort();
  clearSnapshot();
}

function attach(sessionId, snapshot) {
  const headers = snapshot?.lastId ? { 'Last-Event-ID': String(snapshot.lastId) } : {};
  const open = (signal) => api(`/v1/sessions/${sessionId}/stream`, { raw: true, signal, headers });
  runTurn(sessionId, open, { resume: snapshot, reattached: true });
}

async function send() {
  const input = $('#message');
  const text = input.value;
  if (state.turn || state.pendingText !== null) return;
  const files = trayContents();
  if (!text.trim()) {
    if (files.images.length || files.documents.length || files.pending) toast('Write a message to go with the attachments.');
    return;
  }
  if (files.pending) {
    toast(`Wait for ${files.pending === 1 ? 'the attachment' : `${files.pending} attachments`} to finish uploading.`);
    return;
  }
  const attached = { images: files.images, documents: files.documents };
  const taken = takeTray();
  state.pendingText = text;
  state.pendingFiles = attached;
  input.value = '';
  autosize();
  let id = state.current?.id;
  if (!id) {
    // A new chat: the session is made on its first message, titled after it.
    const title = text.trim().split('\n')[0].slice(0, TITLE_CHARS).trim();
    let session;
    try {
      session = await api('/v1/sessions', { method: 'POST', body: title ? { title } : {} });
    } catch (e) {
      state.pendingText = null;
      state.pendingFiles = null;
      input.value = text;
      restoreTray(taken);
      toast(`Could not create the session: ${e.message}`);
      return;
    }
    id = session.id;
    state.opening++;
    state.current = { id, session, items: [], earlier: null, forks: [] };
    location.hash = `#/s/${id}`;
    updateListRow(session, { toTop: true });
    markCurrentRow();
    document.title = `${session.title || 'Untitled'} · turnlog`;
    renderHeader();
  }
  const body = { text, ...attachmentIds(attached) };
  const failed = await runTurn(id, (signal, turn) =>
    whenFree(turn, () => api(`/v1/sessions/${id}/messages`, { method: 'POST', body, raw: true, signal })),
  );
  // Nothing was sent: give the text and the attachments back to edit.
  if (failed instanceof ApiError) {
    restoreTray(taken);
    if (!input.value) {
      input.value = text;
      autosize();
    }
  }
}

async function stop() {
  const turn = state.turn;
  if (!turn || turn.stopping) return;
  turn.stopping = true;
  scheduleRender(turn);
  try {
    await api(`/v1/sessions/${turn.sessionId}/stop`, { method: 'POST' });
  } catch (e) {
    if (e.status !== 409) toast(`Could not stop: ${e.message}`);
  }
}

function retry() {
  const id = state.current?.id;
  if (!id || state.turn) return;
  runTurn(id, (signal, turn) =>
    whenFree(turn, () => api(`/v1/sessions/${id}/retry`, { method: 'POST', raw: true, signal })),
  );
}

function canRetry() {
  const last = state.current?.items.at(-1);
  return !state.turn && (last?.kind === 'interrupted' || last?.kind === 'error');
}

function updateComposer() {
  const streaming = !!state.turn;
  $('#send').hidden = streaming;
  $('#stop').hidden = !streaming;
  $('#retry').hidden = !canRetry();
  $('#composer').dataset.streaming = String(streaming);
  $('#transcript').dataset.streaming = String(streaming);
}

function autosize(input = $('#message')) {
  input.style.height = 'auto';
  input.style.height = `${input.scrollHeight}px`;
}

// The snapshot: what this tab has of the running turn, saved together with the id of the
// last event it holds, so after a reload the stream resumes right after it.

let snapshotTimer = 0;
let snapshotTurn = null;

function saveSnapshotSoon(turn) {
  snapshotTurn = turn;
  if (turn.ended) {
    clearSnapshot();
    return;
  }
  if (!snapshotTimer) snapshotTimer = setTimeout(saveSnapshotNow, SNAPSHOT_EVERY_MS);
}

function saveSnapshotNow() {
  clearTimeout(snapshotTimer);
  snapshotTimer = 0;
  const t = snapshotTurn;
  if (!t || t.ended || state.turn !== t) return;
  const snapshot = {
    sessionId: t.sessionId,
    userSeq: t.userSeq,
    lastId: t.lastId,
    text: t.text,
    reasoning: t.reasoning,
    savedAt: Date.now(),
  };
  try {
    sessionStorage.setItem(SNAPSHOT_KEY, JSON.stringify(snapshot));
  } catch {
    // Storage full or refused: a reload then replays the turn from its start.
  }
}

function clearSnapshot() {
  clearTimeout(snapshotTimer);
  snapshotTimer = 0;
  snapshotTurn = null;
  sessionStorage.removeItem(SNAPSHOT_KEY);
}

/** The saved snapshot when it belongs to the turn now running in `sessionId`: same session,
 * same question, saved moments ago. Otherwise null, and the turn is replayed from its start. */
function snapshotFor(sessionId, items) {
  let snapshot;
  try {
    snapshot = JSON.parse(sessionStorage.getItem(SNAPSHOT_KEY) ?? 'null');
  } catch {
    return null;
  }
  const fits =
    snapshot?.sessionId === sessionId &&
    Date.now() - snapshot.savedAt < SNAPSHOT_MAX_AGE_MS &&
    snapshot.userSeq === lastUserSeq(items);
  return fits ? snapshot : null;
}

// ---------------------------------------------------------------------------------------
// Rename, archive, delete.

async function rename() {
  const session = state.current?.session;
  if (!session) return;
  const title = (await ask({ title: 'Rename session', value: session.title ?? '', confirm: 'Rename' }))?.trim();
  if (!title || title === session.title) return;
  try {
    const updated = await api(`/v1/sessions/${session.id}`, { method: 'PATCH', body: { title } });
    applySession(updated);
  } catch (e) {
    toast(`Could not rename: ${e.message}`);
  }
}

async function toggleArchive() {
  const session = state.current?.session;
  if (!session) return;
  try {
    const updated = await api(`/v1/sessions/${session.id}`, { method: 'PATCH', body: { archived: !session.archived } });
    applySession(updated);
    toast(updated.archived ? 'Archived. Find it under “Archived”.' : 'Back in the active sessions.', 'info');
  } catch (e) {
    toast(`Could not change the archive: ${e.message}`);
  }
}

async function remove() {
  const session = state.current?.session;
  if (!session) return;
  const sure = await ask({
    title: 'Delete this session?',
    message: `“${session.title || 'Untitled'}” and everything in it is deleted for good.`,
    confirm: 'Delete',
    danger: true,
  });
  if (!sure) return;
  try {
    await api(`/v1/sessions/${session.id}`, { method: 'DELETE' });
  } catch (e) {
    toast(`Could not delete: ${e.message}`);
    return;
  }
  $(`#session-list li[data-id="${session.id}"]`)?.remove();
  list.sessions = list.sessions.filter((s) => s.id !== session.id);
  toast('Session deleted.', 'info');
  location.hash = '#/';
}

function applySession(session) {
  if (state.current?.id === session.id) {
    state.current.session = session;
    document.title = `${session.title || 'Untitled'} · turnlog`;
    renderHeader();
  }
  updateListRow(session);
}

// ---------------------------------------------------------------------------------------
// Export (a menu among the session's actions) and import (the sidebar's button): a session
// down as a file in one of the server's formats, and other apps' exports up as sessions.

const PLURAL = new Intl.PluralRules('en-US');
const count = (n, one, many = `${one}s`) => `${fmt(n)} ${PLURAL.select(n) === 'one' ? one : many}`;

function exportItems() {
  return [...document.querySelectorAll('#export-menu [role=menuitem]')];
}

/** Opens or closes the Export menu; opened, `focus` ('first' or 'last') picks the item to
 * focus, and closed with `focus`, the Export button takes the focus back. */
function showExportMenu(open, focus = null) {
  const menu = $('#export-menu');
  if (menu.hidden === !open) {
    if (!open && focus) $('#export').focus();
    return;
  }
  menu.hidden = !open;
  $('#export').setAttribute('aria-expanded', String(open));
  $('#export-wrap').classList.toggle('open', open);
  if (open) {
    const items = exportItems();
    (focus === 'last' ? items.at(-1) : items[0])?.focus();
  } else if (focus) {
    $('#export').focus();
  }
}

/** Downloads the open session as `format`. */
async function exportAs(format, ext) {
  const session = state.current?.session;
  const button = $('#export');
  if (!session || button.getAttribute('aria-busy') === 'true') return;
  showExportMenu(false, true);
  showMenu(false);
  button.setAttribute('aria-busy', 'true');
  button.textContent = 'Exporting…';
  try {
    const name = await download(`/v1/sessions/${session.id}/export?format=${encodeURIComponent(format)}`, `session-${session.id}.${ext}`);
    toast(`Exported as ${name}.`, 'info');
  } catch (e) {
    toast(`Could not export: ${e.message}`);
  } finally {
    button.removeAttribute('aria-busy');
    button.textContent = 'Export';
  }
}

function setupExport() {
  const button = $('#export');
  const menu = $('#export-menu');
  button.addEventListener('click', (e) => {
    e.stopPropagation(); // on a phone it sits in the ⋯ menu, which a click elsewhere closes
    showExportMenu(menu.hidden, 'first');
  });
  button.addEventListener('keydown', (e) => {
    if (e.key === 'ArrowDown' || e.key === 'ArrowUp') {
      e.preventDefault();
      showExportMenu(true, e.key === 'ArrowUp' ? 'last' : 'first');
    }
  });
  menu.addEventListener('click', (e) => {
    e.stopPropagation();
    const item = e.target.closest('[role=menuitem]');
    if (item) exportAs(item.dataset.format, item.dataset.ext);
  });
  menu.addEventListener('keydown', (e) => {
    const items = exportItems();
    const at = items.indexOf(document.activeElement);
    const moveTo = (i) => items[(i + items.length) % items.length].focus();
    if (e.key === 'ArrowDown') moveTo(at + 1);
    else if (e.key === 'ArrowUp') moveTo(at - 1);
    else if (e.key === 'Home') moveTo(0);
    else if (e.key === 'End') moveTo(items.length - 1);
    else if (e.key === 'Escape') showExportMenu(false, true);
    else if (e.key === 'Tab') showExportMenu(false);
    else return;
    e.preventDefault();
    e.stopPropagation(); // Esc here closes the menu, and stops no answer
  });
  // The focus leaving the menu (a click elsewhere, the window left) closes it.
  $('#export-wrap').addEventListener('focusout', (e) => {
    if (!menu.hidden && !$('#export-wrap').contains(e.relatedTarget)) showExportMenu(false);
  });
  document.addEventListener('click', (e) => {
    if (!e.target.closest('#export-wrap')) showExportMenu(false);
  });
}

/** Whether an import is on its way (one at a time). */
let importing = false;

/** Sends `file` to POST /v1/import (its format found by the server) and shows what came
 * of it: counts, the conversations that failed and the parts skipped; then the list again. */
async function importFile(file) {
  if (importing) return;
  importing = true;
  const button = $('#import');
  button.disabled = true;
  button.setAttribute('aria-busy', 'true');
  button.textContent = 'Importing…';
  showImportResult('working', `Uploading ${file.name}…`);
  const form = new FormData();
  form.append('file', file, file.name);
  let summary;
  try {
    summary = await sendForm('/v1/import', form, {
      onProgress: (sent, total) => {
        if (total) showImportResult('working', `Uploading ${file.name}… ${Math.floor((sent / total) * 100)}%`);
      },
      onSent: () => showImportResult('working', `Importing ${file.name}…`),
    });
  } catch (e) {
    showImportResult('error', `Could not import ${file.name}: ${e.message}`);
    return;
  } finally {
    importing = false;
    button.disabled = false;
    button.removeAttribute('aria-busy');
    button.textContent = 'Import…';
  }
  showImportResult(summary.failed?.length ? 'partial' : 'done', importText(summary), summary);
  if (search.q) startSearch(search.q);
  reloadList();
}

/** "Imported 12 conversations, 340 messages; 3 parts skipped; 1 failed". `conversations`
 * counts those found imported already too, `unchanged` those of them that were whole. */
function importText({ conversations = 0, unchanged, sessions = 0, messages = 0, skipped = [], failed = [] }) {
  const before = unchanged ?? (!sessions && !messages ? conversations : 0);
  const fresh = conversations - before;
  const old = `${count(before, 'conversation')} ${before === 1 ? 'was' : 'were'} imported before`;
  let text = !fresh && before ? `Nothing new: ${old}` : `Imported ${count(fresh, 'conversation')}, ${count(messages, 'message')}`;
  if (fresh && before) text += `; ${old}`;
  if (skipped.length) text += `; ${count(skipped.length, 'part')} skipped`;
  if (failed.length) text += `; ${fmt(failed.length)} failed`;
  return `${text}.`;
}

/** The import's status line under the button (`state`: working, done, partial, error), with
 * the summary's failed conversations listed and its skipped parts folded away. */
function showImportResult(kind, text, summary = null) {
  const box = $('#import-result');
  box.hidden = false;
  box.dataset.state = kind;
  $('#import-status').textContent = text;
  $('#import-dismiss').hidden = kind === 'working';
  const failed = summary?.failed ?? [];
  const skipped = summary?.skipped ?? [];
  const named = (c) => h('strong', { text: c.conversation || 'A conversation' });
  $('#import-failed').replaceChildren(...failed.map((f) => h('li', {}, named(f), `: ${f.reason}`)));
  $('#import-failed').hidden = !failed.length;
  $('#import-skipped ul').replaceChildren(
    ...skipped.map((s) => h('li', {}, named(s), `: ${s.what}${s.reason ? ` (${s.reason})` : ''}`)),
  );
  $('#import-skipped summary').textContent = `${count(skipped.length, 'part')} skipped`;
  $('#import-skipped').hidden = !skipped.length;
}

function setupImport() {
  const input = $('#import-input');
  $('#import').addEventListener('click', () => input.click());
  input.addEventListener('change', () => {
    const file = input.files?.[0];
    input.value = ''; // the same file again is a change too
    if (file) importFile(file);
  });
  $('#import-dismiss').addEventListener('click', () => {
    $('#import-result').hidden = true;
    $('#import').focus();
  });
}

// ---------------------------------------------------------------------------------------
// The context inspector: what the model would be sent next and its size, or (DESIGN §11)
// what one attempt was sent, rebuilt from the log and checked against the hash recorded
// when it went out.

/** Counts the inspector's loads: one overtaken by a newer load draws nothing. */
let inspectorLoads = 0;

function contentText(content) {
  if (typeof content === 'string') return content;
  if (!Array.isArray(content)) return JSON.stringify(content);
  return content.map(partText).join('\n\n');
}

/** A content part as text. An image sent as a data URL shows its type and size, not its
 * bytes; one the context only refers to shows its id. */
function partText(part) {
  if (part.type === 'text') return part.text;
  if (part.type === 'image_url') {
    const url = part.image_url?.url ?? '';
    const data = /^data:([^;,]*)[^,]*,/.exec(url);
    return data ? `[image ${data[1]}, ${fmt(url.length - data[0].length)} characters of base64]` : `[image ${url}]`;
  }
  return `[${part.type} ${part.id ?? ''} ${part.mime ?? ''}]`;
}

/** Where the provider's cache ended in a request it billed `input` tokens for, `cached` of
 * them from its cache. A provider caches a prefix of the request but says only how long it
 * was, so each message's tokens are estimated as its share of `input` by length (role and
 * text), summed in order: the prefix ends in the message where the sum reaches `cached`.
 * Returns that message's index, -1 when nothing was cached. Lengths stand in for tokens, so
 * the place is approximate; the counts shown beside it are the provider's own. */
function cacheEndsIn(messages, input, cached) {
  if (!(cached > 0) || !(input > 0) || !messages.length) return -1;
  const lengths = messages.map((m) => m.role.length + contentText(m.content).length + 2);
  const total = lengths.reduce((a, b) => a + b, 0);
  let sum = 0;
  for (const [i, length] of lengths.entries()) {
    sum += length;
    if ((sum / total) * input >= cached) return i;
  }
  return messages.length - 1;
}

/** A request's messages, role and text (a long one scrolls in its box). With `cache`
 * (`{end, note}`), the messages through `end` are marked as served from the provider's
 * cache, and a line where that prefix ends says so. */
function messageList(messages, cache = null) {
  return h(
    'ol',
    { class: 'ctx-messages' },
    messages.map((m, i) => {
      const cached = cache && i <= cache.end;
      return h(
        'li',
        { class: `ctx-msg role-${m.role}`, dataset: cached ? { cache: i < cache.end ? 'all' : 'part' } : undefined },
        h('span', { class: 'role', text: m.role }),
        cached ? h('span', { class: 'cached-tag', text: i < cache.end ? 'cached' : 'partly cached' }) : null,
        h('pre', { text: contentText(m.content) }),
        cached && i === cache.end ? h('p', { class: 'cache-end', text: cache.note }) : null,
      );
    }),
  );
}

/** Shows the next request, or the one the inspected attempt sent. */
function loadInspector() {
  const sent = state.inspecting;
  $('#inspector-title').textContent = sent ? `What was sent for #${sent.item.seq}` : 'What the model sees next';
  $('#inspector-next').hidden = !sent;
  return sent ? loadRequest(sent) : loadContext();
}

/** Opens the inspector on the request `item`'s attempt sent, or (null) on the next one. */
function inspect(item) {
  state.inspecting = item && state.current ? { sessionId: state.current.id, item } : null;
  toggleInspector(true);
  if (!item) return;
  // The inspector's column narrows the transcript: keep the answer asked about in view.
  $(`#transcript > [data-seq="${item.seq}"]`)?.scrollIntoView({ block: 'nearest' });
  $('#inspector-title').focus({ preventScroll: true });
}

async function loadContext() {
  const load = ++inspectorLoads;
  const body = $('#inspector-body');
  const id = state.current?.id;
  if (!id) {
    body.replaceChildren(h('p', { class: 'hint', text: 'Open a session to see what the model is sent.' }));
    return;
  }
  body.replaceChildren(h('p', { class: 'hint', text: 'Loading…' }));
  let ctx;
  try {
    ctx = await api(`/v1/sessions/${id}/context`);
  } catch (e) {
    if (load === inspectorLoads) body.replaceChildren(h('p', { class: 'hint', text: `Could not load the context: ${e.message}` }));
    return;
  }
  if (load !== inspectorLoads || state.current?.id !== id) return;
  const share = ctx.budget ? Math.min(100, (ctx.tokens / ctx.budget) * 100) : 0;
  const fill = h('div', { class: 'fill' });
  fill.style.width = `${share}%`; // CSSOM, which the style policy allows (attributes it would not)
  const meter = h(
    'div',
    { class: 'meter', role: 'meter', 'aria-valuemin': 0, 'aria-valuemax': ctx.budget, 'aria-valuenow': ctx.tokens, 'aria-label': 'Tokens against the budget' },
    fill,
  );
  meter.classList.toggle('high', share >= 85);
  const facts = [
    ['Model', ctx.model],
    ['Context window', ctx.window ? `${fmt(ctx.window)} tokens` : 'unknown'],
    ['Summarized through', ctx.compacted_through ? `#${ctx.compacted_through}` : 'nothing yet'],
    ['Messages', fmt(ctx.messages.length)],
  ];
  const extras = ctx.extras ?? {};
  const parts = [
    h('p', { class: 'ctx-tokens', text: `${fmt(ctx.tokens)} of ${fmt(ctx.budget)} tokens (${share.toFixed(0)}%)` }),
    meter,
    h('dl', { class: 'facts' }, facts.map(([k, v]) => [h('dt', { text: k }), h('dd', { text: v })])),
    ctx.system
      ? h('details', { class: 'ctx-system' }, h('summary', { text: 'System prompt' }), h('pre', { text: ctx.system }))
      : h('p', { class: 'dim', text: 'No system prompt (TURNLOG_SYSTEM_PROMPT is empty).' }),
    extras.date || extras.memories?.length
      ? h(
          'details',
          { class: 'ctx-extras' },
          h('summary', { text: 'Extras for this turn' }),
          extras.date ? h('p', { text: `Date: ${extras.date}` }) : null,
          extras.memories?.length ? h('ul', {}, extras.memories.map((m) => h('li', { text: m }))) : null,
        )
      : null,
    messageList(ctx.messages),
  ];
  body.replaceChildren(...parts.filter(Boolean));
}

/** The request an attempt sent (GET /requests/{seq}): its messages and parameters as the
 * server rebuilt them from the log, whether those bytes hash to what was recorded when it
 * was sent, and how much of it the provider served from its cache (the answer's usage). */
async function loadRequest({ sessionId, item }) {
  const load = ++inspectorLoads;
  const body = $('#inspector-body');
  body.replaceChildren(h('p', { class: 'hint', text: 'Loading…' }));
  let sent;
  try {
    sent = await api(`/v1/sessions/${sessionId}/requests/${item.seq}`);
  } catch (e) {
    if (load !== inspectorLoads) return;
    // Imported answers, those from before requests were recorded, and attempts that failed
    // before sending have none: that is an answer, not an error.
    const text =
      e.status === 404
        ? `No request recorded for this ${item.kind === 'error' ? 'attempt' : 'answer'}.`
        : `Could not load the request: ${e.message}`;
    body.replaceChildren(h('p', { class: 'hint sent-none', text }));
    return;
  }
  if (load !== inspectorLoads) return;
  const { model, messages = [], ...params } = sent.body;
  const input = item.usage?.input_tokens;
  const cached = item.usage?.cached_input_tokens;
  const known = typeof cached === 'number' && input > 0;
  const end = known ? cacheEndsIn(messages, input, cached) : -1;
  const share = known ? `${fmt(cached)} of ${fmt(input)} input tokens` : '';
  const facts = [
    ['Model', model ?? sent.model],
    ['Messages', fmt(messages.length)],
    ...Object.entries(params).map(([k, v]) => [k, typeof v === 'string' ? v : JSON.stringify(v)]),
  ];
  const parts = [
    h(
      'div',
      { class: 'sent-check', dataset: { verified: String(sent.verified) } },
      h('span', { class: 'verdict', text: sent.verified ? '✓ Verified' : '✗ Not verified' }),
      h('span', {
        text: sent.verified
          ? 'Rebuilt from the log, these are the exact bytes sent.'
          : 'Rebuilt from the log, these are not the bytes sent: the code that builds requests has changed since.',
      }),
      h('span', { class: 'sha' }, 'SHA-256 ', h('code', { text: sent.body_sha256 })),
    ),
    h('p', { class: 'ctx-tokens', text: `${fmt(sent.tokens)} tokens, as the budget counted them` }),
    known
      ? h('p', {
          class: 'cache-share',
          text: cached > 0 ? `${share} were served from the provider's cache (${Math.round((cached / input) * 100)}%).` : `None of the ${fmt(input)} input tokens came from the provider's cache.`,
        })
      : item.usage
        ? h('p', { class: 'dim', text: 'The provider did not say how much of this request it had cached.' })
        : null,
    h('dl', { class: 'facts' }, facts.map(([k, v]) => [h('dt', { text: k }), h('dd', { text: v })])),
    messageList(messages, end >= 0 ? { end, note: `The provider's cache ends about here (${share}, placed by length).` } : null),
  ];
  body.replaceChildren(...parts.filter(Boolean));
}

function toggleInspector(open = !state.inspectorOpen) {
  state.inspectorOpen = open;
  document.body.classList.toggle('inspecting', open);
  $('#inspector').hidden = !open;
  $('#context-toggle').setAttribute('aria-pressed', String(open));
  if (open) loadInspector();
}

// ---------------------------------------------------------------------------------------
// Wiring.

function setupComposer() {
  const input = $('#message');
  $('#composer').addEventListener('submit', (e) => {
    e.preventDefault();
    send();
  });
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  input.addEventListener('input', () => autosize());
  $('#stop').addEventListener('click', stop);
  $('#retry').addEventListener('click', retry);
  setupAttachments();
}

function setupKeys() {
  document.addEventListener('keydown', (e) => {
    if (document.querySelector('dialog[open]')) return;
    if (e.key === 'Escape' && state.turn) {
      e.preventDefault();
      stop();
    } else if (e.key === '/' && !e.target.closest('input, textarea, [contenteditable]')) {
      e.preventDefault();
      $('#search').focus();
    }
  });
}

function init() {
  setupTokenDialog(() => {
    reloadList();
    startSearch(search.q);
    if (state.current?.id) openSession(state.current.id);
  });
  setupList();
  setupComposer();
  setupKeys();
  $('#transcript').addEventListener('scroll', maybeLoadEarlier, { passive: true });
  $('#new-chat').addEventListener('click', () => {
    location.hash = '#/new';
    $('#message').focus();
  });
  $('#back').addEventListener('click', () => (location.hash = '#/'));
  $('#more').addEventListener('click', (e) => {
    e.stopPropagation();
    showMenu(!$('#chat-header').classList.contains('menu-open'));
  });
  document.addEventListener('click', (e) => {
    if (!e.target.closest('#more')) showMenu(false);
  });
  setupExport();
  setupImport();
  $('#rename').addEventListener('click', rename);
  $('#archive').addEventListener('click', toggleArchive);
  $('#delete').addEventListener('click', remove);
  $('#context-toggle').addEventListener('click', () => {
    if (!state.inspectorOpen) state.inspecting = null; // opened from here, it shows the next request
    toggleInspector();
  });
  $('#inspector-close').addEventListener('click', () => toggleInspector(false));
  $('#inspector-next').addEventListener('click', () => inspect(null));
  $('#inspector-refresh').addEventListener('click', loadInspector);
  $('#ask-cancel').addEventListener('click', () => $('#ask-dialog').close('cancel'));
  // A reload mid-turn continues from the newest event this tab has seen.
  window.addEventListener('pagehide', saveSnapshotNow);
  window.addEventListener('hashchange', route);
  reloadList();
  route();
}

init();
