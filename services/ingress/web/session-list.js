// The session list: newest first, a page at a time as the list scrolls, a row per session
// kept in step as sessions change.

import { api } from './api.js';
import { $, fmt, h, time } from './dom.js';
import { loadHits, startSearch } from './search.js';
import { list, search, state } from './state.js';

const PAGE_SIZE = 30;

export function reloadList() {
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
export function maybeLoadMore() {
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
export function updateListRow(session, { toTop = false } = {}) {
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

export function markCurrentRow() {
  for (const a of document.querySelectorAll('#session-list a')) {
    const current = a.parentElement.dataset.id === state.current?.id;
    if (current) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
}

export function setupList() {
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
