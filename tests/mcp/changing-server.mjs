// A small MCP server on the official TypeScript SDK for turnlog's tests: `grow` adds a
// tool named `grown` (the SDK then sends notifications/tools/list_changed), and `fail`
// answers an error result. Stdio transport.
import { McpServer } from '@modelcontextprotocol/sdk/server/mcp.js';
import { StdioServerTransport } from '@modelcontextprotocol/sdk/server/stdio.js';
import { z } from 'zod';

const server = new McpServer({ name: 'turnlog-test-changing', version: '1.0.0' });
server.registerTool(
  'grow',
  { description: 'Adds the tool `grown`.', inputSchema: {} },
  async () => {
    server.registerTool(
      'grown',
      { description: 'Says it grew.', inputSchema: { word: z.string() } },
      async ({ word }) => ({ content: [{ type: 'text', text: `grown: ${word}` }] }),
    );
    return { content: [{ type: 'text', text: 'grew a tool' }] };
  },
);
server.registerTool(
  'fail',
  { description: 'Always fails.', inputSchema: {} },
  async () => ({ isError: true, content: [{ type: 'text', text: 'the disk is on fire' }] }),
);
await server.connect(new StdioServerTransport());
