// Loaded with `node --import` (run.mjs): bare imports that do not resolve from the test
// files (the packages are installed outside the clone, see ./run) resolve from
// $TURNLOG_CLIENTS_MODULES/node_modules instead.
import { register } from 'node:module';

register('./hooks.mjs', import.meta.url);
