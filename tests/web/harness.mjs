// Starts `turnlog dev` for the browser tests and stops it again. Each run gets a fresh
// data directory, a free port and its own API token (so its owner sees only its own
// sessions), or with `tokens: false` none (local mode); on the machine's Postgres and NATS
// (DATABASE_URL / NATS_URL set) it also gets its own database and bus prefix, both removed
// when it stops.

import { spawn, execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, mkdirSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { once } from 'node:events';
import { fileURLToPath } from 'node:url';

const READY_TIMEOUT_MS = 180_000; // a first private Postgres runs initdb
const STOP_TIMEOUT_MS = 45_000;

const nonEmpty = (v) => typeof v === 'string' && v.trim() !== '';

export async function startTurnlog({ logFile, tokens = true, secondOwner = false, mcp = false }) {
  const targetDir = process.env.CARGO_TARGET_DIR || '/var/tmp/turnlog-target';
  const binary = path.join(targetDir, 'debug', 'turnlog');
  if (!existsSync(binary)) throw new Error(`${binary} is missing: run \`cargo build -p turnlog\` first`);
  const dir = mkdtempSync(path.join(os.tmpdir(), 'turnlog-web-'));
  const tag = randomBytes(6).toString('hex');
  const port = await freePort();
  const owner = tokens ? `web-${tag}` : 'local';
  const token = tokens ? `token-${randomBytes(12).toString('hex')}` : null;
  const env = {
    ...process.env,
    TURNLOG_DATA_DIR: path.join(dir, 'data'),
    TURNLOG_LISTEN: `127.0.0.1:${port}`,
    TURNLOG_LOG_FORMAT: 'pretty',
    RUST_LOG: process.env.RUST_LOG || 'info',
  };
  // A second owner's token, for tests that one owner cannot reach another's data.
  const token2 = tokens && secondOwner ? `token-${randomBytes(12).toString('hex')}` : null;
  if (tokens) env.TURNLOG_API_TOKENS = `${owner}:${token}` + (token2 ? `,${owner}-b:${token2}` : '');
  else delete env.TURNLOG_API_TOKENS;
  delete env.TURNLOG_LLM_URL; // the built-in mock model answers
  // With `mcp`, server tools: the reference filesystem server (pinned in tests/mcp) on a
  // workspace of this run's own, its write_file behind a prompt, its reads allowed.
  const workspace = path.join(dir, 'workspace');
  if (mcp) {
    mkdirSync(workspace, { recursive: true });
    const installed = execFileSync('bash', [fileURLToPath(new URL('../mcp/setup', import.meta.url))], { encoding: 'utf8' }).trim();
    const servers = path.join(dir, 'mcp-servers.toml');
    writeFileSync(
      servers,
      `[[servers]]\nlabel = "files"\ncommand = "${path.join(installed, 'node_modules/.bin/mcp-server-filesystem')}"\n` +
        `args = ["${workspace}"]\n[servers.tools.write_file]\npolicy = "ask"\ndanger_level = "high"\n` +
        `[servers.tools.read_text_file]\npolicy = "allow"\ndanger_level = "low"\n`,
    );
    env.TURNLOG_MCP_SERVERS = servers;
  } else {
    delete env.TURNLOG_MCP_SERVERS;
  }

  const cleanups = [() => rmSync(dir, { recursive: true, force: true })];
  const cleanUp = async () => {
    for (const fn of cleanups.reverse()) {
      try {
        await fn();
      } catch (e) {
        console.error(`cleanup: ${e.message}`);
      }
    }
    cleanups.length = 0;
  };
  try {
    if (nonEmpty(process.env.DATABASE_URL)) {
      const admin = process.env.DATABASE_URL;
      const database = `turnlog_web_${tag}`;
      psql(admin, `CREATE DATABASE ${database}`);
      cleanups.push(() => psql(admin, `DROP DATABASE IF EXISTS ${database} WITH (FORCE)`));
      env.DATABASE_URL = withDatabase(admin, database);
    }
    if (nonEmpty(process.env.NATS_URL)) {
      env.TURNLOG_BUS_PREFIX = `tlweb_${tag}`;
      cleanups.push(() => deleteStreams(process.env.NATS_URL, env.TURNLOG_BUS_PREFIX));
    }

    const log = openSync(logFile, 'w');
    let child = spawn(binary, ['dev'], { env, stdio: ['ignore', log, log] });
    let exited = once(child, 'exit');
    const base = `http://127.0.0.1:${port}`;
    await waitReady(base, exited, logFile);
    // As root, a private Postgres lives outside the data directory; the banner names it.
    const cluster = /\/var\/tmp\/turnlog-pg-[0-9a-f]{16}/.exec(readFileSync(logFile, 'utf8'))?.[0];

    let stopped = null;
    const stop = () =>
      (stopped ??= (async () => {
        if (child.exitCode === null && child.signalCode === null) {
          child.kill('SIGINT'); // turnlog dev stops its services in order, then its servers
          const late = setTimeout(() => child.kill('SIGKILL'), STOP_TIMEOUT_MS);
          await exited;
          clearTimeout(late);
        }
        if (cluster && !nonEmpty(process.env.DATABASE_URL)) {
          cleanups.push(() => rmSync(cluster, { recursive: true, force: true }));
        }
        await cleanUp();
      })());
    // A crash and a restart on the same database and bus: only on servers that outlive
    // `turnlog dev` (DATABASE_URL and NATS_URL set), not on the private ones it starts.
    const killAndRestart = async () => {
      if (!nonEmpty(process.env.DATABASE_URL) || !nonEmpty(process.env.NATS_URL)) {
        throw new Error('killAndRestart needs DATABASE_URL and NATS_URL');
      }
      child.kill('SIGKILL');
      await exited;
      const again = openSync(logFile, 'a');
      child = spawn(binary, ['dev'], { env, stdio: ['ignore', again, again] });
      exited = once(child, 'exit');
      await waitReady(base, exited, logFile);
    };
    return { base, port, token, token2, owner, stop, killAndRestart, logFile, workspace };
  } catch (e) {
    await cleanUp();
    throw e;
  }
}

async function waitReady(base, exited, logFile) {
  const deadline = Date.now() + READY_TIMEOUT_MS;
  let gone = false;
  exited.then(() => (gone = true));
  while (Date.now() < deadline) {
    if (gone) throw new Error(`turnlog dev exited during start; see ${logFile}:\n${tail(logFile)}`);
    try {
      const res = await fetch(`${base}/readyz`);
      if (res.ok) return;
    } catch {
      // not listening yet
    }
    await new Promise((r) => setTimeout(r, 250));
  }
  throw new Error(`turnlog dev not ready after ${READY_TIMEOUT_MS / 1000} s; see ${logFile}:\n${tail(logFile)}`);
}

export function tail(file, lines = 40) {
  try {
    return readFileSync(file, 'utf8').trimEnd().split('\n').slice(-lines).join('\n');
  } catch {
    return '';
  }
}

function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

function psql(url, sql) {
  try {
    execFileSync('psql', [url, '-v', 'ON_ERROR_STOP=1', '-q', '-c', sql], { stdio: ['ignore', 'ignore', 'pipe'] });
  } catch (e) {
    const why = e.code === 'ENOENT' ? 'psql is not installed (Debian: postgresql-client)' : String(e.stderr ?? e.message).trim();
    throw new Error(`psql ${sql}: ${why}`);
  }
}

/** `url` naming `database` instead of its own, keeping user, host, port and query. */
function withDatabase(url, database) {
  const u = new URL(url);
  u.pathname = `/${database}`;
  return u.toString();
}

/** Deletes the JetStream streams (and the key-value bucket's) of bus prefix `prefix`,
 * speaking NATS's text protocol directly: it is a few lines, and no client library needed. */
async function deleteStreams(natsUrl, prefix) {
  const u = new URL(natsUrl.split(',')[0].trim());
  const socket = net.connect(Number(u.port) || 4222, u.hostname);
  socket.setTimeout(10_000, () => socket.destroy(new Error('NATS did not answer')));
  const failed = once(socket, 'error').then(([e]) => Promise.reject(e));
  failed.catch(() => {});
  await Promise.race([once(socket, 'connect'), failed]);
  const inbox = `_INBOX.turnlogweb.${randomBytes(6).toString('hex')}`;
  const waiting = new Map();
  let buffer = Buffer.alloc(0);
  socket.on('data', (chunk) => {
    buffer = Buffer.concat([buffer, chunk]);
    for (;;) {
      const eol = buffer.indexOf('\r\n');
      if (eol < 0) return;
      const line = buffer.subarray(0, eol).toString();
      if (line.startsWith('MSG ')) {
        const parts = line.split(' ');
        const size = Number(parts.at(-1));
        if (buffer.length < eol + 2 + size + 2) return;
        const payload = buffer.subarray(eol + 2, eol + 2 + size).toString();
        buffer = buffer.subarray(eol + 4 + size);
        waiting.get(parts[1])?.(payload);
        continue;
      }
      buffer = buffer.subarray(eol + 2);
      if (line === 'PING') socket.write('PONG\r\n');
    }
  });
  const auth = u.username ? { user: decodeURIComponent(u.username), pass: decodeURIComponent(u.password) } : {};
  socket.write(`CONNECT ${JSON.stringify({ verbose: false, pedantic: false, lang: 'node', version: '0', ...auth })}\r\n`);
  socket.write(`SUB ${inbox}.* 1\r\n`);
  let n = 0;
  const request = (subject, body) =>
    Promise.race([
      failed,
      new Promise((resolve) => {
        const reply = `${inbox}.${++n}`;
        waiting.set(reply, resolve);
        socket.write(`PUB ${subject} ${reply} ${Buffer.byteLength(body)}\r\n${body}\r\n`);
      }),
    ]);
  try {
    const upper = prefix.toUpperCase();
    const ours = [];
    // The server answers a page of names at a time (1,024 on 2.9).
    for (let offset = 0; ; ) {
      const page = JSON.parse(await request('$JS.API.STREAM.NAMES', JSON.stringify({ offset })));
      if (page.error) throw new Error(`listing streams: ${page.error.description}`);
      const names = page.streams ?? [];
      ours.push(...names.filter((name) => name.replace(/^(KV|OBJ)_/, '').startsWith(`${upper}_`)));
      offset += names.length;
      if (!names.length || offset >= page.total) break;
    }
    if (!ours.length) console.error(`cleanup: no streams of bus prefix ${prefix} found`);
    for (const name of ours) await request(`$JS.API.STREAM.DELETE.${name}`, '');
  } finally {
    socket.destroy();
  }
}
