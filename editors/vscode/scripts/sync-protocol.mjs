// Copies editors/protocol.json (generated from lsp/protocol.py) into src/, where tsc compiles it in: the
// extension takes every command id, title, prompt, setting and the stats method from it.
import { copyFileSync } from "node:fs";

copyFileSync(new URL("../../protocol.json", import.meta.url), new URL("../src/protocol.json", import.meta.url));
