// Runs schemathesis ($ST, the venv's `st` that `run` made) against a fresh `turnlog dev`
// started by the browser tests' harness, with an API token, so the document's bearer
// security is real: the auth checks send requests without it or with a wrong one. It runs
// in a temporary directory, so nothing it writes lands in the work tree.
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { startTurnlog, tail } from '../web/harness.mjs';

const here = path.dirname(fileURLToPath(import.meta.url));
const work = mkdtempSync(path.join(os.tmpdir(), 'turnlog-schemathesis-'));
const logFile = path.join(work, 'turnlog-dev.log');
const started = Date.now();
let status = 1;
const server = await startTurnlog({ logFile });
try {
  const args = [
    '--config-file', path.join(here, 'schemathesis.toml'),
    'run', `${server.base}/v1/openapi.json`,
    '--url', server.base,
    '--header', `Authorization: Bearer ${server.token}`,
    '--seed', process.env.ST_SEED || '1',
    '--max-examples', process.env.ST_MAX_EXAMPLES || '50',
    // One worker: the same seed makes the same requests in the same order.
    '--workers', '1',
    '--generation-database', 'none',
    '--no-color',
    ...process.argv.slice(2),
  ];
  const child = spawn(process.env.ST || 'st', args, { stdio: 'inherit', cwd: work });
  const [code] = await once(child, 'exit');
  status = code ?? 1;
  if (status !== 0) console.error(`turnlog dev log:\n${tail(logFile, 40)}`);
} finally {
  await server.stop();
  rmSync(work, { recursive: true, force: true });
}
console.log(`schemathesis took ${Math.round((Date.now() - started) / 1000)} s`);
process.exit(status);
