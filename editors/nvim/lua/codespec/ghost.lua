-- Inline completion for Neovim without vim.lsp.inline_completion (< 0.12): request
-- textDocument/inlineCompletion after typing pauses and draw the first item as ghost text with extmarks.
local util = require("codespec.util")

local M = {}

M.namespace = vim.api.nvim_create_namespace("codespec.ghost")

-- per buffer: { timer, request_id, client, item = { text, range, row, col, tick } }
local buffers = {}

local function clear(bufnr)
  local state = buffers[bufnr]
  if not state then
    return
  end
  if state.timer then
    state.timer:stop()
  end
  if state.request_id and state.client then
    util.cancel(state.client, state.request_id)
  end
  state.request_id, state.item = nil, nil
  if vim.api.nvim_buf_is_valid(bufnr) then
    vim.api.nvim_buf_clear_namespace(bufnr, M.namespace, 0, -1)
  end
end

local function item_text(item)
  local text = item.insertText
  -- a snippet is shown and inserted as its plain text
  return type(text) == "table" and text.value or text
end

-- Draws `item` at the cursor: the part of its first line not already typed inline, the rest as virtual lines.
local function show(bufnr, client, item, row, col)
  local text = item_text(item)
  local start_col = col
  if item.range then
    start_col = util.byte_col(bufnr, item.range.start, client.offset_encoding)
    local typed = vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1]:sub(start_col + 1, col)
    if item.range.start.line ~= row or text:sub(1, #typed) ~= typed then
      return -- a replacement that does not extend what is typed: nothing sensible to show inline
    end
    text = text:sub(#typed + 1)
  end
  if text == "" then
    return
  end
  local lines = vim.split(text, "\n", { plain = true })
  local virt_lines = {}
  for i = 2, #lines do
    virt_lines[#virt_lines + 1] = { { lines[i], "Comment" } }
  end
  vim.api.nvim_buf_set_extmark(bufnr, M.namespace, row, col, {
    virt_text = { { lines[1], "Comment" } },
    virt_text_pos = "inline",
    virt_lines = #virt_lines > 0 and virt_lines or nil,
    hl_mode = "combine",
  })
  buffers[bufnr].item = { text = item_text(item), range = item.range, start_col = start_col, row = row, col = col,
    tick = vim.api.nvim_buf_get_changedtick(bufnr), command = item.command }
end

local function request(bufnr, server_name)
  local client = util.client(bufnr, server_name)
  if not client or vim.api.nvim_get_current_buf() ~= bufnr or not vim.api.nvim_get_mode().mode:match("^i") then
    return
  end
  local state = buffers[bufnr]
  local cursor = vim.api.nvim_win_get_cursor(0)
  local row, col = cursor[1] - 1, cursor[2]
  local tick = vim.api.nvim_buf_get_changedtick(bufnr)
  local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
  params.context = { triggerKind = 2 } -- InlineCompletionTriggerKind.Automatic
  state.client = client
  state.request_id = util.request(client, "textDocument/inlineCompletion", params, function(err, result)
    state.request_id = nil
    if err or not result or vim.api.nvim_buf_get_changedtick(bufnr) ~= tick then
      return
    end
    local now = vim.api.nvim_win_get_cursor(0)
    if now[1] - 1 ~= row or now[2] ~= col or not vim.api.nvim_get_mode().mode:match("^i") then
      return -- the user moved on while the server was thinking
    end
    local items = result.items or result
    if items[1] then
      show(bufnr, client, items[1], row, col)
    end
  end, bufnr)
end

-- The server debounces typing itself (its debounce_ms setting) and drops superseded requests; this only
-- coalesces the bursts of events one keystroke makes (TextChangedI + CursorMovedI).
local REQUEST_DELAY_MS = 50

--- Starts ghost text for bufnr: requests after each keystroke or cursor move in insert mode.
function M.attach(bufnr, server_name)
  if buffers[bufnr] then
    return
  end
  buffers[bufnr] = { timer = vim.uv.new_timer() }
  local group = vim.api.nvim_create_augroup("codespec.ghost." .. bufnr, { clear = true })
  vim.api.nvim_create_autocmd({ "InsertEnter", "TextChangedI", "CursorMovedI" }, {
    group = group,
    buffer = bufnr,
    callback = function()
      clear(bufnr)
      buffers[bufnr].timer:start(REQUEST_DELAY_MS, 0, vim.schedule_wrap(function()
        request(bufnr, server_name)
      end))
    end,
  })
  vim.api.nvim_create_autocmd({ "InsertLeave", "BufLeave" }, { group = group, buffer = bufnr, callback = function()
    clear(bufnr)
  end })
  vim.api.nvim_create_autocmd("BufWipeout", { group = group, buffer = bufnr, callback = function()
    clear(bufnr)
    buffers[bufnr].timer:close()
    buffers[bufnr] = nil
  end })
end

--- The suggestion shown in bufnr, or nil.
function M.current(bufnr)
  local state = buffers[bufnr]
  local item = state and state.item
  if item and item.tick == vim.api.nvim_buf_get_changedtick(bufnr) then
    return item
  end
end

--- Inserts the shown suggestion; false when there is none (so a mapping can fall back to its key).
function M.accept(bufnr)
  local item = M.current(bufnr)
  if not item then
    return false
  end
  local client = buffers[bufnr].client
  clear(bufnr)
  -- A mapping's expression may not change the buffer (textlock): insert right after it.
  vim.schedule(function()
    local end_row, end_col = item.row, item.col
    if item.range then
      end_row = item.range["end"].line
      end_col = util.byte_col(bufnr, item.range["end"], client.offset_encoding)
    end
    local lines = vim.split(item.text, "\n", { plain = true })
    vim.api.nvim_buf_set_text(bufnr, item.row, item.start_col, end_row, end_col, lines)
    local last_col = (#lines == 1 and item.start_col or 0) + #lines[#lines]
    vim.api.nvim_win_set_cursor(0, { item.row + #lines, last_col })
    if item.command then
      util.request(client, "workspace/executeCommand", item.command, nil, bufnr)
    end
  end)
  return true
end

--- Hides the suggestion; false when there was none.
function M.dismiss(bufnr)
  local shown = M.current(bufnr) ~= nil
  clear(bufnr)
  return shown
end

return M
