// Runs test_sdk.py (the official `openai` Python SDK against turnlog's OpenAI-compatible
// routes) against a fresh `turnlog dev` started by the browser tests' harness, with two
// owners' tokens; the Python interpreter is $PYTHON (the venv `run` made).
import { spawnSync } from 'node:child_process';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { startTurnlog, tail } from '../web/harness.mjs';

const here = path.dirname(fileURLToPath(import.meta.url));
const logFile = path.join(here, 'turnlog-dev.log');
const server = await startTurnlog({ logFile, secondOwner: true });
let status = 1;
try {
  const python = process.env.PYTHON || 'python3';
  const result = spawnSync(python, [path.join(here, 'test_sdk.py'), '-v'], {
    stdio: 'inherit',
    env: { ...process.env, TURNLOG_BASE: server.base, TURNLOG_TOKEN: server.token, TURNLOG_TOKEN2: server.token2 },
  });
  status = result.status ?? 1;
  if (status !== 0) console.error(`turnlog dev log (${logFile}):\n${tail(logFile, 60)}`);
} finally {
  await server.stop();
}
process.exit(status);
