-- The protocol schema (editors/protocol.json, generated from lsp/protocol.py): command ids, titles, prompts,
-- settings and the stats method are read from it at run time, never spelled here, so the plugin cannot drift
-- from the server.
local M = {}

-- editors/nvim/lua/codespec/protocol.lua -> editors/protocol.json
local function default_path()
  local here = debug.getinfo(1, "S").source:sub(2)
  return vim.fs.normalize(vim.fn.fnamemodify(here, ":p:h:h:h:h") .. "/protocol.json")
end

--- Reads and decodes the schema; errors with the path when it is missing or malformed.
---@param path string|nil
function M.load(path)
  path = path or default_path()
  local ok, lines = pcall(vim.fn.readfile, path)
  if not ok or #lines == 0 then
    error(("codespec: cannot read the protocol schema %s"):format(path), 0)
  end
  -- luanil: JSON null (a command without a prompt) becomes nil, not vim.NIL
  local decoded_ok, schema =
    pcall(vim.json.decode, table.concat(lines, "\n"), { luanil = { object = true, array = true } })
  if not decoded_ok or type(schema) ~= "table" or not schema.commands then
    error(("codespec: %s is not a codespec protocol schema"):format(path), 0)
  end
  schema.path = path
  return schema
end

--- "codespec.rewriteSelection" -> "CodespecRewriteSelection": the user command for a server command.
function M.user_command_name(command_id)
  local name = command_id:gsub("^codespec%.", "")
  return "Codespec" .. name:sub(1, 1):upper() .. name:sub(2)
end

--- The argument the client asks the user for (the last one) when the command has a prompt.
function M.prompted_argument(command)
  if command.prompt then
    return command.arguments[#command.arguments].name
  end
end

return M
