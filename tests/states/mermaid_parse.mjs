// Parse Mermaid text with Mermaid's own parser, under plain node.
//
// Usage:
//   node tests/states/mermaid_parse.mjs < diagram.mmd
//       One diagram on stdin. Prints {"diagramType": ...} and exits 0, or prints the parser's
//       message on stderr and exits 1.
//   node tests/states/mermaid_parse.mjs --batch < diagrams.json
//       A JSON object {name: text, ...} on stdin (one node start for many diagrams). Prints
//       {name: {"diagramType": ...} | {"error": message}, ...} and exits 0.
// Either way it exits 3 when the parser is not installed (run .ci/install-mermaid.sh).
//
// The packages come from .ci/node/ (or $MERMAID_NODE_PREFIX); jsdom supplies the DOM window
// that mermaid's sanitiser (DOMPurify) needs, so no browser is involved.

import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { fileURLToPath, pathToFileURL } from "node:url";

const prefix = process.env.MERMAID_NODE_PREFIX
  ?? fileURLToPath(new URL("../../.ci/node/", import.meta.url));
const require = createRequire(pathToFileURL(prefix + "/package.json"));

let mermaidPath, JSDOM;
try {
  mermaidPath = require.resolve("mermaid");
  ({ JSDOM } = require("jsdom"));
} catch (err) {
  console.error(`mermaid parser not installed in ${prefix}: run .ci/install-mermaid.sh (${err.message})`);
  process.exit(3);
}

// DOMPurify binds to the global window when it is first imported: set one up before mermaid.
const { window } = new JSDOM("");
globalThis.window = window;
globalThis.document = window.document;
const { default: mermaid } = await import(pathToFileURL(mermaidPath).href);

// parse() reads the front matter (YAML), detects the diagram type, runs the diagram's grammar
// and fills its database; it throws on any error. (A front matter that is not a YAML mapping is
// ignored, not rejected: the Python test checks the `title:` line itself.)
async function parse(text) {
  try {
    const { diagramType } = await mermaid.parse(text);
    return { diagramType };
  } catch (err) {
    return { error: String(err?.message ?? err) };
  }
}

const input = readFileSync(0, "utf8");
if (process.argv.includes("--batch")) {
  const results = {};
  for (const [name, text] of Object.entries(JSON.parse(input))) {
    results[name] = await parse(text);
  }
  console.log(JSON.stringify(results));
} else {
  const result = await parse(input);
  if (result.error !== undefined) {
    console.error(result.error);
    process.exit(1);
  }
  console.log(JSON.stringify(result));
}
