// Starts a fresh `turnlog dev` (the browser tests' harness: its own data directory, port
// and owner token; its own database and bus prefix on DATABASE_URL / NATS_URL), then runs,
// one after another (the tests count the owner's sessions, so nothing may run beside
// them): the Node clients' tests (node:test) and the Agents SDK's (unittest, $PYTHON).
// Run by ./run with Node >= 22 and TURNLOG_CLIENTS_MODULES (the installed node_modules'
// directory); `node` or `python` as the argument runs only those.
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { mkdtempSync, readdirSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { startTurnlog, tail } from '../web/harness.mjs';

const here = path.dirname(fileURLToPath(import.meta.url));
const only = process.argv[2];
if (only && only !== 'node' && only !== 'python') {
  console.error(`usage: run [node|python] (got ${only})`);
  process.exit(2);
}
if (!process.env.TURNLOG_CLIENTS_MODULES) {
  console.error('TURNLOG_CLIENTS_MODULES is not set: start the tests with ./run');
  process.exit(2);
}
// The server's log lives outside the clone.
const logFile = path.join(mkdtempSync(path.join(os.tmpdir(), 'turnlog-clients-')), 'turnlog-dev.log');
const server = await startTurnlog({ logFile });
// (No __pycache__ in the clone.)
const env = { ...process.env, TURNLOG_BASE: server.base, TURNLOG_TOKEN: server.token, PYTHONDONTWRITEBYTECODE: '1' };

async function run(label, command, args) {
  console.log(`\n# ${label}`);
  const child = spawn(command, args, { stdio: 'inherit', env, cwd: here });
  const [code] = await once(child, 'exit');
  console.log(`# ${label}: ${code === 0 ? 'passed' : 'FAILED'}`);
  return code === 0;
}

const results = [];
try {
  if (only !== 'python') {
    // The packages live outside the clone: hooks.mjs resolves bare imports there.
    const files = readdirSync(here).filter((f) => f.endsWith('.test.mjs')).sort();
    results.push(
      await run('Node clients (node:test)', process.execPath, [
        '--import',
        path.join(here, 'register.mjs'),
        '--test',
        '--test-concurrency=1',
        '--test-reporter=spec',
        ...files,
      ]),
    );
  }
  if (only !== 'node') {
    results.push(await run('OpenAI Agents SDK (unittest)', process.env.PYTHON || 'python3', ['test_agents.py', '-v']));
  }
} finally {
  await server.stop();
}
const ok = results.every(Boolean);
if (!ok) console.error(`\nturnlog dev log (${logFile}), its end:\n${tail(logFile, 60)}`);
process.exit(ok ? 0 : 1);
