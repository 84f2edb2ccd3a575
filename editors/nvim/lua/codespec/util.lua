-- Small helpers that hide API differences between Neovim 0.10, 0.11 and 0.12.
local M = {}

local has_011 = vim.fn.has("nvim-0.11") == 1

--- client:request (0.11+) or client.request (0.10); returns the request id or nil.
function M.request(client, method, params, handler, bufnr)
  local ok, id
  if has_011 then
    ok, id = client:request(method, params, handler, bufnr)
  else
    ok, id = client.request(method, params, handler, bufnr)
  end
  return ok and id or nil
end

function M.cancel(client, request_id)
  if has_011 then
    client:cancel_request(request_id)
  else
    client.cancel_request(request_id)
  end
end

--- An LSP position (in the client's encoding) -> 0-based byte column on its line.
function M.byte_col(bufnr, position, encoding)
  local line = vim.api.nvim_buf_get_lines(bufnr, position.line, position.line + 1, false)[1] or ""
  if encoding == "utf-8" then
    return math.min(position.character, #line)
  end
  local ok, col
  if has_011 then
    ok, col = pcall(vim.str_byteindex, line, encoding, position.character, false)
  else
    ok, col = pcall(vim.str_byteindex, line, position.character, encoding == "utf-16")
  end
  return ok and col or #line
end

--- 0-based row and byte column -> an LSP position in the client's encoding.
function M.lsp_position(bufnr, row, col, encoding)
  local line = vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ""
  col = math.min(col, #line)
  return { line = row, character = col > 0 and vim.lsp.util.character_offset(bufnr, row, col, encoding) or 0 }
end

--- The codespec client attached to bufnr, if any.
function M.client(bufnr, name)
  return vim.lsp.get_clients({ bufnr = bufnr, name = name })[1]
end

return M
