-- codespec for Neovim: starts `codespec lsp`, shows inline completions, and exposes the refactoring commands.
--   require("codespec").setup({ settings = { max_tokens = 64 } })
local commands = require("codespec.commands")
local ghost = require("codespec.ghost")
local protocol = require("codespec.protocol")
local status = require("codespec.status")

local M = {}

M.defaults = {
  cmd = { "codespec", "lsp" }, -- how to start the server (a path or extra flags go here)
  filetypes = nil, -- nil: every buffer backed by a file; else a list such as { "python", "lua" }
  root_markers = { ".git", "pyproject.toml", "package.json" }, -- the workspace root; else the file's directory
  settings = {}, -- server settings, keys and defaults as in protocol.json "settings" (model, spec, max_tokens, ...)
  inline = "auto", -- "auto": vim.lsp.inline_completion when there (>= 0.12), else "extmarks"; false: off
  keys = { accept = "<Tab>", dismiss = "<C-]>", next = "<M-]>", prev = "<M-[>" }, -- insert mode; false: unmapped
  notify_progress = true, -- vim.notify when a server task (a refactoring) starts and ends
  notify_stats = false, -- vim.notify the speculation stats after every completion and command
  protocol = nil, -- path of protocol.json; nil: editors/protocol.json next to this plugin
}

M.config = nil
M.schema = nil

local function use_native_inline()
  return M.config.inline == "auto" and vim.lsp.inline_completion ~= nil
end

-- The settings table sent as initializationOptions and answered to workspace/configuration, checked
-- against the schema so a typo is reported instead of silently ignored.
local function server_settings()
  local known = {}
  for _, setting in ipairs(M.schema.settings) do
    known[setting.name] = true
  end
  for name in pairs(M.config.settings) do
    if not known[name] then
      vim.notify(("codespec: unknown setting %q (see %s)"):format(name, M.schema.path), vim.log.levels.WARN)
    end
  end
  return { [M.schema.settingsSection] = M.config.settings }
end

local function map_keys(bufnr)
  local keys = M.config.keys
  local function map(lhs, rhs, desc)
    if lhs then
      vim.keymap.set("i", lhs, rhs, { buffer = bufnr, expr = true, desc = "codespec: " .. desc })
    end
  end
  -- Each mapping falls back to its key's own meaning when there is no suggestion.
  map(keys.accept, function()
    return (M.accept(bufnr) and "") or keys.accept
  end, "accept the suggestion")
  map(keys.dismiss, function()
    return (M.dismiss(bufnr) and "") or keys.dismiss
  end, "dismiss the suggestion")
  if use_native_inline() then
    map(keys.next, function()
      vim.lsp.inline_completion.select({ count = 1 })
      return ""
    end, "next suggestion")
    map(keys.prev, function()
      vim.lsp.inline_completion.select({ count = -1 })
      return ""
    end, "previous suggestion")
  end
end

local function on_attach(client, bufnr)
  if M.config.inline then
    if use_native_inline() then
      vim.lsp.inline_completion.enable(true, { bufnr = bufnr })
    else
      ghost.attach(bufnr, client.name)
    end
    map_keys(bufnr)
  end
end

--- A server setting as configured, else its default from the schema.
function M.setting(name)
  if M.config.settings[name] ~= nil then
    return M.config.settings[name]
  end
  for _, setting in ipairs(M.schema.settings) do
    if setting.name == name then
      return setting.default
    end
  end
end

--- Accepts the suggestion shown in bufnr (default: current); false when there is none.
function M.accept(bufnr)
  bufnr = bufnr or vim.api.nvim_get_current_buf()
  if use_native_inline() then
    return vim.lsp.inline_completion.get({ bufnr = bufnr })
  end
  return ghost.accept(bufnr)
end

--- Hides the suggestion shown in bufnr; false when there is none.
function M.dismiss(bufnr)
  bufnr = bufnr or vim.api.nvim_get_current_buf()
  if use_native_inline() then
    -- 0.12 has no public dismiss: switching the buffer off and on drops the current item.
    local shown = #vim.api.nvim_buf_get_extmarks(bufnr, M.native_namespace(), 0, -1, { limit = 1 }) > 0
    vim.lsp.inline_completion.enable(false, { bufnr = bufnr })
    vim.lsp.inline_completion.enable(true, { bufnr = bufnr })
    return shown
  end
  return ghost.dismiss(bufnr)
end

--- The namespace Neovim draws its own inline completions in (>= 0.12).
function M.native_namespace()
  return vim.api.nvim_create_namespace("nvim.lsp.inline_completion")
end

--- Starts (or reuses) the server for bufnr.
function M.start(bufnr)
  local name = vim.api.nvim_buf_get_name(bufnr)
  if name == "" or vim.bo[bufnr].buftype ~= "" then
    return
  end
  local root = vim.fs.root(bufnr, M.config.root_markers) or vim.fs.dirname(name)
  local settings = server_settings()
  return vim.lsp.start({
    name = M.schema.server,
    cmd = M.config.cmd,
    root_dir = root,
    init_options = settings,
    settings = settings,
    handlers = { [M.schema.notifications.stats.method] = status.on_stats },
    on_attach = on_attach,
  }, { bufnr = bufnr })
end

function M.statusline()
  return status.statusline()
end

function M.setup(opts)
  M.config = vim.tbl_deep_extend("force", M.defaults, opts or {})
  M.schema = protocol.load(M.config.protocol)
  status.check_schema(M.schema)
  status.configure(M.config)
  M.user_commands = commands.create(M.schema)

  local group = vim.api.nvim_create_augroup("codespec", { clear = true })
  vim.api.nvim_create_autocmd("FileType", {
    group = group,
    pattern = M.config.filetypes or "*",
    callback = function(ev)
      M.start(ev.buf)
    end,
  })
  vim.api.nvim_create_autocmd("LspProgress", {
    group = group,
    callback = function(ev)
      local client = vim.lsp.get_client_by_id(ev.data.client_id)
      if client and client.name == M.schema.server and type(ev.data.params.value) == "table" then
        status.on_progress(ev.data.params.value)
      end
    end,
  })
  vim.api.nvim_create_user_command("CodespecStats", function()
    local stats = status.last_stats
    vim.notify(stats and ("codespec %s: %s"):format(stats.kind, status.format_stats(stats)) or "codespec: no stats yet")
  end, { desc = "codespec: the last completion's or command's speculation stats" })

  -- buffers opened before setup()
  for _, bufnr in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(bufnr) and vim.bo[bufnr].filetype ~= "" then
      local filetypes = M.config.filetypes
      if not filetypes or vim.tbl_contains(filetypes, vim.bo[bufnr].filetype) then
        M.start(bufnr)
      end
    end
  end
end

return M
