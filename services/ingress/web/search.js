// Search (DESIGN §2): the owner's messages, answers and titles, best first, a page at a
// time. The index trails the log by about a second.

import { api } from './api.js';
import { $, h, marked, time } from './dom.js';
import { maybeLoadMore } from './session-list.js';
import { openSession } from './session.js';
import { search, showPane, state } from './state.js';

const HITS_PAGE = 20;
const HIT_KINDS = { user: 'your message', assistant: 'answer', title: 'title' };

/** Shows the hits for `q` in place of the session list; blank shows the list again. */
export function startSearch(q) {
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

export async function loadHits() {
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
export function reveal(seq) {
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
