// Rewrites package.json's contributed commands and settings from editors/protocol.json. Run it after the
// schema changes (`npm run update-manifest`); a test fails while package.json and the schema disagree.
import { readFileSync, writeFileSync } from "node:fs";
import { clientSettings, manifestContributions } from "../out/src/manifest.js";

const manifestUrl = new URL("../package.json", import.meta.url);
const manifest = JSON.parse(readFileSync(manifestUrl, "utf8"));
const schema = JSON.parse(readFileSync(new URL("../../protocol.json", import.meta.url), "utf8"));
const existing = manifest.contributes.configuration.properties;
manifest.contributes = manifestContributions(schema, existing, clientSettings);
writeFileSync(manifestUrl, JSON.stringify(manifest, null, 2) + "\n");
