// Server-sent events read from a fetch() body. The browser's EventSource can neither POST
// nor send an Authorization header, so turns are read as a stream of text and parsed here,
// following the WHATWG event-stream rules (id:, event:, data:, comments, any line ending).

/** A parser: feed it text with push(); it calls onEvent({id, event, data}) per event. */
export function sseParser(onEvent) {
  let buffer = '';
  let id = null;
  let event = '';
  let data = [];

  const line = (l) => {
    if (l === '') {
      if (data.length) onEvent({ id, event: event || 'message', data: data.join('\n') });
      event = '';
      data = [];
      return;
    }
    if (l.startsWith(':')) return; // a keep-alive comment
    const colon = l.indexOf(':');
    const field = colon < 0 ? l : l.slice(0, colon);
    let value = colon < 0 ? '' : l.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'data') data.push(value);
    else if (field === 'event') event = value;
    else if (field === 'id' && !value.includes('\0')) id = value;
  };

  let afterCR = false; // the last chunk ended in \r: a \n starting the next one is its pair

  return {
    push(text) {
      if (afterCR && text.startsWith('\n')) text = text.slice(1);
      afterCR = false;
      buffer += text;
      let start = 0;
      for (let i = 0; i < buffer.length; i++) {
        const c = buffer[i];
        if (c !== '\n' && c !== '\r') continue;
        line(buffer.slice(start, i));
        if (c === '\r') {
          if (i + 1 === buffer.length) afterCR = true;
          else if (buffer[i + 1] === '\n') i++;
        }
        start = i + 1;
      }
      buffer = buffer.slice(start);
    },
  };
}

/** Reads a response body to its end, calling onEvent for every event in it. */
export async function readEvents(body, onEvent) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = sseParser(onEvent);
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    parser.push(value);
  }
}
