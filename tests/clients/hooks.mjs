// The module resolution hook register.mjs installs: a bare specifier (`openai`,
// `@langchain/core/messages`) that the normal resolution cannot find is resolved as if it
// were imported from $TURNLOG_CLIENTS_MODULES, where ./run installed the packages.
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const modules = process.env.TURNLOG_CLIENTS_MODULES;
const parentURL = modules ? pathToFileURL(path.join(modules, 'index.mjs')).href : null;
const bare = (specifier) => !/^(\.|\/|[a-z]+:)/i.test(specifier);

export async function resolve(specifier, context, nextResolve) {
  try {
    return await nextResolve(specifier, context);
  } catch (e) {
    if (!parentURL || !bare(specifier) || e?.code !== 'ERR_MODULE_NOT_FOUND') throw e;
    return nextResolve(specifier, { ...context, parentURL });
  }
}
