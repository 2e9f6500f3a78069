// Rename, archive, delete: the open session's actions in the chat's header.

import { api } from './api.js';
import { $, ask, toast } from './dom.js';
import { updateListRow } from './session-list.js';
import { renderHeader } from './session.js';
import { list, state } from './state.js';

export async function rename() {
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

export async function toggleArchive() {
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

export async function remove() {
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
