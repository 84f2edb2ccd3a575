-- The server's refactoring commands as user commands on a range (:'<,'>CodespecRewriteSelection ...).
-- The server answers workspace/executeCommand with workspace/applyEdit, which Neovim applies itself.
local protocol = require("codespec.protocol")
local util = require("codespec.util")

local M = {}

-- The LSP range of the command's lines; the exact characters when they are the last charwise selection.
local function selection_range(bufnr, opts, encoding)
  local first, last = opts.line1 - 1, opts.line2 - 1
  local mark_start = vim.api.nvim_buf_get_mark(bufnr, "<")
  local mark_end = vim.api.nvim_buf_get_mark(bufnr, ">")
  local start_col, end_col = 0, math.huge
  if opts.range == 2 and vim.fn.visualmode() == "v" and mark_start[1] - 1 == first and mark_end[1] - 1 == last then
    local line = vim.api.nvim_buf_get_lines(bufnr, last, last + 1, false)[1]
    start_col = mark_start[2]
    -- '> is the first byte of the last selected character (or MAXCOL after v$): end after that character
    end_col = mark_end[2] < #line and mark_end[2] + 1 + vim.str_utf_end(line, mark_end[2] + 1) or #line
  end
  return {
    start = util.lsp_position(bufnr, first, start_col, encoding),
    ["end"] = util.lsp_position(bufnr, last, end_col, encoding),
  }
end

local function execute(client, command, bufnr, arguments)
  util.request(client, "workspace/executeCommand", { command = command.id, arguments = { arguments } }, function(err)
    if err then
      vim.notify(("%s failed: %s"):format(command.title, err.message or vim.inspect(err)), vim.log.levels.ERROR)
    end
  end, bufnr)
end

--- Runs a schema command on the range of a user command invocation (opts as given to the callback).
function M.run(server_name, command, opts)
  local bufnr = vim.api.nvim_get_current_buf()
  local client = util.client(bufnr, server_name)
  if not client then
    vim.notify("codespec: the language server is not attached to this buffer", vim.log.levels.ERROR)
    return
  end
  local arguments = { uri = vim.uri_from_bufnr(bufnr), range = selection_range(bufnr, opts, client.offset_encoding) }
  local prompted = protocol.prompted_argument(command)
  if not prompted then
    return execute(client, command, bufnr, arguments)
  end
  if opts.args ~= "" then
    arguments[prompted] = opts.args
    return execute(client, command, bufnr, arguments)
  end
  vim.ui.input({ prompt = command.prompt .. ": " }, function(answer)
    if answer and answer ~= "" then
      arguments[prompted] = answer
      execute(client, command, bufnr, arguments)
    end
  end)
end

--- Creates one user command per schema command; returns their names.
function M.create(schema)
  local names = {}
  for _, command in ipairs(schema.commands) do
    local name = protocol.user_command_name(command.id)
    vim.api.nvim_create_user_command(name, function(opts)
      M.run(schema.server, command, opts)
    end, {
      range = "%", -- no range: the whole buffer
      nargs = command.prompt and "*" or 0,
      desc = command.title .. (command.prompt and (" (argument: " .. command.prompt:lower() .. ")") or ""),
    })
    names[#names + 1] = name
  end
  return names
end

return M
