// A mocked `vscode` module and vscode-languageclient (neither can run outside VS Code): just enough API for
// extension.ts, recording what the extension does so tests can check it.
import Module from "node:module";

export interface FakeClientRecord {
  id: string;
  name: string;
  serverOptions: { command: string; args: string[] };
  clientOptions: any;
  notificationHandlers: Map<string, (params: unknown) => void>;
  sent: { type: unknown; params: unknown }[];
  requests: { type: unknown; params: unknown }[];
  started: boolean;
}

export const state = {
  configuration: {} as Record<string, unknown>,
  statusItems: [] as { text: string; tooltip: string; shown: boolean }[],
  commands: new Map<string, (...args: unknown[]) => unknown>(),
  errors: [] as string[],
  inputBoxAnswers: [] as (string | undefined)[],
  prompts: [] as string[],
  activeTextEditor: undefined as unknown,
  configurationListeners: [] as ((event: { affectsConfiguration(section: string): boolean }) => void)[],
  clients: [] as FakeClientRecord[],
  advertisedCommands: [] as string[],
  startError: undefined as Error | undefined,
};

export function reset(): void {
  state.configuration = {};
  state.statusItems = [];
  state.commands = new Map();
  state.errors = [];
  state.inputBoxAnswers = [];
  state.prompts = [];
  state.activeTextEditor = undefined;
  state.configurationListeners = [];
  state.clients = [];
  state.advertisedCommands = [];
  state.startError = undefined;
}

const vscode = {
  StatusBarAlignment: { Left: 1, Right: 2 },
  window: {
    createStatusBarItem: () => {
      const item = { text: "", tooltip: "", shown: false, show() { item.shown = true; }, dispose() {} };
      state.statusItems.push(item);
      return item;
    },
    showInputBox: async (options: { prompt: string }) => {
      state.prompts.push(options.prompt);
      return state.inputBoxAnswers.shift();
    },
    showErrorMessage: async (message: string) => {
      state.errors.push(message);
    },
    get activeTextEditor() {
      return state.activeTextEditor;
    },
  },
  workspace: {
    getConfiguration: (section: string) => ({
      get: <T>(name: string, fallback?: T) => {
        const value = state.configuration[`${section}.${name}`];
        return (value === undefined ? fallback : value) as T;
      },
    }),
    onDidChangeConfiguration: (listener: (event: any) => void) => {
      state.configurationListeners.push(listener);
      return { dispose() {} };
    },
  },
  commands: {
    registerCommand: (id: string, handler: (...args: unknown[]) => unknown) => {
      if (state.commands.has(id)) {
        throw new Error(`command '${id}' already exists`); // as VS Code does
      }
      state.commands.set(id, handler);
      return { dispose: () => state.commands.delete(id) };
    },
  },
};

class LanguageClient {
  record: FakeClientRecord;
  initializeResult: unknown;

  constructor(id: string, name: string, serverOptions: any, clientOptions: any) {
    this.record = {
      id, name, serverOptions, clientOptions,
      notificationHandlers: new Map(), sent: [], requests: [], started: false,
    };
    state.clients.push(this.record);
  }

  onNotification(method: string, handler: (params: unknown) => void) {
    this.record.notificationHandlers.set(method, handler);
    return { dispose() {} };
  }

  async start() {
    if (state.startError) {
      throw state.startError;
    }
    this.record.started = true;
    this.initializeResult = { capabilities: { executeCommandProvider: { commands: state.advertisedCommands } } };
  }

  async stop() {
    this.record.started = false;
  }

  async sendNotification(type: unknown, params: unknown) {
    this.record.sent.push({ type, params });
  }

  async sendRequest(type: unknown, params: unknown) {
    this.record.requests.push({ type, params });
    return null;
  }
}

const languageclient = {
  LanguageClient,
  DidChangeConfigurationNotification: { type: "workspace/didChangeConfiguration" },
  ExecuteCommandRequest: { type: "workspace/executeCommand" },
};

const mocks: Record<string, unknown> = { vscode, "vscode-languageclient/node": languageclient };
const originalLoad = (Module as any)._load;
(Module as any)._load = function (request: string, ...rest: unknown[]) {
  return request in mocks ? mocks[request] : originalLoad.call(this, request, ...rest);
};
