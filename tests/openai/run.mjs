// Runs test_sdk.py (the official `openai` Python SDK against turnlog's OpenAI-compatible
// routes) against a fresh `turnlog dev` started by the browser tests' harness, with two
// owners' tokens; the Python interpreter is $PYTHON (the venv `run` made).
import { spawn } from 'node:child_process';
import http from 'node:http';
import { once } from 'node:events';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { startTurnlog, tail } from '../web/harness.mjs';

const here = path.dirname(fileURLToPath(import.meta.url));
const logFile = path.join(here, 'turnlog-dev.log');
const server = await startTurnlog({ logFile, secondOwner: true, mcp: true });
// The tests ask for a crash of `turnlog dev` (SIGKILL, then a restart) with a POST here,
// when the servers outlive it.
const control = http.createServer(async (req, res) => {
  try {
    await server.killAndRestart();
    res.writeHead(200).end('restarted');
  } catch (e) {
    res.writeHead(500).end(String(e));
  }
});
await new Promise((resolve) => control.listen(0, '127.0.0.1', resolve));
const restartable = Boolean(process.env.DATABASE_URL?.trim() && process.env.NATS_URL?.trim());
let status = 1;
try {
  const python = process.env.PYTHON || 'python3';
  const env = {
    ...process.env,
    TURNLOG_BASE: server.base,
    TURNLOG_TOKEN: server.token,
    TURNLOG_TOKEN2: server.token2,
    TURNLOG_WORKSPACE: server.workspace,
  };
  if (restartable) env.TURNLOG_RESTART_URL = `http://127.0.0.1:${control.address().port}/restart`;
  // Asynchronous, so this process can serve the restart requests meanwhile.
  const child = spawn(python, [path.join(here, 'test_sdk.py'), '-v'], { stdio: 'inherit', env });
  const [code] = await once(child, 'exit');
  status = code ?? 1;
  if (status !== 0) console.error(`turnlog dev log (${logFile}):\n${tail(logFile, 60)}`);
} finally {
  control.close();
  await server.stop();
}
process.exit(status);
